"""The tool registry: the only list of tools.

A tool is one module in this package that defines ``TOOL = Tool(...)``: its name,
description, parameter schema (marshmallow), action level, steps and the sentences
the assistant speaks. It never touches status, HTTP or Celery: the ``Link`` task in
``tasks/chains.py`` does that for every tool. Adding a tool is adding one module.
"""
from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from marshmallow import Schema

Message = str | Callable[..., str]


class TransientError(Exception):
    """A failure worth retrying (timeout, 429, 5xx, connection refused)."""


class PermanentError(Exception):
    """A failure that retrying will not fix; the call ends FAILED."""


TRANSIENT_HTTP_STATUSES = frozenset({408, 425, 429, 500, 502, 503, 504})


def is_transient(exc: BaseException) -> bool:
    """Is ``exc`` worth retrying? TransientError, a backend's ``Unavailable``, a lost database or HTTP connection,
    a timeout, or an HTTP answer of 429 / 5xx from any client library (``requests``,
    ``googleapiclient``'s ``HttpError.resp.status``, ``openai``'s ``status_code``)."""
    import requests
    from sqlalchemy.exc import InterfaceError, OperationalError

    from voice_tools_backends import Unavailable

    if isinstance(exc, (TransientError, Unavailable, OperationalError, InterfaceError, TimeoutError, ConnectionError,
                        requests.ConnectionError, requests.Timeout)):
        return True
    response = getattr(exc, "response", None)
    status = (getattr(exc, "status_code", None) or getattr(getattr(exc, "resp", None), "status", None)
              or getattr(response, "status_code", None))
    try:
        return int(status) in TRANSIENT_HTTP_STATUSES
    except (TypeError, ValueError):
        return False


@dataclass(frozen=True)
class StepInput:
    """What a step function sees: the call's parameters and earlier steps' outputs."""

    tool_call_id: str
    session_id: str
    parameters: Mapping[str, Any]
    outputs: Mapping[str, Any]
    caller: str = ""  # whose call: session context is the caller's own ('' for a call without one)
    # a side-effect step only: an earlier attempt of this step may have acted (it claimed the
    # step before: its lease lapsed, its process died, or it failed in a way that is retried), so
    # the step must find out what it did before acting again
    earlier_attempt: bool = False


@dataclass(frozen=True)
class Step:
    """One link of a tool's chain; its name is its events' ``step`` and its task's ``tools.<tool>.<STEP>``.

    ``run`` returns a JSON-able output stored on the call (``step_outputs``) so a
    redelivered link skips a step already done. A ``checkpoint`` step has no ``run``:
    it sets PREPARED and ends the chain until resumed; its ``preview`` says what will
    happen. A ``side_effect`` step is the point of no return (docs/promises.md, 'The
    point of no return'). ``message`` is the sentence of its progress callback.
    """

    name: str
    run: Callable[[StepInput], Any] | None = None
    message: Message = ""
    checkpoint: bool = False
    side_effect: bool = False
    preview: Callable[[StepInput], dict[str, Any]] | None = None


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    schema: type[Schema]
    action_level: str
    steps: tuple[Step, ...]
    result: Callable[[Mapping[str, Any]], dict[str, Any]]
    confirmation_message: Message
    start_message: Message
    modified_message: Message
    voice_response: Message
    failure_response: Message
    cancelled_response: Message
    # said when a call stuck past its point of no return is given up: the side
    # effect may or may not have happened, and the caller must not be told "not done"
    unconfirmed_response: Message = "I could not confirm that the {tool} request went through. Please check before trying again."
    # said when a step after a completed side effect fails: the effect did happen
    after_effect_failure_response: Message = "The {tool} request went through, but a later step failed: {error}."
    time_limit: int = 60
    max_retries: int = 5
    # the Procfile worker line that consumes this tool's queue (``--group``); by
    # default ``writes`` for tools with a side effect, ``reads`` for the others
    group: str = ""
    # parameters a caller might give: the benchmark and the tests that run every tool end
    # to end use them
    example: Mapping[str, Any] = field(default_factory=dict)
    # the stated shape of ``result`` (docs/relay-guide.md, 'The tools'), checked by the tests
    result_schema: type[Schema] | None = None

    @property
    def worker_group(self) -> str:
        return self.group or ("writes" if self.action_level == "write" else "reads")

    @property
    def queue(self) -> str:
        return f"tools.{self.name}"

    @property
    def spoken_name(self) -> str:
        """``send_email`` → ``send email`` (for the generic sentences)."""
        return self.name.replace("_", " ")

    def task_name(self, step: Step) -> str:
        return f"tools.{self.name}.{step.name}"

    def step_index(self, name: str) -> int:
        return [s.name for s in self.steps].index(name)

    def failure_sentence(self, step: Step, done: Mapping[str, Any], refused: bool) -> Message:
        """What to say when ``step`` fails, given the steps ``done`` so far.

        Before the point of no return, or when the side effect's own service refused
        it (``refused``), it did not happen; once the side effect step is recorded
        done, it did; in between (a timeout, a lost answer, a crash) nobody knows, and
        the caller is told so rather than "not sent".
        """
        effect = next((s for s in self.steps if s.side_effect), None)
        if effect is None or self.steps.index(step) < self.steps.index(effect):
            return self.failure_response
        if effect.name in done:
            return self.after_effect_failure_response
        return self.failure_response if step is effect and refused else self.unconfirmed_response

    def failure_outcome(self, step: Step, done: Mapping[str, Any], refused: bool) -> str:
        """What :meth:`failure_sentence` says, as the call's ``outcome``: ``not_done``, ``done`` (a
        step after the side effect failed) or ``unconfirmed`` (docs/promises.md, "Exactly once")."""
        sentence = self.failure_sentence(step, done, refused)
        if sentence is self.after_effect_failure_response:
            return "done"
        return "unconfirmed" if sentence is self.unconfirmed_response else "not_done"

    def say(self, message: Message, parameters: Mapping[str, Any], **extra: Any) -> str:
        """Render one of the tool's sentences (at most 1,000 characters)."""
        if callable(message):
            text = message(parameters, **extra)
        else:
            values = dict(parameters)
            values.update(extra)
            text = message.format_map(_Blank(values))
        return text[:1000]


class _Blank(dict):
    def __missing__(self, key: str) -> str:
        return ""


def _discover() -> dict[str, Tool]:
    found: dict[str, Tool] = {}
    for module in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        tool = getattr(importlib.import_module(f"{__name__}.{module.name}"), "TOOL", None)
        if isinstance(tool, Tool):
            if tool.name != module.name:  # Flower's app reads the tools' names from the file names
                raise ImportError(f"{__name__}.{module.name} declares the tool {tool.name!r}: "
                                  f"a tool's module is named after it")
            found[tool.name] = tool
    return found


TOOLS: dict[str, Tool] = _discover()


def get(name: str) -> Tool | None:
    return TOOLS.get(name)


def names() -> list[str]:
    return sorted(TOOLS)


def worker_groups() -> dict[str, list[str]]:
    """Each worker group's queues (``{"reads": ["tools.query_vector_db", ...]}``)."""
    groups: dict[str, list[str]] = {}
    for name in names():
        groups.setdefault(TOOLS[name].worker_group, []).append(TOOLS[name].queue)
    return groups
