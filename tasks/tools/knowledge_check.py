"""knowledge_check: read; a training module's multiple-choice questions, or the score of
the caller's answers to them (local training tables, ``voice_tools_backends/training.py``).

Answers are letters, "A" for a question's first choice ("a" and " b " are accepted and
stored upper-case), one per question in question order. Scoring records nothing: the
score is in the call's result only.
"""
from __future__ import annotations

from typing import Any, Mapping

from marshmallow import Schema, fields, pre_load, validate

from models.training import ANSWER_LETTERS as LETTERS
from voice_tools_backends import training
from tasks.tools import PermanentError, Step, StepInput, Tool

NOT_BLANK = validate.Regexp(r"\S", error="Must not be blank.")


class KnowledgeCheckParameters(Schema):
    module = fields.String(required=True, validate=[validate.Length(min=1, max=200), NOT_BLANK],
                           metadata={"description": "The training module: its slug (security-awareness) or "
                                                    "title (Security awareness)"})
    answers = fields.List(
        fields.String(validate=validate.OneOf(LETTERS), metadata={"description": "A, B, C or D"}),
        validate=validate.Length(max=50),
        metadata={"description": "The caller's answers, one letter per question in order (A is the first "
                                 "choice). Leave out to get the questions."},
    )

    @pre_load
    def _tidy(self, data: Any, **_: Any) -> Any:
        """Spaces around the module and answers go; answers are upper-cased; a null or
        empty answer list means "ask me the questions"."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        if isinstance(data.get("module"), str):
            data["module"] = data["module"].strip()
        answers = data.get("answers", ())
        if answers is None or answers == []:
            del data["answers"]
        elif isinstance(answers, list):
            data["answers"] = [a.strip().upper() if isinstance(a, str) else a for a in answers]
        return data


class QuestionResult(Schema):
    number = fields.Integer(required=True)
    question = fields.String(required=True)
    choices = fields.List(fields.String(), required=True)


class AnswerResult(Schema):
    number = fields.Integer(required=True)
    given = fields.String(required=True)
    correct = fields.Boolean(required=True)
    expected = fields.String(required=True, validate=validate.OneOf(LETTERS))
    expected_choice = fields.String(required=True)


class KnowledgeCheckResult(Schema):
    """Always ``module``, ``title``, ``found``. Without answers: ``questions``; with
    answers: ``score`` (percent), ``correct``, ``total`` and ``results``. An unknown
    module: ``found`` false, ``title`` null, ``module`` as asked."""

    module = fields.String(required=True)
    title = fields.String(required=True, allow_none=True)
    found = fields.Boolean(required=True)
    questions = fields.List(fields.Nested(QuestionResult))
    score = fields.Integer()
    correct = fields.Integer()
    total = fields.Integer()
    results = fields.List(fields.Nested(AnswerResult))


def load_questions(step: StepInput) -> dict[str, Any]:
    module = training.find_module(step.parameters["module"], step.caller)
    if module is None:
        return {"module": None, "asked": step.parameters["module"], "questions": []}
    return {"module": {"module": module["module"], "title": module["title"]},
            "questions": training.questions(module["module"], step.caller)}


def score(key: list[Mapping[str, Any]], answers: list[str]) -> dict[str, Any]:
    """Score ``answers`` against the answer ``key`` (same length)."""
    results = []
    for item, given in zip(key, answers):
        expected = item["answer"]
        index = LETTERS.index(expected)
        choice = item["choices"][index] if index < len(item["choices"]) else ""
        results.append({"number": item["number"], "given": given, "correct": given == expected,
                        "expected": expected, "expected_choice": choice})
    correct = sum(1 for r in results if r["correct"])
    return {"score": round(100 * correct / len(results)) if results else 0, "correct": correct,
            "total": len(results), "results": results}


def check_answers(step: StepInput) -> dict[str, Any]:
    answers = step.parameters.get("answers")
    loaded = step.outputs["LOADING_QUESTIONS"]
    if not answers or loaded["module"] is None:
        return {"scored": False}
    key = training.answer_key(loaded["module"]["module"], step.caller)
    if not key:
        raise PermanentError(f"{loaded['module']['title']} has no questions yet")
    if len(answers) != len(key):
        raise PermanentError(f"{len(key)} answer{'s were' if len(key) != 1 else ' was'} expected, "
                             f"{len(answers)} given")
    return {"scored": True, **score(key, answers)}


def result(outputs: Mapping[str, Any]) -> dict[str, Any]:
    loaded, checked = outputs["LOADING_QUESTIONS"], outputs["CHECKING_ANSWERS"]
    module = loaded["module"]
    if module is None:
        return {"module": loaded["asked"], "title": None, "found": False, "questions": []}
    head = {"module": module["module"], "title": module["title"], "found": True}
    if checked.get("scored"):
        return {**head, **{k: checked[k] for k in ("score", "correct", "total", "results")}}
    return {**head, "questions": loaded["questions"]}


def read_question(question: Mapping[str, Any]) -> str:
    choices = "; ".join(f"{letter}, {text}" for letter, text in zip(LETTERS, question["choices"]))
    return f"Question {question['number']}: {question['question']} {choices}."


def voice_response(parameters: Mapping[str, Any], result: Mapping[str, Any] | None = None, **_: Any) -> str:
    result = result or {}
    if not result.get("found"):
        return f"I couldn't find a training module called {parameters.get('module')}."
    title = result["title"]
    if "results" in result:
        said = f"You got {result['correct']} of {result['total']} right, {result['score']} percent."
        wrong = [r for r in result["results"] if not r["correct"]]
        if not wrong:
            return said + f" Well done on {title}."
        fixes = [f"Question {r['number']}'s answer is {r['expected']}: {r['expected_choice']}." for r in wrong[:3]]
        if len(wrong) > 3:
            fixes.append(f"{len(wrong) - 3} more were wrong.")
        return " ".join([said, *fixes])
    questions = result.get("questions") or []
    if not questions:
        return f"{title} has no knowledge check questions yet."
    count = f"{len(questions)} question{'s' if len(questions) != 1 else ''}"
    return (f"The {title} knowledge check has {count}; answer each with a letter. "
            f"{read_question(questions[0])}")


def _scoring(parameters: Mapping[str, Any]) -> bool:
    return bool(parameters.get("answers"))


def _failure(parameters: Mapping[str, Any], error: str = "", **_: Any) -> str:
    module = parameters.get("module")
    if _scoring(parameters):
        return f"The knowledge check for {module} was not scored: {error}."
    return f"I could not get the knowledge check questions for {module}: {error}."


def _what(parameters: Mapping[str, Any]) -> str:
    n = len(parameters.get("answers") or [])
    module = parameters.get("module")
    if n:
        return f"score your {n} answer{'s' if n != 1 else ''} to the {module} knowledge check"
    return f"get the {module} knowledge check questions"


TOOL = Tool(
    name="knowledge_check",
    description="Quiz the caller on a training module: without answers, get the module's multiple-choice "
                "questions; with answers (one letter per question, in order), score them. Records nothing.",
    schema=KnowledgeCheckParameters,
    action_level="read",
    steps=(
        Step("LOADING_QUESTIONS", run=load_questions, message="Getting the {module} knowledge check."),
        Step("CHECKING_ANSWERS", run=check_answers,
             message=lambda p, **_: "Checking your answers." if _scoring(p) else "Getting the questions ready."),
        Step("COMPLETED", message="Knowledge check done."),
    ),
    result=result,
    confirmation_message=lambda p, **_: f"Ready to {_what(p)}. Confirm to proceed.",
    start_message=lambda p, **_: (f"Scoring your answers to the {p.get('module')} knowledge check." if _scoring(p)
                                  else f"Getting the {p.get('module')} knowledge check questions."),
    modified_message=lambda p, **_: f"Updated: I will {_what(p)}. Confirm?",
    voice_response=voice_response,
    failure_response=_failure,
    cancelled_response=lambda p, **_: ("Cancelled. Your answers were not scored." if _scoring(p)
                                       else "Cancelled. The knowledge check was not started."),
    time_limit=30,
    example={"module": "security-awareness", "answers": ["C", "B", "A", "C", "B"]},
    result_schema=KnowledgeCheckResult,
)
