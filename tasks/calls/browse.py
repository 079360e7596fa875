"""What the console asks of the calls (``app/console/``): who the token is, a page of calls, one call
with its events and their delivery attempts, a failed event sent again, each tool's figures.

Fenced as every operation is: a caller sees and acts on its own calls only, an admin on all;
another caller's call is :class:`models.queries.NotFound`, the same 404 as an unknown id. The
actions on a call themselves are the operations REST and the CLI call (``operations.cancel``,
``operations.resume``, ``admin.redeliver``), asked through the console (the caller's ``via``).
"""
from __future__ import annotations

import math
import re
from datetime import datetime
from typing import Any

from marshmallow import ValidationError, fields, validate

from models import browse, db, queries, settings
from models.calls import STATUSES, CallbackDelivery
from tasks import tools
from tasks.calls import actions, admin, operations, schemas
from tasks.calls.callers import Caller, acted, scope_of
from tasks.calls.errors import ApiError
from tasks.celery_app import app as celery_app
from tasks.worker.metrics_page import QueueDepth

Answer = tuple[dict[str, Any], int]

REDELIVER = "redeliver"
CONSOLE_CANCEL = "Cancelled from the console"  # when the operator gives no reason


class Statuses(fields.String):
    """Several statuses, comma-separated (``FAILED,CANCELLED``): a list, each one of the statuses."""

    def _deserialize(self, value: Any, attr: Any, data: Any, **kwargs: Any) -> list[str]:
        given = [part.strip() for part in super()._deserialize(value, attr, data, **kwargs).split(",")]
        unknown = [part for part in given if part not in STATUSES]
        if unknown or not given:
            raise ValidationError(f"Each status must be one of {', '.join(STATUSES)}.")
        return sorted(set(given), key=STATUSES.index)


class CountsQuery(schemas.Strict):
    tool = schemas.Identifier()
    session_id = schemas.Identifier()
    caller = fields.String(validate=validate.Length(min=1, max=100))
    tool_call_id = schemas.Identifier()
    created_from = fields.AwareDateTime()
    created_to = fields.AwareDateTime()


class PageQuery(CountsQuery):
    status = Statuses(validate=validate.Length(max=200))
    before_at = fields.AwareDateTime()
    before_id = schemas.Identifier()
    limit = fields.Integer(load_default=50, validate=validate.Range(min=1, max=browse.MAX_PAGE))


FILTERS = ("tool", "session_id", "caller", "tool_call_id", "created_from", "created_to")


def _row(row: Any) -> dict[str, Any]:
    item = {"tool_call_id": row.tool_call_id, "function_name": row.function_name, "status": row.status,
            "session_id": row.session_id, "caller": row.caller, "created_at": row.created_at.isoformat(),
            "completed_at": _when(row.completed_at)}
    if "progress" in row._fields:
        item.update(progress=row.progress, current_step=row.current_step)
    return item


def whoami(caller: Caller) -> Answer:
    """The token's name, whether it is an admin's, and the registry's tools (the list's choice of tool)."""
    return {"name": caller.name, "admin": caller.admin, "tools": tools.names()}, 200


def page(query: dict[str, Any], caller: Caller | None) -> Answer:
    """A page of calls, newest first, and the cursor of the next (None: the last page)."""
    loaded = schemas.load(PageQuery, query)
    before = None
    if "before_at" in loaded or "before_id" in loaded:
        if "before_at" not in loaded or "before_id" not in loaded:
            raise ApiError(422, "validation_error", "before_at and before_id go together.", {})
        before = (loaded["before_at"], loaded["before_id"])
    with db.statement() as s:
        rows = browse.calls_page(s, scope=scope_of(caller), statuses=loaded.get("status", ()),
                                 **{name: loaded.get(name) for name in FILTERS}, before=before, limit=loaded["limit"])
    calls = [_row(r) for r in rows]
    last = rows[-1] if len(rows) == loaded["limit"] else None
    following = {"before_at": last.created_at.isoformat(), "before_id": last.tool_call_id} if last else None
    return {"calls": calls, "next": following}, 200


def counts(query: dict[str, Any], caller: Caller | None) -> Answer:
    """How many calls are in each status under the list's filters but its statuses (every status named,
    0 for none), of the newest ``browse.MAX_COUNTED`` at most: ``more`` says that more match."""
    loaded = schemas.load(CountsQuery, query)
    with db.statement() as s:
        found = dict(s.execute(browse.counts_statement(scope=scope_of(caller),
                                                       **{name: loaded.get(name) for name in FILTERS})).all())
    more = sum(found.values()) > browse.MAX_COUNTED
    return {"counts": {status: found.get(status, 0) for status in STATUSES}, "more": more,
            "counted": min(sum(found.values()), browse.MAX_COUNTED)}, 200


