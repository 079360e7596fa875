"""The engine: a tool's chain of ``Link`` tasks, how a chain is sent, and how a link fails its call.

Every step of every tool is a task named ``tools.<name>.<step>`` on queue
``tools.<name>``, built here from the tool's declaration. What each link does is
written once, in :class:`Link`:

1. gate: a step without side effect claims nothing (running it twice is harmless): its gate is
   one read of the call, checking it is EXECUTING and the link's chain (its second argument, the
   ``workflow_id`` recorded before the chain was sent) is the call's; a side-effect step's gate is
   one conditional UPDATE that checks the same, passes the point of no return (``committed_at``)
   and claims the effect for this attempt with a lease as long as the link's hard time limit: a
   copy that finds a live claim runs again when it ends, without acting (docs/promises.md,
   "Exactly once"). If the gate does not pass (cancelled, expired, failed, a stale chain) the
   chain stops quietly (the transition that ended the call already recorded its event);
2. skip a step whose output is already recorded (a redelivered link);
3. a checkpoint step sets PREPARED, posts the ``checkpoint`` event and ends the chain;
4. run the step, then record its output and progress together with its callback row
   (one statement: once per step, by the call's chain), post the callback inline; the last step
   completes the call. A step with no work of its own after it (a checkpoint, or a last step
   without ``run``) is done by the same link (:func:`done_by_the_link_before`): no link is sent
   for it.

A link of a step without side effect makes one read before its step and one write after it
(a side effect's, two writes), each a single statement in its own transaction, built once and
run on the driver's cursor (``models/compiled.py``), rows; a
link that also does the next step adds that step's one write. The posted callbacks' outcomes are
recorded after the chain's next link has been sent (:meth:`Link.after_return`).

Transient errors retry with backoff (Celery's retry), counted in the database
(``step_attempts``, ``effect_attempts``) so the bound holds even when the broker refuses the
retry's publish; permanent ones fail the call. Each run that records anything records itself too
(``link_attempts``: its start, time, outcome and reason), in the same statement, except a retried
run of a step without side effect, which learns it is retried only from its count: one statement more. A side effect's failure is "not done" only when
no earlier attempt of it can have acted; otherwise its outcome is unconfirmed.
"""
from __future__ import annotations

import logging
import time
from contextvars import ContextVar
from dataclasses import replace
from datetime import datetime, timezone
from typing import Any

from celery import chain
from celery.exceptions import Reject, Retry, SoftTimeLimitExceeded, TimeLimitExceeded
from kombu.exceptions import OperationalError as KombuOperationalError
from redis.exceptions import RedisError

from models import logs
from celeryconfig import queue
from models import db, events, lifecycle, link_attempts, queries
from models.calls import NOT_DONE, UNCONFIRMED, ToolCall
from tasks import base, publishing, tools
from tasks.effect_claims import claim_token, holder_gone
import voice_tools_backends as backends
from tasks.delivery import attempts
from tasks.delivery.events import record
from tasks.worker import metrics
from tasks.celery_app import app
from tasks.tools import Message, PermanentError, Step, StepInput, Tool, TransientError

log = logging.getLogger(__name__)


class BrokerUnavailable(Exception):
    """The chain could not be enqueued; the call was put back to PENDING."""


# A refused publish hands the message back after at most this wait (its run's backoff).
REQUEUE_WAIT_S = 10.0
# Celery's own retry bound is not the one that counts: the runs recorded on the call are.
RETRIES_UNBOUNDED_HERE = 10_000


class Attempt:
    """What a run of a link is: its chain, its claim on the side effect (None for other steps),
    and, for a side effect, how many claims of it the call has counted, this one included (a step
    without side effect counts its runs when one fails: :meth:`Link._retry_or_fail`)."""

    __slots__ = ("chain", "token", "runs")

    def __init__(self, chain: str | None, token: str | None, runs: int | None):
        self.chain, self.token, self.runs = chain, token, runs


