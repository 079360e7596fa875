"""The local contacts backend's table, searched by search_contacts (used when no People API credentials are set)."""
from __future__ import annotations

from sqlalchemy import Integer, String, Text, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column

from models.calls import Base


class Contact(Base):
    """One person of a caller's address book (``owner``; '' for the shared demo contacts); ``email`` is
    the natural key within an owner's book (the demo loader's conflict target)."""

    __tablename__ = "contacts"
    __table_args__ = (UniqueConstraint("owner", "email", name="uq_contacts_owner_email"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    owner: Mapped[str] = mapped_column(String(100), nullable=False, server_default="")  # docs/promises.md, Callers
    name: Mapped[str] = mapped_column(String(200), nullable=False)
    email: Mapped[str | None] = mapped_column(String(320))
    phone: Mapped[str | None] = mapped_column(String(50))
    organization: Mapped[str | None] = mapped_column(String(200))
    notes: Mapped[str] = mapped_column(Text, nullable=False, server_default="")
