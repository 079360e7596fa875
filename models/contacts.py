"""The local contacts backend's table, searched by search_contacts (used when no People API credentials are set)."""
from __future__ import annotations

from sqlalchemy import Integer, String, Text
from sqlalchemy.orm import Mapped, mapped_column

from models.calls import Base


class Contact(Base):
    """One person of the caller's address book; ``email`` is the natural key (the demo loader's conflict target)."""

    __tablename__ = "contacts"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(200), nullable=False)
    email: Mapped[str | None] = mapped_column(String(320), unique=True)
    phone: Mapped[str | None] = mapped_column(String(50))
    organization: Mapped[str | None] = mapped_column(String(200))
    notes: Mapped[str] = mapped_column(Text, nullable=False, server_default="")
