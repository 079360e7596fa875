"""The local training tables read by get_training_progress and knowledge_check.

A learner's ``training_progress`` rows are the modules assigned to them (a module
with no row for a learner is not assigned; asked about it by name, it counts as not
started). ``knowledge_questions`` hold each module's multiple-choice questions; the
answer is a letter, A for the first choice. Learners and modules belong to an ``owner`` (a
caller; '' for the shared demo set every caller sees); a progress row belongs to its learner's
owner and a question to its module's.
"""
from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import CheckConstraint, DateTime, ForeignKey, Index, Integer, String, Text, func, text
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import Mapped, mapped_column

from models.calls import Base

PROGRESS_STATUSES = ("not_started", "in_progress", "completed")
ANSWER_LETTERS = ("A", "B", "C", "D")


class Learner(Base):
    __tablename__ = "learners"
    __table_args__ = (
        # the lookup is case-insensitive, so two spellings of one address are one learner (of an owner)
        Index("uq_learners_owner_email_lower", "owner", text("lower(email)"), unique=True),
    )

    id: Mapped[str] = mapped_column(String(50), primary_key=True)
    owner: Mapped[str] = mapped_column(String(100), nullable=False, server_default="")  # docs/promises.md, Callers
    email: Mapped[str] = mapped_column(String(254), nullable=False)  # unique, case-insensitively (above)
    name: Mapped[str] = mapped_column(String(200), nullable=False)


class TrainingModule(Base):
    __tablename__ = "training_modules"
    __table_args__ = (CheckConstraint("lesson_count > 0", name="training_modules_lessons_positive"),
                      Index("ix_training_modules_owner", "owner"))

    id: Mapped[str] = mapped_column(String(100), primary_key=True)  # the slug, e.g. security-awareness
    owner: Mapped[str] = mapped_column(String(100), nullable=False, server_default="")  # docs/promises.md, Callers
    title: Mapped[str] = mapped_column(String(200), nullable=False)
    description: Mapped[str] = mapped_column(Text, nullable=False, server_default="")
    lesson_count: Mapped[int] = mapped_column(Integer, nullable=False)


class TrainingProgress(Base):
    __tablename__ = "training_progress"
    __table_args__ = (
        CheckConstraint("status IN ('not_started', 'in_progress', 'completed')", name="training_progress_status"),
        CheckConstraint("lessons_completed >= 0", name="training_progress_lessons"),
        CheckConstraint("score IS NULL OR (score >= 0 AND score <= 100)", name="training_progress_score"),
    )

    learner_id: Mapped[str] = mapped_column(String(50), ForeignKey("learners.id", ondelete="CASCADE"),
                                            primary_key=True)
    module_id: Mapped[str] = mapped_column(String(100), ForeignKey("training_modules.id", ondelete="CASCADE"),
                                           primary_key=True)
    lessons_completed: Mapped[int] = mapped_column(Integer, nullable=False, server_default="0")
    status: Mapped[str] = mapped_column(String(20), nullable=False, server_default="not_started")
    score: Mapped[int | None] = mapped_column(Integer, nullable=True)  # percent, once assessed
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False, server_default=func.now())


class KnowledgeQuestion(Base):
    __tablename__ = "knowledge_questions"
    __table_args__ = (
        CheckConstraint("number >= 1", name="knowledge_questions_number"),
        CheckConstraint("answer IN ('A', 'B', 'C', 'D')", name="knowledge_questions_answer"),
        CheckConstraint("jsonb_typeof(choices) = 'array'", name="knowledge_questions_choices"),
    )

    module_id: Mapped[str] = mapped_column(String(100), ForeignKey("training_modules.id", ondelete="CASCADE"),
                                           primary_key=True)
    number: Mapped[int] = mapped_column(Integer, primary_key=True)  # 1, 2, 3 … within the module
    question: Mapped[str] = mapped_column(Text, nullable=False)
    choices: Mapped[list[Any]] = mapped_column(JSONB, nullable=False)  # ["text of A", "text of B", …]
    answer: Mapped[str] = mapped_column(String(1), nullable=False)  # the letter of the right choice
