"""The actions on a call: each one transition (``models.lifecycle``), then what follows its
commit: the chain sent (``tasks.chains``) or the call's event recorded and sent (``tasks.delivery``).

confirm and resume start the chain after the commit, undo the transition if the broker
refuses it, and return a :class:`Started` (the call, its tool, the sentence of what it does
next); cancel and expire announce the call's end and return the call with its sentence;
redrive runs a committed call's chain again, give_up fails one that keeps dying. ``caller``
(confirm, resume, cancel): only that caller's call, checked by the transition's own
statement. :func:`tool_of` is the room's one way from a call to its tool.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from celery.utils import uuid

from models import db, lifecycle, queries
from models.calls import DONE, FAILED, PENDING, UNCONFIRMED, ToolCall
from tasks import chains, tools
from tasks.calls.errors import UnknownTool
from tasks.delivery import attempts
from tasks.delivery import events
from tasks.tools import Tool

log = logging.getLogger(__name__)


def tool_of(call: ToolCall) -> Tool:
    """The call's tool; :class:`UnknownTool` if this process does not run it.

    The actions ask inside the transition's transaction, so an unknown tool rolls the
    transition back: a call is never left EXECUTING with no chain to run it.
    """
    tool = tools.get(call.function_name)
    if tool is None:
        raise UnknownTool(call.tool_call_id, call.function_name)
    return tool


@dataclass(frozen=True)
class Started:
    """What a start (confirm, resume) did: the call as it left it, its tool, and ``message``,
    the sentence of what the chain does first."""

    call: ToolCall
    tool: Tool
    message: str


def _started(call: ToolCall, tool: Tool, start: int) -> Started:
    """A chain sent from step ``start``: after a checkpoint, that step's sentence; else the tool's start sentence."""
    following = tool.steps[start] if 0 < start < len(tool.steps) else None
    sentence = following.message if following is not None and following.message else tool.start_message
    return Started(call, tool, tool.say(sentence, call.parameters))


def confirm(tool_call_id: str, callback_url: str | None = None, reason: str = lifecycle.CONFIRMED_REASON,
            callback_urls: dict[str, str] | None = None, caller: str | None = None,
            acted: lifecycle.Acted | None = None) -> Started:
    """PENDING → EXECUTING, then (after the commit) enqueue the tool's chain once.

    ``caller``: only that caller's call (another's is ``queries.NotFound``); ``acted``: who asked, through
    which face (on the history's entry). The chain's
    id is chosen first and recorded by the transition itself (no statement after the send).
    If the broker refuses the chain, the call goes back to PENDING and
    :class:`tasks.chains.BrokerUnavailable` is raised, unless its first link has begun: then the
    publish reached the broker after all and the call is answered as it is.
    """
    workflow_id = uuid()
    with db.statement() as s:  # one statement: the CAS is the whole transaction
        try:
            # a tool this process does not run is not confirmed (the statement checks it too)
            call = lifecycle.confirm(s, tool_call_id, reason=reason, callback_url=callback_url,
                                     callback_urls=callback_urls, caller=caller, workflow_id=workflow_id,
                                     functions=tools.names(), acted=acted)
        except lifecycle.Refused as exc:
            if exc.status == PENDING:  # still PENDING: its tool is unknown here
                tool_of(exc.call)
            raise
    tool = tool_of(call)
    try:
        chains.enqueue(tool, call, 0, workflow_id)
    except chains.BrokerUnavailable:
        with db.session() as s:
            undone = lifecycle.unconfirm(s, tool_call_id)
        if undone is None:
            return _started(_published_after_all(tool_call_id), tool, 0)
        raise
    return _started(call, tool, 0)


def resume(tool_call_id: str, caller: str | None = None, acted: lifecycle.Acted | None = None) -> Started:
    """PREPARED → EXECUTING and enqueue the links after the checkpoint (``caller``: as confirm's;
    the chain's id chosen first and recorded by the transition, as confirm's)."""
    workflow_id = uuid()
    with db.session() as s:
        call = lifecycle.resume(s, tool_call_id, caller=caller, workflow_id=workflow_id, acted=acted)
        tool = tool_of(call)  # before the commit: an unknown tool undoes the transition
    start = tool.step_index(call.current_step) + 1 if call.current_step else 0
    try:
        chains.enqueue(tool, call, start, workflow_id)
    except chains.BrokerUnavailable:
        with db.session() as s:  # never a committed call, nor one whose next link began
            undone = lifecycle.undo_resume(s, tool_call_id, call.current_step)
        if undone is None:
            return _started(_published_after_all(tool_call_id), tool, start)
        raise
    return _started(call, tool, start)


def run_again(tool_call_id: str, acknowledged: bool = False, caller: str | None = None,
              acted: lifecycle.Acted | None = None) -> Started:
    """Run a FAILED call whose effect was not done again, as a new call of the same caller, session,
    tool, parameters and callbacks, started at once (as confirm starts one); the two are linked in
    their histories (the old one's ``run_again_as``, the new one's ``again_of``), and a call is run
    again once. Its effect done (``outcome`` done): never. ``unconfirmed`` (its first run may have
    acted): only ``acknowledged``. ``caller``: only that caller's call. :class:`lifecycle.Refused`
    otherwise (``invalid_status``, or ``may_have_acted`` without the acknowledgment)."""
    acted = acted or {}
    with db.session() as s:
        old = queries.get(s, tool_call_id, caller=caller)
        if old.status != FAILED:
            raise lifecycle.Refused("invalid_status", old, f"Only a FAILED call can be run again; this one is {old.status}.")
        if old.outcome == DONE:
            raise lifecycle.Refused("invalid_status", old, "Its effect was done (a step after it failed): running it "
                                                            "again would do it twice.")
        if old.outcome == UNCONFIRMED and not acknowledged:
            raise lifecycle.Refused("may_have_acted", old, "Its first run may have acted (its outcome is unconfirmed): "
                                                            "check, then acknowledge that running it again may do it twice.")
        tool_of(old)
        new_id = lifecycle.new_tool_call_id()
        if lifecycle.mark_run_again(s, tool_call_id, new_id, acted, caller) is None:
            raise lifecycle.Refused("invalid_status", old, "This call was already run again.")
        lifecycle.create(s, session_id=old.session_id, function_name=old.function_name, action_level=old.action_level,
                         parameters=old.parameters, tool_call_id=new_id, connection_id=old.connection_id,
                         intent_id=old.intent_id, callback_url=old.callback_url, callback_urls=old.callback_urls,
                         caller=old.caller, reason=f"Run again of {tool_call_id}",
                         acted={**acted, "again_of": tool_call_id})
    return confirm(new_id, reason=f"Confirmed: run again of {tool_call_id}", acted=acted)


def _published_after_all(tool_call_id: str) -> ToolCall:
    """The publish "failed" but the chain runs: it reached the broker and only the answer was
    lost (a connection dropped after the write). Nothing to undo; the call as it is now."""
    log.warning("the publish for %s raised, but its chain is running: its answer was lost", tool_call_id)
    with db.session() as s:
        return queries.get(s, tool_call_id)


def cancel(tool_call_id: str, reason: str | None = None, deliver_now: bool = False,
           caller: str | None = None, acted: lifecycle.Acted | None = None) -> ToolCall:
    """Cancel before the point of no return and announce it once with a ``cancelled`` event
    (``tasks.delivery.events.cancel``); the call with its ``voice_response``."""
    call, delivery = events.cancel(tool_call_id, reason, caller=caller, inline=deliver_now, acted=acted)
    if deliver_now:
        attempts.deliver_inline(delivery)
    else:
        attempts.dispatch_quietly(delivery)
    return call


def redrive(tool: Tool, tool_call_id: str, older_than_s: int, max_redrives: int) -> ToolCall | None:
    """Run again, from its current step, a committed call of ``tool`` whose worker died (see lifecycle.redrive):
    a new chain, whose id the transition records, so a chain still running stops at its next gate."""
    workflow_id = uuid()
    with db.session() as s:
        call = lifecycle.redrive(s, tool_call_id, older_than_s, max_redrives, workflow_id=workflow_id)
    if call is None:
        return None
    start = tool.step_index(call.current_step) if call.current_step in {st.name for st in tool.steps} else 0
    chains.enqueue(tool, call, start, workflow_id)
    return call


def give_up(tool: Tool, tool_call_id: str, parameters: Any, older_than_s: int, max_redrives: int) -> ToolCall | None:
    """FAIL a committed call still stuck after ``max_redrives`` runs, saying its effect is unconfirmed."""
    voice = tool.say(tool.unconfirmed_response, parameters, tool=tool.spoken_name)
    with db.session() as s:
        error = (f"Gave up: its chain stopped {max_redrives + 1} times past the point of no return; "
                 "whether the side effect happened is unconfirmed.")
        call = lifecycle.give_up(s, tool_call_id, older_than_s, max_redrives, error, voice)
        if call is None:
            return None
        delivery = events.record(s, call, "failed", step=call.current_step, message=voice, inline=True)
    attempts.deliver_inline(delivery)
    return call


def expired_sentence(call: ToolCall) -> str:
    tool = tools.get(call.function_name)
    if tool is None:
        return f"The {call.function_name.replace('_', ' ')} request expired unanswered."
    return tool.say(tool.cancelled_response, call.parameters).replace("Cancelled.", "Expired.")


def expire(tool_call_id: str, pending_ttl_s: int, prepared_ttl_s: int) -> ToolCall | None:
    """Expire a stale call and record its ``expired`` event in the same transaction (as every
    other event: a crash cannot leave it EXPIRED unannounced), then send the event."""
    with db.session() as s:
        call = lifecycle.expire(s, tool_call_id, pending_ttl_s=pending_ttl_s, prepared_ttl_s=prepared_ttl_s)
        if call is None:
            return None
        voice = expired_sentence(call)
        call = lifecycle.set_voice_response(s, tool_call_id, voice)
        delivery = events.record(s, call, "expired", message=voice)
    attempts.dispatch_quietly(delivery)
    return call
