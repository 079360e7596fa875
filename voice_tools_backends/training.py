"""Training records: learners, modules, their progress and the modules' knowledge checks.

Local only (PostgreSQL tables of ``models/training.py``); there is no remote training
service. Every function is a read but ``load_demo``. A learner is found by email
(case-insensitive) or id; a module by slug or title (case-insensitive). A read for a caller
sees the caller's own learners and modules and the shared ones (the demo set), its own first;
never another caller's (docs/promises.md, Callers).
"""
from __future__ import annotations

from typing import Any

from sqlalchemy import func, or_, select
from sqlalchemy.dialects.postgresql import insert

from models import db
from models.training import KnowledgeQuestion, Learner, TrainingModule, TrainingProgress
from voice_tools_backends import SHARED, seen_by


def find_learner(who: str, caller: str = "") -> dict[str, Any] | None:
    """``{id, name, email}`` of ``caller``'s learner with this email or id, or None."""
    who = who.strip()
    stmt = select(Learner).where(seen_by(Learner.owner, caller),
                                 or_(func.lower(Learner.email) == who.lower(), Learner.id == who))
    with db.session() as s:
        learner = s.scalars(stmt.order_by(Learner.owner.desc(), Learner.id).limit(1)).first()
    return None if learner is None else {"id": learner.id, "name": learner.name, "email": learner.email}


def _module_matches(what: str, caller: str):
    what = what.strip().lower()
    return seen_by(TrainingModule.owner, caller) & or_(func.lower(TrainingModule.id) == what,
                                                      func.lower(TrainingModule.title) == what)


def _own_first() -> tuple[Any, ...]:
    return (TrainingModule.owner.desc(), TrainingModule.id)


def find_module(what: str, caller: str = "") -> dict[str, Any] | None:
    """``{module, title, description, lessons_total}`` of ``caller``'s module with this slug or title, or None."""
    with db.session() as s:
        module = s.scalars(select(TrainingModule).where(_module_matches(what, caller)).order_by(*_own_first())
                           .limit(1)).first()
    return None if module is None else _module(module)


def _module(module: TrainingModule) -> dict[str, Any]:
    return {"module": module.id, "title": module.title, "description": module.description,
            "lessons_total": module.lesson_count}


def _entry(module: TrainingModule, progress: TrainingProgress | None) -> dict[str, Any]:
    return {
        "module": module.id,
        "title": module.title,
        "status": progress.status if progress else "not_started",
        "lessons_completed": min(progress.lessons_completed, module.lesson_count) if progress else 0,
        "lessons_total": module.lesson_count,
        "score": progress.score if progress else None,
    }


def progress(learner_id: str, module: str | None = None, caller: str = "") -> dict[str, Any]:
    """The progress of ``caller``'s learner: ``{module_found, modules: [{module, title, status,
    lessons_completed, lessons_total, score}]}``.

    Without ``module``: every module assigned to the learner (one with a progress
    row), in title order. With it: that one module, "not_started" when the learner
    has no row for it; ``module_found`` is False (and ``modules`` empty) when no
    module has that slug or title.
    """
    joined = TrainingProgress.module_id == TrainingModule.id
    learner = TrainingProgress.learner_id.in_(
        select(Learner.id).where(Learner.id == learner_id, seen_by(Learner.owner, caller)))
    with db.session() as s:
        if module is None:
            rows = s.execute(
                select(TrainingModule, TrainingProgress).join(TrainingProgress, joined)
                .where(learner, seen_by(TrainingModule.owner, caller)).order_by(TrainingModule.title)
            ).all()
            return {"module_found": True, "modules": [_entry(m, p) for m, p in rows]}
        found = s.execute(
            select(TrainingModule, TrainingProgress)
            .outerjoin(TrainingProgress, joined & learner)
            .where(_module_matches(module, caller)).order_by(*_own_first()).limit(1)
        ).first()
    if found is None:
        return {"module_found": False, "modules": []}
    return {"module_found": True, "modules": [_entry(*found)]}


def _of_module(module_id: str, caller: str) -> Any:
    """The questions of ``module_id`` when it is one of ``caller``'s modules (or a shared one)."""
    return KnowledgeQuestion.module_id.in_(
        select(TrainingModule.id).where(TrainingModule.id == module_id, seen_by(TrainingModule.owner, caller)))


def questions(module_id: str, caller: str = "") -> list[dict[str, Any]]:
    """The questions of ``caller``'s module in order, without their answers: ``[{number, question, choices}]``."""
    stmt = (select(KnowledgeQuestion.number, KnowledgeQuestion.question, KnowledgeQuestion.choices)
            .where(_of_module(module_id, caller)).order_by(KnowledgeQuestion.number))
    with db.session() as s:
        return [{"number": n, "question": q, "choices": list(c)} for n, q, c in s.execute(stmt)]


def answer_key(module_id: str, caller: str = "") -> list[dict[str, Any]]:
    """The answers of ``caller``'s module in question order: ``[{number, answer, choices}]``."""
    stmt = (select(KnowledgeQuestion.number, KnowledgeQuestion.answer, KnowledgeQuestion.choices)
            .where(_of_module(module_id, caller)).order_by(KnowledgeQuestion.number))
    with db.session() as s:
        return [{"number": n, "answer": a, "choices": list(c)} for n, a, c in s.execute(stmt)]


# -- the demo data set --------------------------------------------------------------------

DEMO_LEARNERS = [
    ("lrn-1001", "john.smith@example.com", "John Smith"),
    ("lrn-1002", "ann.lee@example.com", "Ann Lee"),
    ("lrn-1003", "maria.garcia@example.com", "Maria Garcia"),
    ("lrn-1004", "david.chen@example.com", "David Chen"),
]

