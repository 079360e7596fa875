"""Acting on many calls at once (the console's Cancel matching… and Redeliver matching…), chosen by the
list's filters: every call they match, however many, up to :data:`MAX_CALLS`.

1. :func:`chosen` counts them (the open ones for a cancel, those with a failed delivery that has a URL
   for a redelivery) as of the newest one matching now: its place in the list is ``until``, so a call
   recorded after the count is never taken. More than :data:`MAX_CALLS`: ``over``, and the operator
   narrows the filters (nothing is done to part of them).
2. :func:`act` takes them once that count is confirmed (``expected``; another count now: 409
   ``changed``, nothing done), one batch of :data:`BATCH` a request, newest first, by keyset (``after``:
   the last call of the previous batch): each cancel is the operation REST's cancel is (its own
   transaction), a batch's redelivery one transaction. Its answer is that batch's result for each call,
   their counts by outcome and the cursor of the next batch (None: the last). No transaction holds
   more than a batch, no answer more than a batch's results, however many calls match.

Fenced as every operation: a caller's own calls only, an admin's all; each call's history says who
acted, through which face (``via``).
"""
from __future__ import annotations

from collections import Counter
from typing import Any

from marshmallow import fields, validate

from models import browse, db
from models.calls import STATUSES
from tasks.calls import admin, errors, operations, schemas
from tasks.calls.browse import FILTERS, PageQuery
from tasks.calls.callers import Caller, acted, scope_of
from tasks.calls.errors import ApiError

Answer = tuple[dict[str, Any], int]

ACTIONS = ("cancel", "redeliver")
BATCH = 100  # calls acted on a request (a batch)
MAX_CALLS = 100_000  # calls one action on many takes at most: more match, the operator narrows the filters
BULK_CANCEL = "Cancelled in bulk from the console"  # when the operator gives no reason
CANCELLABLE = ("PENDING", "MODIFIED", "EXECUTING", "PREPARED")


class Place(schemas.Strict):
    """A call's place in the list: its ``created_at`` and ``tool_call_id``."""

    at = fields.AwareDateTime(required=True)
    id = schemas.Identifier(required=True)


class ActRequest(schemas.Strict):
    filters = fields.Dict(load_default=dict)
    expected = fields.Integer(required=True, validate=validate.Range(min=1, max=MAX_CALLS))
    until = fields.Nested(Place, required=True)
    after = fields.Nested(Place)
    reason = schemas.ShortText(500)


def _action(action: str) -> str:
    if action not in ACTIONS:
        raise ApiError(404, "not_found", "No such action on many calls: cancel or redeliver.", {})
    return action


def _selection(action: str, query: dict[str, Any], caller: Caller | None) -> dict[str, Any]:
    """What ``action`` takes under the list's filters (``query``, as the list's URL has them): the
    arguments of ``models.browse``'s chosen_batch and chosen_count."""
    loaded = schemas.load(PageQuery, {k: v for k, v in query.items() if k not in ("limit", "before_at", "before_id")})
    statuses = loaded.get("status") or STATUSES
    if action == "cancel":
        statuses = [status for status in statuses if status in CANCELLABLE] or ["none"]  # none: no status matches
    return {"scope": scope_of(caller), "statuses": statuses, "failed_delivery": action == "redeliver",
            "filters": {name: loaded.get(name) for name in FILTERS}}


def _place(row: Any) -> dict[str, str]:
    return {"at": row.created_at.isoformat(), "id": row.tool_call_id}


def chosen(action: str, query: dict[str, Any], caller: Caller | None) -> Answer:
    """How many calls ``action`` (cancel, redeliver) takes under these filters, as of now (``until``:
    the newest of them; None when none matches), counted to :data:`MAX_CALLS` (``over``: more match)."""
    selection = _selection(_action(action), query, caller)
    with db.session() as s:
        newest = s.execute(browse.chosen_batch(**selection, until=None, limit=1)).first()
        count = s.scalar(browse.chosen_count(**selection, until=(newest.created_at, newest.tool_call_id),
                                             at_most=MAX_CALLS)) if newest else 0
    return {"count": min(count, MAX_CALLS), "over": count > MAX_CALLS, "bound": MAX_CALLS, "batch": BATCH,
            "until": _place(newest) if newest else None}, 200


def _cancelled(tool_call_id: str, body: dict[str, Any], caller: Caller | None) -> dict[str, Any]:
    try:
        done, _ = operations.cancel(tool_call_id, body, {}, caller)
        return {"tool_call_id": tool_call_id, "ok": True, "outcome": "cancelled", "status": done["status"]}
    except errors.KNOWN as exc:  # each call's own answer: the error REST would give for it
        error = errors.payload(errors.api_error(exc))
        return {"tool_call_id": tool_call_id, "ok": False, "outcome": error["error"], "message": error["message"]}


def act(action: str, body: dict[str, Any], caller: Caller | None) -> Answer:
    """The next batch of ``action`` on the calls :func:`chosen` counted (``until``), once their count is
    confirmed (``expected``, checked before the first batch); each call's result, their counts by
    outcome, and ``next``, the ``after`` of the following batch (None: done)."""
    _action(action)
    loaded = schemas.load(ActRequest, body)
    selection = _selection(action, {k: str(v) for k, v in loaded["filters"].items()}, caller)
    until = (loaded["until"]["at"], loaded["until"]["id"])
    after = (loaded["after"]["at"], loaded["after"]["id"]) if "after" in loaded else None
    with db.session() as s:
        if after is None:  # the first batch: the count the operator confirmed is still the count
            count = s.scalar(browse.chosen_count(**selection, until=until, at_most=MAX_CALLS))
            if count > MAX_CALLS:
                raise ApiError(409, "too_many", f"More than {MAX_CALLS} calls match: narrow the filters.",
                               {"bound": MAX_CALLS})
            if count != loaded["expected"]:
                raise ApiError(409, "changed", f"{count} calls match now, not {loaded['expected']}: count them again.",
                               {"count": count})
        rows = list(s.execute(browse.chosen_batch(**selection, until=until, after=after, limit=BATCH)))
    ids = [row.tool_call_id for row in rows]
    if action == "cancel":
        cancel = {"reason": loaded.get("reason") or BULK_CANCEL}
        results = [_cancelled(tool_call_id, cancel, caller) for tool_call_id in ids]
    else:
        queued = admin.redeliver_calls(ids, acted(caller))  # the batch's one transaction
        results = [{"tool_call_id": tool_call_id, "ok": True,
                    "outcome": "queued" if queued[tool_call_id] else "nothing_to_send", "queued": queued[tool_call_id]}
                   for tool_call_id in ids]
    following = _place(rows[-1]) if len(rows) == BATCH else None
    return {"action": action, "results": results, "counts": dict(Counter(r["outcome"] for r in results)),
            "next": following}, 200