class Link(base.Task):
    """Base task of every chain link; ``tool`` and ``step`` are set per task class.

    Retries on a lost database, metrics and after-commit enqueueing come from
    :class:`tasks.base.Task`; a link's run is timed per tool and step.
    """

    abstract = True
    ignore_result = True
    acks_late = True
    reject_on_worker_lost = True
    tool: Tool
    step: Step
    index: int
    absorbs: Step | None  # the next step, when it has no work of its own: this link does it

    def apply_async(self, args: Any = None, kwargs: Any = None, **options: Any) -> Any:
        """Celery's, on the producer :func:`enqueue` holds when it sends this link as its chain's first
        (:func:`_publish_with_held_producer`)."""
        return _publish_with_held_producer(super().apply_async, {"args": args, "kwargs": kwargs, **options})

    def begun(self) -> None:
        if self.index == 0 and not self.request.retries:  # the chain's first link, first run
            metrics.call_started(self.tool.name)
        self.request.link_began = (time.time(), time.perf_counter())
        self.request.link_took_s = None

    def ran(self, seconds: float) -> None:
        """The step's histogram takes the time the run recorded on its call (:meth:`_attempt`), the very
        figure the console reads; a run that recorded none (it stopped at its gate, found its step
        done, waited for a claim) is counted by ``voice_tools_tasks_total`` only."""
        took = getattr(self.request, "link_took_s", None)
        if took is not None:
            metrics.step_ran(self.tool.name, self.step.name, took)

    def _attempt(self, outcome: str, error: BaseException | str | None = None) -> dict[str, Any] | None:
        """This run's entry for the call's ``link_attempts``, timed from its start to now (the statement
        that records it); None once the run has one (a link that also does the next step records one
        run), or when no worker ran it (called directly)."""
        began = getattr(self.request, "link_began", None)
        if began is None or getattr(self.request, "link_took_s", None) is not None:
            return None
        entry = link_attempts.entry(self.step.name, began[0], time.perf_counter() - began[1], outcome, error)
        self.request.link_took_s = entry["took_ms"] / 1000
        return entry

    def drive(self, tool_call_id: str, chain_id: str | None = None) -> None:  # noqa: C901  (the one place the steps are driven)
        tool, step = self.tool, self.step
        progress = self.index / len(tool.steps)
        commit = step.side_effect and not step.checkpoint
        token = claim_token() if commit else None  # this attempt's claim on the side effect
        with db.statement() as s:
            if commit:
                # a side effect's point of no return is passed, and its claim taken, by the statement
                # that checks EXECUTING and the chain (on disk before the step runs)
                call = lifecycle.begin_step(s, tool_call_id, step.name, progress, commit=True, chain=chain_id,
                                            token=token, lease_s=tool.time_limit + 10)
            else:  # a step without side effect claims nothing: its gate is a read (running it twice is harmless)
                call = lifecycle.gate(s, tool_call_id, chain_id)
        if call is None:
            return self._stop()
        if step.name in call.step_outputs:
            # Redelivered after this step was recorded: do not redo it. A checkpoint
            # that was already passed must not start the rest of the chain twice.
            if self.absorbs is None:
                return self._stop() if step.checkpoint else None
            if self.absorbs.checkpoint and self.absorbs.name in call.step_outputs:
                return self._stop()
            # the run that recorded it may have stopped before the step this link does after it
            return self._marker(StepInput(call.tool_call_id, call.session_id, call.parameters, call.step_outputs,
                                          call.caller or ""))
        if commit and call.effect_claimed_by != token:  # another attempt holds a live claim
            if holder_gone(call.effect_claimed_by):  # ... but its process was killed: this copy goes on
                with db.statement() as s:
                    taken = lifecycle.take_over_claim(s, tool_call_id, step.name, call.effect_claimed_by, token,
                                                      tool.time_limit + 10)
                call = taken or call
            if call.effect_claimed_by != token:
                return self._wait_for_claim(call.effect_claimed_until)
        earlier = bool(commit and call.effect_attempts > 1)
        given = StepInput(call.tool_call_id, call.session_id, call.parameters, call.step_outputs,
                          call.caller or "", earlier_attempt=earlier)
        attempt = Attempt(chain_id, token, call.effect_attempts if commit else None)

        if step.checkpoint:
            return self._checkpoint(given, progress)

        try:
            output = step.run(given) if step.run else None
        except TransientError as exc:
            return self._retry_or_fail(tool_call_id, given, exc, attempt)
        except SoftTimeLimitExceeded:
            return self._retry_or_fail(tool_call_id, given, TransientError(f"step {step.name} timed out"), attempt)
        except backends.Unconfirmed as exc:  # the service's answers leave the effect unknown
            return self._fail(tool_call_id, given, str(exc).rstrip("."), unconfirmed=True, cause=exc)
        except (PermanentError, backends.Refused) as exc:  # the service (or the step) said no
            # "not done" only if no earlier attempt of a side effect can have acted
            return self._fail(tool_call_id, given, str(exc).rstrip("."), refused=not given.earlier_attempt, cause=exc)
        except Exception as exc:  # classify it; an unforeseen error fails the call, never leaves it hanging
            if tools.is_transient(exc):
                return self._retry_or_fail(tool_call_id, given, exc, attempt)
            log.exception("step %s of %s failed", step.name, tool_call_id)
            return self._fail(tool_call_id, given, f"Unexpected error in {step.name}: {type(exc).__name__}",
                              cause=type(exc).__name__)  # an unforeseen message may carry anything

        if self.index == len(tool.steps) - 1:
            return self._complete(tool_call_id, given, step.name, output)
        progress_done = (self.index + 1) / len(tool.steps)
        event = events.event("progress", step=step.name, gate=self.index + 1, progress=progress_done,
                             message=tool.say(step.message, given.parameters), inline=True)
        with db.statement() as s:
            call = lifecycle.record_step(s, tool_call_id, step.name, output, progress_done, event=event,
                                         chain=chain_id, token=token,  # a link doing the next step records its run with it
                                         attempt=self._attempt(link_attempts.DONE) if self.absorbs is None else None)
        if call is None:
            return self._stop()
        attempts.deliver_inline(events.delivery_of(call), later=self._after)
        if self.absorbs is not None:  # the next step has no work of its own: this link does it (it ends the chain)
            return self._marker(replace(given, outputs={**given.outputs, step.name: output}))
        if token is not None and chain_id is not None and call.workflow_id != chain_id:
            # the effect was this attempt's, the chain no longer is the call's (run again meanwhile):
            # what follows goes on under the call's current chain, whose own copy waits for the claim
            self._stop()
            signature(tool, tool_call_id, self.index + 1, call.workflow_id).apply_async()
        return None

    def _wait_for_claim(self, claimed_until: datetime | None) -> None:
        """Another attempt of this side effect holds a live claim: run this copy again when the claim
        ends, without acting now. The copy is the same message (same retries): waiting is not a failure."""
        left = (claimed_until - datetime.now(timezone.utc)).total_seconds() if claimed_until else 0.0
        countdown = max(1.0, left + 1.0)
        log.info("%s[%s]: the side effect is claimed by another attempt; runs again in %.0f s",
                 self.name, self.request.id, countdown)
        again = self.signature_from_request(self.request, countdown=countdown, retries=self.request.retries)
        self._publish_or_requeue(again.apply_async, countdown)
        raise Retry(when=countdown, sig=again)

    # -- the posted callbacks' outcomes, recorded once the next link is sent ------------

    def _after(self, work: Any) -> None:
        """Leave ``work`` (recording a callback attempt) for :meth:`after_return`, which Celery
        calls after sending the chain's next link; called directly (no worker), do it now."""
        if self.request.called_directly:
            work()
            return
        pending = getattr(self.request, "voice_tools_after", None)
        if pending is None:
            pending = self.request.voice_tools_after = []
        pending.append(work)

    def after_return(self, status: str, retval: Any, task_id: str, args: Any, kwargs: Any, einfo: Any) -> None:
        self._run_after()
        super().after_return(status, retval, task_id, args, kwargs, einfo)

    def _run_after(self) -> None:
        pending = getattr(self.request, "voice_tools_after", None) or []
        self.request.voice_tools_after = None
        for work in pending:
            try:
                work()
            except Exception:  # the row stays claimed until its lease ends: the retry sweep sends it again
                log.exception("could not record a callback attempt of %s", self.name)

    def on_failure(self, exc: BaseException, task_id: str, args: Any, kwargs: Any, einfo: Any) -> None:
        """The link itself ended in error: fail its call now, not after the stuck-call sweep.

        Steps' own errors are handled in :meth:`drive`; what reaches here is what
        Celery ends from outside: the hard time limit (the pool child is killed;
        Celery calls this in the worker's main process) or database retries used up.
        Only the call still EXECUTING at this link's step is failed, with the sentence
        that fits how far it got (never "not sent" past the point of no return).
        """
        super().on_failure(exc, task_id, args, kwargs, einfo)
        tool_call_id = args[0] if args else None
        if not tool_call_id:
            return
        if isinstance(exc, TimeLimitExceeded):
            error = f"step {self.step.name} ran past its hard time limit"
        else:
            error = f"Unexpected error in {self.step.name}: {type(exc).__name__}"
        try:
            with db.session() as s:
                call = queries.get(s, tool_call_id)  # what it had done, for the sentence
            sentence = self.tool.failure_sentence(self.step, call.step_outputs, refused=False)
            outcome = self.tool.failure_outcome(self.step, call.step_outputs, refused=False)
            claims = self.step.side_effect and not self.step.checkpoint  # its gate recorded the step
            chain_id = args[1] if len(args) > 1 else None
            fail_call(self.tool, tool_call_id, error, call.parameters, step=self.step.name, gate=self.index + 1,
                      sentence=sentence, outcome=outcome,  # the statement checks EXECUTING at this step:
                      only_at_step=claims, unrecorded=None if claims else (self.step.name, chain_id))
        except Exception:  # the database may be what failed: the stuck-call sweep is the backstop
            log.exception("could not record the failure of %s at %s", tool_call_id, self.step.name)

    # -- the endings ---------------------------------------------------------------

    def _stop(self) -> None:
        """End the chain here: the following links are not sent."""
        self.request.chain = None
        self.request.callbacks = None
        return None

    def _marker(self, given: StepInput) -> None:
        """Do the step after this one, which has no work of its own (:func:`done_by_the_link_before`):
        the checkpoint, or the completion. ``given``: the call with this link's step recorded."""
        index, step = self.index + 1, self.absorbs
        if step.checkpoint:
            return self._checkpoint(given, index / len(self.tool.steps), step, index)
        return self._complete(given.tool_call_id, given, step.name, None, index)

    def _checkpoint(self, given: StepInput, progress: float, step: Step | None = None,
                    index: int | None = None) -> None:
        tool, step = self.tool, step or self.step
        index = self.index if index is None else index
        preview = step.preview(given) if step.preview else None
        event = events.event("checkpoint", step=step.name, gate=index + 1, progress=progress,
                             message=tool.say(step.message, given.parameters), requires_confirmation=True,
                             preview=preview, inline=True)
        with db.statement() as s:
            call = lifecycle.checkpoint(s, given.tool_call_id, step.name, progress, output=preview or {}, event=event,
                                        attempt=self._attempt(link_attempts.DONE))
        if call is None:
            return self._stop()
        attempts.deliver_inline(events.delivery_of(call), later=self._after)
        return self._stop()

    def _complete(self, tool_call_id: str, given: StepInput, step_name: str, output: Any,
                  index: int | None = None) -> None:
        tool = self.tool
        index = self.index if index is None else index
        outputs = dict(given.outputs)
        if output is not None:
            outputs[step_name] = output
        result = tool.result(outputs)
        voice = tool.say(tool.voice_response, given.parameters, result=result)
        context_key = result.get("context_key") if isinstance(result, dict) else None
        event = events.event("completed", step=step_name, gate=index + 1, progress=1.0, message=voice,
                                context_key=context_key, inline=True)
        with db.statement() as s:
            call = lifecycle.complete(s, tool_call_id, result, voice, context_key=context_key, event=event,
                                      attempt=self._attempt(link_attempts.DONE))
        if call is None:
            return self._stop()
        metrics.call_ended(tool.name, call.status)  # its statement has committed (autocommit)
        attempts.deliver_inline(events.delivery_of(call), later=self._after)
        return None

    def _fail(self, tool_call_id: str, given: StepInput, error: str, refused: bool = False,
              unconfirmed: bool = False, cause: BaseException | str | None = None) -> None:
        if unconfirmed:
            sentence, outcome = self.tool.unconfirmed_response, UNCONFIRMED
        else:
            sentence = self.tool.failure_sentence(self.step, given.outputs, refused)
            outcome = self.tool.failure_outcome(self.step, given.outputs, refused)
        fail_call(self.tool, tool_call_id, error, given.parameters, step=self.step.name, gate=self.index + 1,
                  sentence=sentence, outcome=outcome, attempt=self._attempt(link_attempts.FAILED, cause))
        return self._stop()

    def retry(self, *args: Any, **kwargs: Any) -> Any:
        """Celery's retry, except when the broker cannot take the retry's message.

        Celery then raises ``Reject(requeue=False)``: the running message is dropped with
        the rest of the chain, and the call would sit EXECUTING until the stuck-call sweep.
        The message is handed back to the broker instead (``requeue=True``): delivered
        again once the broker takes it (on Redis, if the requeue itself cannot reach the
        broker, the message stays unacknowledged and is restored after the visibility
        timeout; on AMQP a lost connection returns it), the link runs again (links are
        idempotent). Both retry paths come here: :meth:`_retry_or_fail` and the autoretry
        of database errors.
        """
        try:
            return super().retry(*args, **kwargs)
        except Reject as rejected:
            if rejected.requeue:
                raise
            self._requeue(rejected.reason, kwargs.get("countdown") or 1)

    def _publish_or_requeue(self, publish: Any, countdown: float) -> None:
        try:
            publish()
        except Exception as exc:
            self._requeue(exc, countdown)

    def _requeue(self, reason: Any, countdown: float) -> None:
        """The broker refused the publish of this link's next run: hand the running message back
        instead (it runs again once the broker takes it), after waiting out the run's backoff (at
        most :data:`REQUEUE_WAIT_S`), so a broker that keeps refusing is never a hot loop. The
        runs are counted in the database: the call fails past its tool's bound."""
        wait = min(float(countdown), REQUEUE_WAIT_S)
        log.warning("%s[%s]: the retry could not be published (%s: %s); the message goes back to the broker "
                    "in %.0f s", self.name, self.request.id, type(reason).__name__, str(reason)[:200], wait)
        time.sleep(wait)
        raise Reject(str(reason)[:200], requeue=True) from None

    def _retry_or_fail(self, tool_call_id: str, given: StepInput, exc: Exception, attempt: Attempt) -> None:
        """Retry the step with backoff, or fail the call once its runs (counted in the database:
        ``attempt.runs``) exceed the tool's ``max_retries``."""
        runs = attempt.runs
        if runs is None:  # a step without side effect: its gate counted nothing, this failed run is counted now
            with db.statement() as s:
                runs = lifecycle.count_failed_run(s, tool_call_id, self.step.name, attempt.chain)
            if runs is None:  # no longer this chain's to run (cancelled, failed, run again)
                return self._stop()
        retries = runs - 1
        if retries >= self.tool.max_retries:  # the call's one traceback of these runs
            log.warning("%s of %s gave up after %d retries", self.step.name, tool_call_id, retries, exc_info=exc)
            return self._fail(tool_call_id, given, f"{exc} (gave up after {retries} retries)", cause=exc)
        retried = self._attempt(link_attempts.RETRIED, exc)
        if attempt.token is not None:  # the retry claims the effect again, knowing this attempt may have acted
            with db.statement() as s:
                lifecycle.release_claim(s, tool_call_id, attempt.token, attempt=retried)
        elif retried is not None:  # known only now that the run is retried, not failed: a statement of its own
            with db.statement() as s:
                lifecycle.add_attempt(s, tool_call_id, retried)
        raise self.retry(exc=exc, countdown=min(2 ** retries, 30), max_retries=RETRIES_UNBOUNDED_HERE)


