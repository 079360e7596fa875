"""Every side-effect tool, on each of its backends, against the faults of an effect (docs/promises.md,
"Exactly once"): the effect happened and its answer was lost; the read-back lags longer than any wait;
two copies of the effect at once. Each ends with one effect (two copies: at most one) and an honest
outcome, never a second effect, never an answer that names an effect that is not there.

The tools come from the registry (``tasks.tools.TOOLS``): a tool with a side-effect step and no row in
:data:`BACKENDS` fails here, so a new tool is covered (or refused) by this test as it is added.

- **acted, then its worker died**: an attempt claims the effect (the claim names a process that is
  gone), acts, and its answer never reaches the engine; the link is delivered again and runs through
  the in-process worker, which takes the claim over knowing an earlier attempt may have acted.
- **acted, then answered 5xx** (a service that answers): the service does it and answers 503; the
  engine retries.
- **... with a read-back that lags** (a service whose reads lag behind its writes): the same, while
  what was made does not show for an hour, far past ``VOICE_TOOLS_GOOGLE_CONFIRM_WAIT``.
- **two copies at once**: a first attempt and a copy that took its claim over (the lease lapsed)
  run the step side by side, what they made lagging behind: each answers with the one effect or
  says it cannot tell.
"""
from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
from sqlalchemy import func, select

import voice_tools_backends as backends
from voice_tools_backends import google
from models import db, lifecycle
from models.calendar import CalendarEvent
from models.calls import SessionContext
from models.email import EmailOutbox
from models.task_list import TodoTask
from tasks import chains, tools
from tasks.tools import Step, StepInput, Tool
from tests.google_fixtures import CalendarDouble, GmailDouble, TasksDouble
from tests.helpers import make_call, wait_status

CONFIRM_WAIT_S = "1"  # VOICE_TOOLS_GOOGLE_CONFIRM_WAIT for these tests
LONGER_THAN_ANY_WAIT_S = 3600.0
SESSION = "sess_faults"


def effect_tools() -> list[str]:
    """The registry's tools with a side effect."""
    return sorted(name for name, tool in tools.TOOLS.items() if any(s.side_effect for s in tool.steps))


def rows_of(table: Any) -> Callable[[Any, str], int]:
    def count(_double: Any, tool_call_id: str) -> int:
        with db.session() as s:
            return s.scalar(select(func.count()).select_from(table).where(table.tool_call_id == tool_call_id))
    return count


def context_values(_double: Any, tool_call_id: str) -> int:
    with db.session() as s:
        return s.scalar(select(func.count()).select_from(SessionContext).where(
            SessionContext.session_id == SESSION,
            SessionContext.context_value["tool_call_id"].astext == tool_call_id))


@dataclass(frozen=True)
class Backend:
    """One backend of a side-effect tool: how its effects are counted and how it is hurt.

    ``service``: the Google service it is (``VOICE_TOOLS_GOOGLE_SERVICES``), None for the local tables;
    ``double``: its stateful double, made as ``double(api, lag)``; ``acts``: the double's operation that
    does the effect (answered 503 after acting); ``lags``: its read-back can lag behind what it made
    (a local table reads its own writes)."""

    name: str
    effects: Callable[[Any, str], int]
    service: str | None = None
    double: Callable[[Any, float], Any] | None = None
    acts: str = ""
    lags: bool = False


BACKENDS: dict[str, tuple[Backend, ...]] = {
    "create_task": (
        Backend("todo_tasks", rows_of(TodoTask)),
        Backend("google_tasks", lambda double, _id: len(double.tasks), "tasks",
                lambda api, lag: TasksDouble(api, lag=lag), acts="insert", lags=True),
    ),
    "query_vector_db": (
        Backend("session_context", context_values),
    ),
    "schedule_meeting": (
        Backend("calendar_events", rows_of(CalendarEvent)),
        Backend("google_calendar", lambda double, _id: len(double.events), "calendar",
                lambda api, lag: CalendarDouble(api, lag=lag), acts="insert", lags=True),
    ),
    "send_email": (
        Backend("outbox", rows_of(EmailOutbox)),
        Backend("gmail", lambda double, _id: len(double.sent), "gmail",
                lambda api, lag: GmailDouble(api, lag=lag), acts="send", lags=True),
    ),
}

# fault: (the attempt's answer is lost by its worker dying (True) or by a 503 (False), the read-back lags)
ENGINE_FAULTS = {
    "acted_then_worker_died": (True, False),
    "acted_then_5xx": (False, False),
    "acted_then_worker_died_read_back_lagging": (True, True),
    "acted_then_5xx_read_back_lagging": (False, True),
}


def applies(backend: Backend, fault: str) -> bool:
    died, lagging = ENGINE_FAULTS.get(fault, (True, False))
    if backend.service is None:  # a local table: no answer but its process's to lose, nothing lags
        return died and not lagging
    return not lagging or backend.lags


def cases(faults: list[str]) -> list[Any]:
    found = []
    for name in effect_tools():
        rows = BACKENDS.get(name)
        if rows is None:
            found.append(pytest.param(name, None, faults[0], id=f"{name}-without-a-row"))
            continue
        found += [pytest.param(name, b, fault, id=f"{name}-{b.name}-{fault}")
                  for b in rows for fault in faults if applies(b, fault)]
    return found


@pytest.fixture
def confirm_quickly(monkeypatch):
    monkeypatch.setenv("VOICE_TOOLS_GOOGLE_CONFIRM_WAIT", CONFIRM_WAIT_S)
    google.reset()
    yield
    google.reset()


def the_double(request: Any, backend: Backend, lag: float) -> Any:
    if backend.service is None:
        return None
    api = request.getfixturevalue("google_api")
    return backend.double(api, lag)