DEMO_MODULES = [
    ("product-basics", "Product basics", "What the product does, its plans, and where customers get help.", 6),
    ("security-awareness", "Security awareness", "Phishing, passwords, clean desks and handling data safely.", 10),
    ("sales-onboarding", "Sales onboarding", "The CRM, discovery calls, demos, follow-ups and discounts.", 8),
    ("data-privacy", "Data privacy", "Personal data, customers' rights and what to do after a mistake.", 5),
]

# (learner's email, module, lessons completed, status, score)
DEMO_PROGRESS = [
    ("john.smith@example.com", "product-basics", 6, "completed", 92),
    ("john.smith@example.com", "sales-onboarding", 8, "completed", 85),
    ("john.smith@example.com", "security-awareness", 4, "in_progress", None),
    ("ann.lee@example.com", "product-basics", 6, "completed", 100),
    ("ann.lee@example.com", "security-awareness", 10, "completed", 80),
    ("ann.lee@example.com", "data-privacy", 2, "in_progress", None),
    ("ann.lee@example.com", "sales-onboarding", 0, "not_started", None),
    ("maria.garcia@example.com", "product-basics", 3, "in_progress", None),
    ("maria.garcia@example.com", "security-awareness", 0, "not_started", None),
    ("david.chen@example.com", "product-basics", 0, "not_started", None),
    ("david.chen@example.com", "security-awareness", 0, "not_started", None),
    ("david.chen@example.com", "sales-onboarding", 0, "not_started", None),
]

# module: [(question, choices, answer letter)], numbered from 1
DEMO_QUESTIONS = {
    "product-basics": [
        ("Which plan includes single sign-on?", ["Starter", "Team", "Business", "Enterprise"], "D"),
        ("Where do customers open a support ticket?",
         ["By email to the sales team", "In the Help Center", "On the status page", "By calling the office"], "B"),
        ("How long is the free trial?", ["7 days", "14 days", "30 days", "60 days"], "B"),
        ("Which report shows usage by team?",
         ["The activity dashboard", "The billing report", "The audit log", "The invoice"], "A"),
    ],
    "security-awareness": [
        ("What should you do with an email that asks you to confirm your password?",
         ["Reply with your password", "Click the link to check it", "Report it to the security team",
          "Forward it to a colleague"], "C"),
        ("How long should a password be, at least?",
         ["6 characters", "8 characters", "12 characters", "It does not matter"], "C"),
        ("What do you do when you leave your desk?",
         ["Lock your screen", "Turn off the monitor", "Close your email", "Nothing, the office is safe"], "A"),
        ("Where may you store customer data?",
         ["A personal cloud drive", "A USB stick", "Approved company systems only", "Your home computer"], "C"),
        ("Someone you don't know follows you through a secure door. What do you do?",
         ["Hold the door for them", "Ask them to badge in themselves", "Ignore it", "Call the police"], "B"),
    ],
    "sales-onboarding": [
        ("Where do you log every customer call?", ["The CRM", "A spreadsheet", "The wiki", "Your email"], "A"),
        ("How soon should you follow up after a demo?",
         ["Within a day", "Within a week", "Within a month", "Only if they ask"], "A"),
        ("Who approves a discount above 20 percent?",
         ["You", "Your sales manager", "The customer", "Finance, after the deal closes"], "B"),
        ("What comes first in a discovery call?",
         ["The price", "A product demo", "The customer's goals and problems", "The contract"], "C"),
    ],
    "data-privacy": [
        ("What is personal data?",
         ["Only a person's name", "Any information about an identifiable person", "Only financial records",
          "Only data stored abroad"], "B"),
        ("A customer asks for a copy of their data. How long do we have to answer?",
         ["One week", "One month", "Six months", "There is no limit"], "B"),
        ("You sent customer data to the wrong person. What do you do?",
         ["Nothing", "Ask them to delete it and say nothing", "Report it to the privacy team at once",
          "Wait to see if they complain"], "C"),
    ],
}


def load_demo() -> int:
    """Add the shared demo learners, modules, progress and questions that are missing; rows added.

    Safe to run twice: each insert skips rows whose natural key (email or id, slug,
    learner + module, module + number) is already there, and never changes them.
    """
    added = 0
    with db.session() as s:
        # no conflict target: a learner may clash on its id or on its email, both natural keys
        added += s.execute(insert(Learner).values(
            [{"id": i, "email": e, "name": n} for i, e, n in DEMO_LEARNERS]).on_conflict_do_nothing()).rowcount
        added += s.execute(insert(TrainingModule).values(
            [{"id": i, "title": t, "description": d, "lesson_count": c} for i, t, d, c in DEMO_MODULES]
        ).on_conflict_do_nothing(index_elements=["id"])).rowcount
        # the learners as they are stored (an address already there keeps its own id)
        emails = [e for _, e, _ in DEMO_LEARNERS]
        ids = dict(s.execute(select(func.lower(Learner.email), Learner.id)
                             .where(Learner.owner == SHARED, func.lower(Learner.email).in_(emails))).all())
        added += s.execute(insert(TrainingProgress).values([
            {"learner_id": ids[email], "module_id": module, "lessons_completed": done, "status": status,
             "score": score}
            for email, module, done, status, score in DEMO_PROGRESS if email in ids]
        ).on_conflict_do_nothing(index_elements=["learner_id", "module_id"])).rowcount
        added += s.execute(insert(KnowledgeQuestion).values([
            {"module_id": module, "number": number, "question": q, "choices": choices, "answer": answer}
            for module, items in DEMO_QUESTIONS.items()
            for number, (q, choices, answer) in enumerate(items, start=1)]
        ).on_conflict_do_nothing(index_elements=["module_id", "number"])).rowcount
    return added
