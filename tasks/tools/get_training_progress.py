"""get_training_progress: read; how far a learner is in their training modules
(local training tables, ``voice_tools_backends/training.py``)."""
from __future__ import annotations

from typing import Any, Mapping

from marshmallow import Schema, fields, pre_load, validate

from models.training import PROGRESS_STATUSES
from voice_tools_backends import training
from tasks.tools import Step, StepInput, Tool

NOT_BLANK = validate.Regexp(r"\S", error="Must not be blank.")


class GetTrainingProgressParameters(Schema):
    learner = fields.String(required=True, validate=[validate.Length(min=1, max=254), NOT_BLANK],
                            metadata={"description": "The learner's email address or learner id"})
    module = fields.String(validate=[validate.Length(min=1, max=200), NOT_BLANK],
                           metadata={"description": "Only this training module: its slug (security-awareness) or "
                                                    "title (Security awareness); leave out for every module"})

    @pre_load
    def _tidy(self, data: Any, **_: Any) -> Any:
        """Surrounding spaces are not part of a name; a null module means every module."""
        if not isinstance(data, dict):
            return data
        data = {k: (v.strip() if isinstance(v, str) else v) for k, v in data.items()}
        if data.get("module", "") is None:
            del data["module"]
        return data


class LearnerResult(Schema):
    id = fields.String(required=True)
    name = fields.String(required=True)
    email = fields.String(required=True)


class ModuleProgressResult(Schema):
    module = fields.String(required=True)
    title = fields.String(required=True)
    status = fields.String(required=True, validate=validate.OneOf(PROGRESS_STATUSES))
    lessons_completed = fields.Integer(required=True)
    lessons_total = fields.Integer(required=True)
    score = fields.Integer(required=True, allow_none=True)


class GetTrainingProgressResult(Schema):
    """``found`` is False when the learner (or the module asked for) is unknown; ``missing``
    then says which ("learner" or "module"); ``learner`` is null for an unknown learner."""

    found = fields.Boolean(required=True)
    missing = fields.String(required=True, allow_none=True, validate=validate.OneOf(["learner", "module"]))
    learner = fields.Nested(LearnerResult, required=True, allow_none=True)
    modules = fields.List(fields.Nested(ModuleProgressResult), required=True)


def find_learner(step: StepInput) -> dict[str, Any]:
    return {"learner": training.find_learner(step.parameters["learner"], step.caller)}


def read_progress(step: StepInput) -> dict[str, Any]:
    learner = step.outputs["FINDING_LEARNER"]["learner"]
    if learner is None:
        return {"module_found": True, "modules": []}
    return training.progress(learner["id"], step.parameters.get("module"), step.caller)


def result(outputs: Mapping[str, Any]) -> dict[str, Any]:
    learner = outputs["FINDING_LEARNER"]["learner"]
    read = outputs["READING_PROGRESS"]
    missing = "learner" if learner is None else (None if read["module_found"] else "module")
    return {"found": missing is None, "missing": missing, "learner": learner, "modules": read["modules"]}


def percent(done: int, total: int) -> int:
    return round(100 * done / total) if total else 0


def _one_module(name: str, entry: Mapping[str, Any]) -> str:
    title = entry["title"]
    if entry["status"] == "completed":
        score = f", with a score of {entry['score']} percent" if entry.get("score") is not None else ""
        return f"{name} has completed {title}{score}."
    if entry["status"] == "in_progress":
        return f"{name} is {entry['lessons_completed']} of {entry['lessons_total']} lessons into {title}."
    return f"{name} has not started {title} yet."


def _every_module(name: str, modules: list[Mapping[str, Any]]) -> str:
    if not modules:
        return f"{name} has no training modules assigned."
    done = sum(1 for m in modules if m["status"] == "completed")
    if done == len(modules):
        return f"{name} has completed all {done} training modules." if done > 1 else \
            f"{name} has completed {modules[0]['title']}."
    said = f"{name} has completed {done} of {len(modules)} modules"
    going = [m for m in modules if m["status"] == "in_progress"]
    parts = [f"{m['title']} is {percent(m['lessons_completed'], m['lessons_total'])} percent done" for m in going[:3]]
    if len(going) > 3:
        parts.append(f"{len(going) - 3} more are under way")
    return said + ("; " + " and ".join(parts) if parts else "") + "."


def voice_response(parameters: Mapping[str, Any], result: Mapping[str, Any] | None = None, **_: Any) -> str:
    result = result or {}
    if result.get("missing") == "learner" or not result.get("learner"):
        return f"I couldn't find a learner called {parameters.get('learner')}."
    if result.get("missing") == "module":
        return f"I couldn't find a training module called {parameters.get('module')}."
    name = result["learner"]["name"]
    if parameters.get("module"):
        return _one_module(name, result["modules"][0])
    return _every_module(name, result["modules"])


def _whose(parameters: Mapping[str, Any]) -> str:
    module = parameters.get("module")
    learner = parameters.get("learner")
    return f"the progress of {learner} in {module}" if module else f"the training progress of {learner}"


TOOL = Tool(
    name="get_training_progress",
    description="Tell how far a learner (by email or learner id) is in their training modules, "
                "or in one module; lessons completed, status and score.",
    schema=GetTrainingProgressParameters,
    action_level="read",
    steps=(
        Step("FINDING_LEARNER", run=find_learner, message="Looking up {learner}."),
        Step("READING_PROGRESS", run=read_progress, message=lambda p, **_: f"Reading {_whose(p)}."),
        Step("COMPLETED", message="Training progress read."),
    ),
    result=result,
    confirmation_message=lambda p, **_: f"Ready to look up {_whose(p)}. Confirm to proceed.",
    start_message=lambda p, **_: f"Looking up {_whose(p)}.",
    modified_message=lambda p, **_: f"Updated to {_whose(p)}. Confirm?",
    voice_response=voice_response,
    failure_response=lambda p, error="", **_: f"I could not look up {_whose(p)}: {error}.",
    cancelled_response="Cancelled. The training progress was not looked up.",
    time_limit=30,
    example={"learner": "john.smith@example.com"},
    result_schema=GetTrainingProgressResult,
)