def effect_step(tool: Tool) -> tuple[int, Step]:
    return next((i, s) for i, s in enumerate(tool.steps) if s.side_effect and not s.checkpoint)


def parameters(name: str) -> dict:
    example = dict(tools.TOOLS[name].example)
    example.pop("reference_context", None)  # names a value of another call's session
    return example


def up_to_the_effect(name: str) -> tuple[Any, str, dict]:
    """A call of ``name`` EXECUTING under the chain it returns, with its steps before the effect
    run and recorded as its links would have (a checkpoint counts as passed): (call, chain, outputs)."""
    tool = tools.TOOLS[name]
    call = make_call(name, parameters(name), session_id=SESSION)
    chain_id = f"faults-{call.tool_call_id}"
    with db.statement() as s:
        lifecycle.confirm(s, call.tool_call_id, workflow_id=chain_id)
    index, _ = effect_step(tool)
    outputs: dict[str, Any] = {}
    for i, step in enumerate(tool.steps[:index]):
        if step.checkpoint or step.run is None:
            continue
        output = step.run(StepInput(call.tool_call_id, SESSION, call.parameters, outputs, call.caller or ""))
        with db.statement() as s:
            lifecycle.record_step(s, call.tool_call_id, step.name, output, (i + 1) / len(tool.steps), chain=chain_id)
        outputs[step.name] = output
    return call, chain_id, outputs


def token_of_a_process_that_is_gone() -> str:
    """A claim token as a worker's process writes it, of a process that has ended."""
    made = subprocess.run([sys.executable, "-c", "from tasks.effect_claims import claim_token; print(claim_token())"],
                          capture_output=True, text=True, check=True, timeout=120)
    return made.stdout.strip()


def test_every_side_effect_tool_has_its_backends_in_the_table():
    assert sorted(BACKENDS) == effect_tools(), "a row for each tool with a side effect, and none for another"


@pytest.mark.slow
@pytest.mark.parametrize("name, backend, fault", cases(list(ENGINE_FAULTS)))
def test_an_effect_whose_answer_was_lost_happens_once_and_says_so(request, worker, confirm_quickly,
                                                                   name, backend, fault):
    assert backend is not None, f"{name} has a side effect: add its backends to BACKENDS"
    died, lagging = ENGINE_FAULTS[fault]
    tool = tools.TOOLS[name]
    index, effect = effect_step(tool)
    double = the_double(request, backend, LONGER_THAN_ANY_WAIT_S if lagging else 0.0)
    call, chain_id, outputs = up_to_the_effect(name)
    tool_call_id = call.tool_call_id
    if died:  # an attempt claimed it and acted; its process is gone and its answer with it
        token = token_of_a_process_that_is_gone()
        with db.statement() as s:
            claimed = lifecycle.begin_step(s, tool_call_id, effect.name, index / len(tool.steps), commit=True,
                                           chain=chain_id, token=token, lease_s=tool.time_limit + 10)
        assert claimed.effect_claimed_by == token
        effect.run(StepInput(tool_call_id, SESSION, call.parameters, outputs, call.caller or ""))
        assert backend.effects(double, tool_call_id) == 1
    else:
        double.after[backend.acts] = [(503, 0.0)]  # it acts, then answers 503
    chains.signature(tool, tool_call_id, index, chain_id).apply_async()  # the link, delivered (again)
    done = wait_status(tool_call_id, timeout=90)

    assert backend.effects(double, tool_call_id) == 1, f"{name} on {backend.name}: not exactly one effect"
    assert done.outcome in ("done", "unconfirmed"), (done.outcome, done.error_message)
    if done.outcome == "done":
        assert done.status == "COMPLETED", (done.status, done.error_message)
    else:
        assert done.status == "FAILED"
        assert done.voice_response == tool.say(tool.unconfirmed_response, done.parameters)
    if not lagging:
        assert done.outcome == "done", f"what it made shows at once: {done.error_message}"


@pytest.mark.parametrize("name, backend, fault", cases(["two_copies_at_once"]))
def test_two_copies_of_an_effect_at_once_act_once(request, confirm_quickly, name, backend, fault):
    assert backend is not None, f"{name} has a side effect: add its backends to BACKENDS"
    tool = tools.TOOLS[name]
    _, effect = effect_step(tool)
    double = the_double(request, backend, LONGER_THAN_ANY_WAIT_S)
    if double is not None:
        double.after[backend.acts] = [(200, 0.5)]  # the first to act is answered half a second later
    call, _, outputs = up_to_the_effect(name)
    results: list[Any] = [None, None]
    start = threading.Barrier(2)

    def copy(i: int) -> None:
        start.wait()
        try:  # the first attempt, and a copy that took its claim over (it knows one may have acted)
            results[i] = effect.run(StepInput(call.tool_call_id, SESSION, call.parameters, outputs,
                                              call.caller or "", earlier_attempt=i == 1))
        except Exception as exc:  # noqa: BLE001  (looked at below)
            results[i] = exc
        finally:
            google.reset()

    copies = [threading.Thread(target=copy, args=(i,)) for i in range(2)]
    for t in copies:
        t.start()
    for t in copies:
        t.join(60)

    made = backend.effects(double, call.tool_call_id)
    assert made <= 1, f"{name} on {backend.name}: {made} effects: {results}"
    assert all(isinstance(r, backends.Unconfirmed) for r in results if isinstance(r, Exception)), \
        f"a copy that did not answer with the effect may only say it cannot tell: {results}"
    if any(not isinstance(r, Exception) for r in results):
        assert made == 1, f"a copy answered with an effect that is not there: {results}"
    # both may say they cannot tell (the copy that knows an earlier attempt may have acted went
    # first, and never acts on a read that does not show it; the other then took its turn for one)