class _NoTracebackOnRequeue(logging.Filter):
    """Celery logs every rejected run with its traceback: a link handed back because the broker
    refused its retry logs one line per run (:meth:`Link._requeue`), and its call one traceback,
    when it gives up."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        name = str((getattr(record, "data", None) or {}).get("name", ""))
        if isinstance(exc, Reject) and exc.requeue and name.startswith("tools."):
            record.exc_info, record.exc_text = None, None
        return True


logging.getLogger("celery.app.trace").addFilter(_NoTracebackOnRequeue())


def _run_link(self: Link, tool_call_id: str, chain_id: str | None = None) -> None:
    """A link's run: ``chain_id`` is its chain's (a message sent without one, by an older deploy,
    passes the gate of any chain of its call)."""
    try:
        return self.drive(tool_call_id, chain_id)
    except BaseException:  # a retry or an error: Celery may not call after_return; record now
        self._run_after()
        raise


def done_by_the_link_before(tool: Tool, index: int) -> bool:
    """Is step ``index`` one with no work of its own (a checkpoint, or a last step with no ``run`` and
    no side effect) after a step with work? Then the link of that step does it, after recording its
    own step: no link of its own is sent for it (no broker hop, no gate of its own), unless a chain
    starts at it. Its task stays registered (a chain sent by an older deploy carries it)."""
    if index == 0 or tool.steps[index - 1].checkpoint:
        return False
    step = tool.steps[index]
    last = index == len(tool.steps) - 1
    return step.checkpoint or (last and step.run is None and not step.side_effect)


def _links_for(tool: Tool) -> list[Link]:
    """One ``Link`` task per step of ``tool``, named ``tools.<name>.<step>``."""
    return [
        app.task(
            bind=True,
            base=Link,
            name=tool.task_name(step),
            shared=False,
            time_limit=tool.time_limit + 10,
            soft_time_limit=tool.time_limit,
            tool=tool,
            step=step,
            index=index,
            absorbs=tool.steps[index + 1] if index + 1 < len(tool.steps) and done_by_the_link_before(tool, index + 1)
            else None,
        )(_run_link)
        for index, step in enumerate(tool.steps)
    ]


def _register_links() -> dict[str, list[Link]]:
    return {tool.name: _links_for(tool) for tool in tools.TOOLS.values()}


def register_tool(tool: Tool) -> list[Link]:
    """Add a tool at run time (tests, plugins): registry entry, queue and link tasks.

    A worker already running must be told to consume ``tool.queue``
    (``app.control.add_consumer``); workers started later consume it anyway.
    """
    unregister_tool(tool.name)
    tools.TOOLS[tool.name] = tool
    app.conf.task_queues = (*app.conf.task_queues, queue(tool.queue))
    LINKS[tool.name] = _links_for(tool)
    return LINKS[tool.name]


def unregister_tool(name: str) -> None:
    """Undo :func:`register_tool` (the tasks too, so the name can be reused)."""
    tool = tools.TOOLS.pop(name, None)
    LINKS.pop(name, None)
    if tool is None:
        return
    app.conf.task_queues = tuple(q for q in app.conf.task_queues if q.name != tool.queue)
    for step in tool.steps:
        app.tasks.pop(tool.task_name(step), None)


LINKS = _register_links()


# -- starting a chain -------------------------------------------------------------

# Celery publishes a link's next link in the worker once the link has run (its side
# effect may be done): that publish must outlast a broker restart, not fail a call whose
# work is done, and Celery's default policy gives up within a second. About a minute
# here; the first link's publish keeps the policy its apply_async is given (QUICK_RETRY).
NEXT_LINK_RETRY = {"max_retries": 30, "interval_start": 0, "interval_step": 0.5, "interval_max": 2}


def signature(tool: Tool, tool_call_id: str, start: int = 0, chain_id: str | None = None):
    """The chain of the tool's links from step ``start``, as immutable signatures, each carrying
    ``chain_id`` (the call's ``workflow_id`` for this chain) after the call's id; a step done by the
    link before it (:func:`done_by_the_link_before`) has no link of its own in it."""
    args = (tool_call_id,) if chain_id is None else (tool_call_id, chain_id)
    links = [link for index, link in enumerate(LINKS[tool.name])
             if index == start or (index > start and not done_by_the_link_before(tool, index))]
    return chain(*(link.si(*args).set(retry_policy=NEXT_LINK_RETRY) for link in links))


QUICK_RETRY = publishing.QUICK_RETRY  # a face's publish: one quick reconnect, then 503

# The producer a thread's :func:`enqueue` holds while it publishes, for :meth:`Link.apply_async`.
_held_producer: ContextVar[Any] = ContextVar("voice_tools_held_producer", default=None)


def _publish_with_held_producer(apply_async: Any, options: dict[str, Any]) -> Any:
    """Celery's chain sends its first link with ``Task.apply_async`` but drops the ``producer`` its own
    ``apply_async`` was given (``_chain.run`` takes the argument and does not pass it on), so ``send_task``
    would take a second producer from the pool while :func:`enqueue` holds the first: with as many
    threads publishing as the pool holds, each would wait for ever for another's. The first link goes out
    on the producer :func:`enqueue` holds instead."""
    held = _held_producer.get()
    if held is not None and options.get("producer") is None and db.current() is None:  # sent now, not after a commit
        options["producer"] = held
    return apply_async(**options)


def enqueue(tool: Tool, call: Any, start: int, workflow_id: str) -> str:
    """Send the chain from step ``start``: ``workflow_id`` (recorded already, by the transition that
    started the call) is its id and every link's second argument: only that chain passes a gate.

    The publish holds one pooled broker connection (:func:`tasks.publishing.producer`: taken within
    ``broker_pool_acquire_timeout``, checked with one quick reconnect) and nothing else pooled: the
    chain's first link goes out on its producer. A pool still empty after that wait, like a broker
    that does not answer, is :class:`BrokerUnavailable` (503, ``Retry-After``), never a thread left
    waiting."""
    try:
        with logs.bound(tool_call_id=call.tool_call_id, session_id=call.session_id), \
                publishing.producer(app) as producer:  # the links' messages carry the call (tasks/worker/log_context.py)
            held = _held_producer.set(producer)
            try:
                result = signature(tool, call.tool_call_id, start, workflow_id).apply_async(
                    retry=True, retry_policy=publishing.QUICK_RETRY, task_id=workflow_id)
            finally:
                _held_producer.reset(held)
    except (KombuOperationalError, RedisError, OSError) as exc:
        raise BrokerUnavailable(str(exc)) from exc
    return result.id


# -- failing a call (a link's step, its hard time limit, the stuck-call sweep) -----------

def fail_call(tool: Tool, tool_call_id: str, error: str, parameters: Any, *, step: str | None = None,
              gate: int | None = None, from_statuses: tuple[str, ...] = ("EXECUTING",),
              uncommitted_only: bool = False, sentence: Message | None = None,
              only_at_step: bool = False, outcome: str = NOT_DONE, quiet_s: int | None = None,
              unrecorded: tuple[str, str | None] | None = None, attempt: dict[str, Any] | None = None) -> ToolCall | None:
    """Fail the call (only if still in ``from_statuses``) and announce it; ``only_at_step``: only while
    it is at ``step``; ``unrecorded``: only while ``(step, chain)``'s step is not recorded and, given
    the chain, that chain is the call's (a step without side effect, whose gate recorded nothing);
    ``attempt``: the failed link run's entry for ``link_attempts``."""
    voice = tool.say(tool.failure_response if sentence is None else sentence, parameters,
                     error=error.rstrip("."), tool=tool.spoken_name)
    with db.session() as s:
        call = lifecycle.fail(s, tool_call_id, error, voice, from_statuses=from_statuses,
                              uncommitted_only=uncommitted_only, at_step=step if only_at_step else None,
                              outcome=outcome, quiet_s=quiet_s,
                              unrecorded_step=unrecorded[0] if unrecorded else None,
                              chain=unrecorded[1] if unrecorded else None, step=step, attempt=attempt)
        if call is None:
            return None
        delivery = record(s, call, "failed", step=step, gate=gate, message=voice, inline=True)
    attempts.deliver_inline(delivery)
    return call