def rows_of(tool_call_ids: list[str], caller: Caller | None) -> list[dict[str, Any]]:
    """The list's rows of these calls that ``caller`` may see (the live list's redraw)."""
    with db.statement() as s:
        return [_row(r) for r in browse.calls_by_id(s, tool_call_ids, scope_of(caller))]


def _when(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


def _event(delivery: CallbackDelivery) -> dict[str, Any]:
    payload = delivery.payload or {}
    return {
        "event_id": delivery.event_id, "event": delivery.event, "seq": delivery.seq, "step": payload.get("step"),
        "status": payload.get("status"), "url": delivery.url, "state": delivery.state,
        "attempts": delivery.attempts, "last_error": delivery.last_error, "response_code": delivery.response_code,
        "next_attempt_at": _when(delivery.next_attempt_at), "created_at": _when(delivery.created_at),
        "delivered_at": _when(delivery.delivered_at), "attempt_log": delivery.attempt_log or [],
        "actions_available": [REDELIVER] if delivery.url is not None and delivery.state == "failed" else [],
    }


def step_outputs(call: Any) -> dict[str, Any]:
    """The call's step outputs in its chain's order (the database's JSON keeps its keys in an order of
    its own: shortest first); a step its tool no longer has comes last."""
    outputs = call.step_outputs or {}
    tool = tools.get(call.function_name)
    order = [step.name for step in tool.steps] if tool else []
    rank = {name: index for index, name in enumerate(order)}
    return {name: outputs[name] for name in sorted(outputs, key=lambda name: (rank.get(name, len(order)), name))}


def following(call: Any) -> dict[str, Any] | None:
    """At a checkpoint (PREPARED): what Proceed will do. The checkpoint's own preview (the step's
    output, as its tool made it from every earlier step: the email as it will go, the meeting as it
    will be booked), the step that runs next, its sentence, and whether it acts (a side effect: past
    it, no cancel). None for a call not at a checkpoint, or of a tool this process does not run."""
    tool = tools.get(call.function_name)
    if call.status != "PREPARED" or tool is None or call.current_step not in {s.name for s in tool.steps}:
        return None
    at = tool.step_index(call.current_step)
    after = tool.steps[at + 1] if at + 1 < len(tool.steps) else None
    return {"checkpoint": call.current_step, "preview": (call.step_outputs or {}).get(call.current_step) or {},
            "step": after.name if after else None,
            "message": tool.say(after.message, call.parameters) if after and after.message else None,
            "side_effect": bool(after and after.side_effect)}


def _kind(call: Any, name: str) -> str:
    """What a recorded step is: a checkpoint (its output the preview), one with a side effect, or a step."""
    tool = tools.get(call.function_name)
    step = next((s for s in tool.steps if s.name == name), None) if tool else None
    if step is None:
        return "step"
    return "checkpoint (preview)" if step.checkpoint else "side effect" if step.side_effect else "step"


TRACE_ID = re.compile(r"^[0-9a-f]{2}-([0-9a-f]{32})-[0-9a-f]{16}-[0-9a-f]{2}$")


def trace_url(call: Any) -> str | None:
    """The link to the call's trace in the operator's tracing UI: ``VOICE_TOOLS_TRACE_URL`` with
    ``{trace_id}`` the call's (from the ``traceparent`` recorded with it); None without a template
    (or one that is not http(s)), or for a call recorded while tracing was off."""
    template = settings.load().trace_url
    found = TRACE_ID.match(call.trace_context or "")
    if not found or not template.startswith(("http://", "https://")) or "{trace_id}" not in template:
        return None
    return template.replace("{trace_id}", found.group(1))


def call(tool_call_id: Any, caller: Caller | None) -> Answer:
    """One call's whole record (as ``GET /voice-tools/status`` answers it), each step's output in its
    chain's order (as ``calls show`` prints them), what Proceed will do at a checkpoint
    (:func:`following`), its events with their delivery attempts, and the latest runs of its links
    (``models/link_attempts.py``)."""
    tool_call_id = schemas.load(schemas.ToolCallPath, {"tool_call_id": tool_call_id})["tool_call_id"]
    with db.session() as s:
        row = queries.get(s, tool_call_id, caller=scope_of(caller))
        events = [_event(d) for d in queries.deliveries(s, tool_call_id)]
    record = schemas.instance(schemas.CallRecord).dump(row)
    counters = {"attempts": row.attempts, "step_attempts": row.step_attempts,
                "effect_attempts": row.effect_attempts, "redrives": row.redrives}
    steps = [{"step": name, "kind": _kind(row, name), "output": output} for name, output in step_outputs(row).items()]
    return {"record": record, "steps": steps, "next": following(row), "trace_url": trace_url(row),
            "console_actions": console_actions(row), "events": events,
            "attempts": row.link_attempts, "counters": counters}, 200


def cancel(tool_call_id: Any, body: dict[str, Any], caller: Caller | None) -> Answer:
    """Cancel the call (REST's cancel: before the point of no return), with the operator's reason if given
    (``CancelRequest``'s rules), else :data:`CONSOLE_CANCEL`."""
    reason = schemas.load(schemas.CancelRequest, body).get("reason")
    return operations.cancel(tool_call_id, {"reason": reason or CONSOLE_CANCEL}, {}, caller)


class RunAgainRequest(schemas.Strict):
    acknowledge_may_have_acted = fields.Boolean(load_default=False)


RUN_AGAIN = "run_again"


def console_actions(call: Any) -> list[str]:
    """What the console offers beyond the record's own ``actions_available``: run a FAILED call again,
    once, unless its effect was done."""
    again = call.status == "FAILED" and call.outcome != "done" and not any(
        "run_again_as" in entry for entry in call.status_history or [])
    return [RUN_AGAIN] if again else []


def run_again(tool_call_id: Any, body: dict[str, Any], caller: Caller | None) -> Answer:
    """Run a FAILED call again as a new call (``actions.run_again``); the new call as a start answers it."""
    tool_call_id = schemas.load(schemas.ToolCallPath, {"tool_call_id": tool_call_id})["tool_call_id"]
    acknowledged = schemas.load(RunAgainRequest, body)["acknowledge_may_have_acted"]
    started = actions.run_again(tool_call_id, acknowledged, caller=scope_of(caller), acted=acted(caller))
    return {"tool_call_id": started.call.tool_call_id, "status": started.call.status, "again_of": tool_call_id,
            "message": started.message}, 202


def proceed(tool_call_id: Any, caller: Caller | None) -> Answer:
    """At its checkpoint, run the rest of the call (REST's resume with ``proceed``)."""
    return operations.resume(tool_call_id, {"action": "proceed"}, {}, caller)


def redeliver(tool_call_id: Any, event_id: Any, caller: Caller | None) -> Answer:
    """Send one failed event of the call again (the operator's ``callbacks redeliver``), if its record offers it."""
    tool_call_id = schemas.load(schemas.ToolCallPath, {"tool_call_id": tool_call_id})["tool_call_id"]
    with db.session() as s:
        queries.get(s, tool_call_id, caller=scope_of(caller))
        chosen = [d for d in queries.deliveries(s, tool_call_id) if d.event_id == event_id]
    if not chosen or REDELIVER not in _event(chosen[0])["actions_available"]:
        raise ApiError(409, "invalid_state", "This event is not one to redeliver (only a failed one with a URL).",
                       {"event_id": str(event_id)[:64]})
    queued = admin.redeliver(tool_call_id=tool_call_id, failed_only=True, event_ids=[chosen[0].event_id],
                             acted=acted(caller))
    return {"queued": [d.event_id for d in queued]}, 202


def nearest_rank(q: float, values: list[float]) -> float:
    """The ``q`` percentile of ``values`` by nearest rank: one of the values itself (a run's own time),
    never an interpolation nor a bucket's edge; of one run, that run."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def _step_figures(step: dict[str, Any]) -> dict[str, Any]:
    """A step's runs over the window and their p50 and p99 (ms, :func:`nearest_rank`), from the time
    each run took as its link recorded it on its call (``tool_calls.link_attempts``)."""
    took = step["took_ms"]
    return {"step": step["step"], "runs": len(took), "p50_ms": round(nearest_rank(0.5, took), 1),
            "p99_ms": round(nearest_rank(0.99, took), 1)}


def tool_figures(caller: Caller) -> Answer:
    """Per tool: its queue's depth (read from the broker by the collector of the workers' ``/metrics``), the
    calls open now, calls and failures per minute over the last hour (``calls_per_minute``: over the last
    five), each step's runs and p50/p99 (:func:`_step_figures`). An admin's only: the figures are every
    caller's."""
    if not caller.admin:
        raise ApiError(403, "forbidden", "The tools' figures are every caller's: an admin token sees them.", {})
    depths = {}
    for family in QueueDepth(celery_app).collect():
        depths = {sample.labels["queue"]: int(sample.value) for sample in family.samples}
    with db.session() as s:
        hour = browse.hour_figures(s)
        open_now = browse.open_counts(s)
    answer = []
    for name in tools.names():
        tool = tools.get(name)
        figures = hour.get(name) or {"per_minute": [0] * 60, "failed_per_minute": [0] * 60, "steps": [],
                                     "callbacks_failed": 0}
        answer.append({
            "tool": name, "queue": tool.queue, "queue_depth": depths.get(tool.queue),
            "open": {status: count for (t, status), count in open_now.items() if t == name},
            "calls_last_hour": sum(figures["per_minute"]), "failed_last_hour": sum(figures["failed_per_minute"]),
            "calls_per_minute": round(sum(figures["per_minute"][:5]) / 5, 2), **figures,
            "steps": [_step_figures(step) for step in figures["steps"]],
        })
    return {"tools": answer}, 200
