"""Two copies of every side-effect link at once, for every write tool on its local backend
(docs/promises.md, "Exactly once"): one effect each, every time.

A chain published twice (kombu's publish retry after the first LPUSH landed gives exactly this:
the same chain, the same id, twice in the queue) runs its side-effect link twice, side by side, on
the in-process worker's four threads. For each call: the effect's backend row is there once, the
effect was claimed by one attempt, and its progress event was recorded once.
"""
from __future__ import annotations

import os
from datetime import datetime, timedelta

import pytest
from sqlalchemy import func, select

from models import db, lifecycle
from models.calendar import CalendarEvent
from models.email import EmailOutbox
from models.task_list import TodoTask
from tasks import chains, tools
from tasks.calls import actions
from tests.helpers import deliveries, make_call, row, wait_status

pytestmark = pytest.mark.fault

CALLS_PER_TOOL = 40 if os.environ.get("VOICE_TOOLS_FULL_FAULTS") == "1" else 8
EFFECT_ROWS = {"send_email": EmailOutbox, "schedule_meeting": CalendarEvent, "create_task": TodoTask}


def parameters(name: str, i: int) -> dict:
    example = dict(tools.TOOLS[name].example)
    if name == "schedule_meeting":  # one slot each: a meeting never finds another booked then
        example["start"] = (datetime.fromisoformat(example["start"]) + timedelta(hours=i)).isoformat()
    if name == "send_email":
        example.pop("reference_context", None)
    return example


def started_twice(name: str, i: int) -> str:
    """A call of ``name`` whose chain, from the link after its checkpoint (or its first), is in the queue twice."""
    tool = tools.TOOLS[name]
    call = make_call(name, parameters(name, i), session_id=f"sess_copies_{name}")
    checkpoint = next((n for n, step in enumerate(tool.steps) if step.checkpoint), None)
    if checkpoint is None:
        workflow_id = f"copies-{call.tool_call_id}"
        with db.statement() as s:
            lifecycle.confirm(s, call.tool_call_id, workflow_id=workflow_id)
        start = 0
    else:
        actions.confirm(call.tool_call_id)
        wait_status(call.tool_call_id, "PREPARED", timeout=60)
        workflow_id = f"copies-{call.tool_call_id}"
        with db.session() as s:
            lifecycle.resume(s, call.tool_call_id, workflow_id=workflow_id)
        start = checkpoint + 1
    for _ in range(2):  # the same chain, published twice
        chains.signature(tool, call.tool_call_id, start, workflow_id).apply_async()
    return call.tool_call_id


def effect_rows(name: str, tool_call_id: str) -> int:
    table = EFFECT_ROWS[name]
    with db.session() as s:
        return s.scalar(select(func.count()).select_from(table).where(table.tool_call_id == tool_call_id))


@pytest.mark.parametrize("name", sorted(EFFECT_ROWS))
def test_two_copies_of_a_side_effect_link_act_once(worker, name):
    tool = tools.TOOLS[name]
    effect = next(step.name for step in tool.steps if step.side_effect and not step.checkpoint)
    ids = [started_twice(name, i) for i in range(CALLS_PER_TOOL)]
    for tool_call_id in ids:
        done = wait_status(tool_call_id, timeout=90)
        assert done.status == "COMPLETED", (done.status, done.error_message)
        assert done.outcome == "done"
        assert effect_rows(name, tool_call_id) == 1
        assert done.effect_attempts == 1, f"{tool_call_id}: the effect was claimed {done.effect_attempts} times"
        announced = [d for d in deliveries(tool_call_id, "progress") if d.payload["step"] == effect]
        assert len(announced) == 1, f"{tool_call_id}: {len(announced)} progress events of {effect}"
    assert row(ids[0]).workflow_id.startswith("copies-")
