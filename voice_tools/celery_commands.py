"""The operators' commands, in Celery's CLI (``celery.commands`` entry points in setup.cfg)::

    celery -A tasks calls list [--status S]... [--session ID] [--tool NAME] [--since 1h] [--limit N] [--json]
    celery -A tasks calls show ID [--json]
    celery -A tasks calls cancel ID [--reason TEXT] [--json]
    celery -A tasks calls stats [--since 1d] [--tool NAME] [--json]
    celery -A tasks calls purge [--older-than 30d] [--dry-run] [--batch N] [--json]
    celery -A tasks callbacks redeliver [--failed] [--call ID] [--json]

A face like the API: arguments are checked with the API's schemas; list, show, stats and
redeliver are operations of the calls room for operators (``tasks.calls.admin``), a cancel is
the API's own (``tasks.calls.operations.cancel``: the state machine's rules, the ``cancelled``
event, the same answer and errors); the commands parse and print.
With no ``DATABASE_URL`` / ``REDIS_URL`` set they join the data dir's embedded servers
as ``voice-tools run`` finds them (``servers.ensure_servers``), so they work from a
second terminal with no exports, and leave those servers running when they end. Loaded by
Celery's CLI before the app, this module also makes every other command of ``celery -A tasks``
(``inspect``, ``status``, ``events``, ``worker`` …) join them (``_join_for_every_command``).

Exit status: 0 done, 1 refused (``too_late``, ``already_terminal``: the API's 409),
2 bad usage or input, 3 no such call (the API's 404), 4 no database (unreachable or not
migrated). A control character in what they print (a stored value's) is written ``\\u00NN``, never raw.
"""
from __future__ import annotations

import json
import os
import re
from datetime import datetime, timedelta, timezone
from typing import Any

import click

EXIT_REFUSED = 1
EXIT_USAGE = 2
EXIT_NOT_FOUND = 3
EXIT_UNAVAILABLE = 4

_AGO = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*$", re.IGNORECASE)
_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days", "w": "weeks"}


class Since(click.ParamType):
    """``90s``, ``15m``, ``2h``, ``7d``, ``1w`` ago, or an ISO 8601 date or time (UTC unless it says)."""

    name = "since"

    def convert(self, value: Any, param: Any, ctx: Any) -> datetime:
        if isinstance(value, datetime):
            return value
        match = _AGO.match(str(value))
        if match:
            return datetime.now(timezone.utc) - timedelta(**{_UNITS[match[2].lower()]: float(match[1])})
        try:
            moment = datetime.fromisoformat(str(value).strip())
        except ValueError:
            self.fail(f"{value!r} is neither a duration ago (90s, 15m, 2h, 7d, 1w) nor an ISO 8601 time", param, ctx)
        return moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc)


class Age(click.ParamType):
    """A positive duration, ``90s``, ``15m``, ``2h``, ``30d``, ``1w``, as seconds."""

    name = "age"

    def convert(self, value: Any, param: Any, ctx: Any) -> float:
        if isinstance(value, (int, float)):
            return float(value)
        match = _AGO.match(str(value))
        if not match or float(match[1]) <= 0:
            self.fail(f"{value!r} is not a positive duration (90s, 15m, 2h, 30d, 1w)", param, ctx)
        return timedelta(**{_UNITS[match[2].lower()]: float(match[1])}).total_seconds()


def _statuses() -> list[str]:
    from models.calls import STATUSES

    return list(STATUSES)


def _tool_names() -> list[str]:
    from tasks import tools

    return sorted(tools.TOOLS)


class LazyChoice(click.Choice):
    """A choice whose values are read when a command first needs them (to parse or to show its
    help), not when Celery's CLI loads this module: every ``celery`` command of every app in the
    environment loads it (the ``celery.commands`` entry points), and must not import the product."""

    def __init__(self, load: Any, case_sensitive: bool = True) -> None:
        self._load = load
        self._loaded: tuple[str, ...] | None = None
        self.case_sensitive = case_sensitive

    @property  # type: ignore[override]
    def choices(self) -> tuple[str, ...]:
        if self._loaded is None:
            self._loaded = tuple(self._load())
        return self._loaded


# -- every Celery command: the data dir's servers ------------------------------------------------

# The Celery commands that need the database too: the worker runs the tasks, the shell is for
# looking at things; the others (beat, inspect, control, status, events, flower, purge …) need
# the broker only.
NEEDS_DATABASE = ("worker", "shell")
OWN_CONNECT = ("calls", "callbacks")  # ours: each command joins what it needs (``_connect``)


def join_servers(app: Any, database: bool = False) -> dict[str, str]:
    """Find the broker (and the database) as ``voice-tools run`` does: the variables, else the
    data dir's embedded servers, joined (or started, and stopped again at exit)."""
    from voice_tools import servers

    had_broker = bool(os.environ.get("CELERY_BROKER_URL") or os.environ.get("REDIS_URL"))
    urls = servers.ensure_servers(need=("postgres", "redis") if database else ("redis",))
    if not had_broker:
        # celeryconfig read the environment before the servers were found
        app.conf.broker_url = urls["REDIS_URL"]
    return urls


def _join_for_every_command(sender: Any = None, app: Any = None, options: dict[str, Any] | None = None,
                            **_: Any) -> None:
    """``user_preload_options``, sent by Celery's CLI before any command of ``celery -A tasks`` runs
    (the app declares the ``--data-dir`` preload option, so every command has it): with no server
    variable set, the command joins the data dir's embedded servers, so ``celery -A tasks inspect
    ping``, ``status`` or ``events`` from a second terminal with no exports reach the local run."""
    if app is None or getattr(app, "main", None) != "tasks":
        return
    if (options or {}).get("data_dir"):
        os.environ["VOICE_TOOLS_DATA_DIR"] = str((options or {})["data_dir"])
    ctx = click.get_current_context(silent=True)
    command = ctx.info_name if ctx is not None else None
    if command in OWN_CONNECT:
        return
    join_servers(app, database=command in NEEDS_DATABASE)


def _listen() -> None:
    from celery.signals import user_preload_options

    user_preload_options.connect(_join_for_every_command, weak=False, dispatch_uid="voice-tools-join-servers")


_listen()  # this module is loaded by Celery's CLI (``celery.commands`` entry points), before the app


def _connect(ctx: click.Context, broker: bool = False) -> None:
    """Find the database (and the broker) as ``voice-tools run`` does: the variables, else
    the data dir's embedded servers, joined (or started, and stopped again at exit)."""
    from voice_tools import servers

    if broker:
        join_servers(ctx.obj.app, database=True)
    else:
        servers.ensure_servers(need=("postgres",))
    from sqlalchemy.exc import OperationalError

    from tasks.calls import admin

    try:
        ready = admin.tables_ready()
    except OperationalError as exc:
        _echo(f"Error: cannot reach the database: {str(exc.orig).strip()}", err=True)
        raise SystemExit(EXIT_UNAVAILABLE) from None
    if not ready:
        _echo("Error: this database has no voice-tools tables: run `voice-tools migrate` "
                   "(or `voice-tools run`) first.", err=True)
        raise SystemExit(EXIT_UNAVAILABLE)


def _check(schema: Any, data: dict[str, Any]) -> dict[str, Any]:
    """Load ``data`` with one of the API's schemas; a refusal is a usage error naming the field."""
    from marshmallow import ValidationError

    try:
        return schema().load({k: v for k, v in data.items() if v is not None})
    except ValidationError as exc:
        fields = "; ".join(f"{name}: {' '.join(map(str, msgs)) if isinstance(msgs, list) else msgs}"
                           for name, msgs in exc.normalized_messages().items())
        raise click.UsageError(fields) from None


# What a terminal is never sent raw: a control character (C0 but the line end, DEL, C1), stored or not
_CONTROL = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f]")


def _escaped(text: str) -> str:
    """``text`` with each control character but the line end written ``\\u00NN`` (a JSON escape too, so a
    ``--json`` output reads back the same)."""
    return _CONTROL.sub(lambda found: "\\u%04x" % ord(found.group()), text)


def _echo(message: Any = "", **kwargs: Any) -> None:
    """Every line these commands print: :func:`_escaped`, so a stored value sends the operator's terminal
    no escape sequence."""
    click.echo(_escaped(str(message)), **kwargs)


def _table(rows: list[list[Any]], headers: list[str]) -> str:
    from tabulate import tabulate

    cells = [[cell.replace("\n", "\\n") if isinstance(cell, str) else cell for cell in row] for row in rows]
    return tabulate(cells, headers=headers, tablefmt="simple", disable_numparse=True, missingval="-")


def _json(data: Any) -> None:
    _echo(json.dumps(data, indent=2, default=str, ensure_ascii=False))


def _when(moment: datetime | None) -> str | None:
    return moment.astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M:%S") if moment else None


def _text(value: Any, width: int = 60) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str, ensure_ascii=False)
    return text if len(text) <= width else text[: width - 1] + "…"


def _record(call: Any) -> dict[str, Any]:
    from tasks.calls import schemas

    return schemas.CallRecord().dump(call)


# -- calls ----------------------------------------------------------------------------------

@click.group()
def calls() -> None:
    """List, inspect, cancel and count tool calls."""


@calls.command("list")
@click.option("--status", "statuses", multiple=True, type=LazyChoice(_statuses, case_sensitive=False),
              help="Only calls in this status (repeatable).")
@click.option("--session", "session_id", help="Only calls of this session.")
@click.option("--tool", type=LazyChoice(_tool_names), help="Only calls of this tool.")
@click.option("--since", type=Since(), help="Only calls created since: 15m, 2h, 7d ago, or an ISO time.")
@click.option("--limit", default=50, show_default=True, type=click.IntRange(1, 10000), help="At most this many.")
@click.option("--json", "as_json", is_flag=True, help="JSON (each call's whole record) instead of a table.")
@click.pass_context
def list_(ctx: click.Context, statuses: tuple[str, ...], session_id: str | None, tool: str | None,
          since: datetime | None, limit: int, as_json: bool) -> None:
    """The calls, newest first."""
    from tasks.calls import admin, schemas

    if session_id is not None:
        session_id = _check(schemas.SessionPath, {"session_id": session_id})["session_id"]
    _connect(ctx)
    found = admin.list_calls(statuses=[st.upper() for st in statuses], session_id=session_id, tool=tool,
                             since=since, limit=limit + 1)  # one more: does the limit cut the list?
    cut = len(found) > limit
    found = found[:limit]
    note = (f"The newest {limit} calls; more match: raise --limit, or narrow with --status, --session, --tool "
            f"or --since.") if cut else None
    if as_json:
        _json([_record(call) for call in found])
        if note:
            _echo(note, err=True)  # stdout stays the JSON list
        return
    if not found:
        _echo("No calls match.")
        return
    _echo(_table(
        [[c.tool_call_id, c.function_name, c.status, c.outcome, c.current_step, c.session_id, _when(c.created_at),
          c.execution_time_ms, c.caller] for c in found],
        ["ID", "TOOL", "STATUS", "OUTCOME", "STEP", "SESSION", "CREATED (UTC)", "MS", "CALLER"],
    ))
    if note:
        _echo(f"\n{note}")


@calls.command("show")
@click.argument("tool_call_id")
@click.option("--json", "as_json", is_flag=True, help="JSON: the API's status record, step outputs and callbacks.")
@click.pass_context
def show(ctx: click.Context, tool_call_id: str, as_json: bool) -> None:
    """One call: both histories, step outputs, result, and every callback attempt."""
    from models import queries
    from tasks.calls import admin, schemas

    tool_call_id = _check(schemas.ToolCallPath, {"tool_call_id": tool_call_id})["tool_call_id"]
    _connect(ctx)
    try:
        shown = admin.show(tool_call_id)
    except queries.NotFound:
        _not_found(tool_call_id, as_json)
    call, sent = shown.call, shown.deliveries
    if as_json:
        _json({**_record(call), "step_outputs": _step_outputs(call), "callbacks": [_delivery(d) for d in sent]})
        return
    _show(call, sent)


def _step_outputs(call: Any) -> dict[str, Any]:
    """The call's step outputs in its chain's order (the console's own order: ``browse.step_outputs``)."""
    from tasks.calls import browse

    return browse.step_outputs(call)


def _delivery(d: Any) -> dict[str, Any]:
    return {"event_id": d.event_id, "seq": d.seq, "event": d.event, "url": d.url, "state": d.state,
            "attempts": d.attempts, "response_code": d.response_code, "last_error": d.last_error,
            "next_attempt_at": d.next_attempt_at, "delivered_at": d.delivered_at, "created_at": d.created_at,
            "attempt_log": d.attempt_log}


def _show(call: Any, sent: list[Any]) -> None:
    echo = _echo
    echo(_table([
        ["tool_call_id", call.tool_call_id], ["tool", f"{call.function_name} ({call.action_level})"],
        ["status", call.status], ["outcome", call.outcome], ["step", call.current_step], ["progress", f"{call.progress:.0%}"],
        ["session", call.session_id], ["intent", call.intent_id], ["caller", call.caller],
        ["created", _when(call.created_at)], ["confirmed", _when(call.confirmed_at)],
        ["prepared", _when(call.prepared_at)], ["committed", _when(call.committed_at)],
        ["completed", _when(call.completed_at)], ["execution_time_ms", call.execution_time_ms],
        ["attempts / redrives", f"{call.attempts} / {call.redrives}"],
        ["effect claims", call.effect_attempts], ["workflow", call.workflow_id],
        ["callback_url", call.callback_url],
        *([["callback_urls", _text(call.callback_urls, 200)]] if call.callback_urls else []),
        ["error", call.error_message], ["voice_response", call.voice_response],
    ], ["field", "value"]))
    echo(f"\nParameters\n{json.dumps(call.parameters, indent=2, ensure_ascii=False)}")
    echo("\nStatus history")
    echo(_table([[e.get("at"), e.get("status"), e.get("reason"), ", ".join(e.get("fields") or []) or None,
                  e.get("by"), e.get("via")]
                 for e in call.status_history], ["AT", "STATUS", "REASON", "FIELDS", "BY", "VIA"]))
    echo("\nParameter changes")
    echo(_table([[e.get("at"), e.get("field"), _text(e.get("old")), _text(e.get("new"))]
                 for e in call.parameters_history], ["AT", "FIELD", "OLD", "NEW"])
         if call.parameters_history else "(none)")
    echo("\nStep outputs")
    echo(_table([[step, _text(output, 100)] for step, output in _step_outputs(call).items()],
                ["STEP", "OUTPUT"]) if call.step_outputs else "(none)")
    if call.result is not None:
        echo(f"\nResult\n{json.dumps(call.result, indent=2, ensure_ascii=False, default=str)}")
    echo("\nCallbacks")
    echo(_table([[d.seq, d.event, d.state, d.attempts, d.response_code, d.url, _text(d.last_error or "", 50) or None]
                 for d in sent], ["SEQ", "EVENT", "STATE", "ATTEMPTS", "CODE", "URL", "LAST ERROR"])
         if sent else "(none)")
    tries = [[d.seq, d.event, n, a.get("at"), a.get("response_code"), a.get("error")]
             for d in sent for n, a in enumerate(d.attempt_log or [], 1)]
    echo("\nCallback attempts")
    echo(_table(tries, ["SEQ", "EVENT", "#", "AT", "CODE", "ERROR"]) if tries else "(none)")


def _operator() -> Any:
    """The operator at this shell: unscoped (an admin), named by the machine's user, through the CLI."""
    import getpass

    from tasks.calls.callers import Caller

    try:
        name = getpass.getuser()
    except (KeyError, OSError):  # no name for this uid
        name = f"uid {os.getuid()}"
    return Caller(name[:100], admin=True, via="CLI")


def _error_body(exc: Exception) -> dict[str, Any]:
    """The JSON error the API answers for ``exc`` (``{error, message, details}``), from the same code."""
    from tasks.calls import errors

    return errors.payload(errors.api_error(exc))


def _not_found(tool_call_id: str, as_json: bool) -> None:
    from models import queries

    body = _error_body(queries.NotFound(tool_call_id))
    if as_json:
        _json(body)
    else:
        _echo(f"Error: {body['message']}", err=True)
    raise SystemExit(EXIT_NOT_FOUND)


@calls.command("cancel")
@click.argument("tool_call_id")
@click.option("--reason", help="Why (default 'Cancelled by an operator'); kept as the call's error_message.")
@click.option("--json", "as_json", is_flag=True, help="The API's answer as JSON (its 200 body, or its 409/404 error).")
@click.pass_context
def cancel(ctx: click.Context, tool_call_id: str, reason: str | None, as_json: bool) -> None:
    """Cancel a call before its point of no return, as DELETE /voice-tools/cancel/ID does."""
    from models import lifecycle, logs, queries
    from tasks.calls import operations, schemas

    tool_call_id = _check(schemas.ToolCallPath, {"tool_call_id": tool_call_id})["tool_call_id"]
    body = _check(schemas.CancelRequest, {"reason": reason})
    _connect(ctx, broker=True)  # the ``cancelled`` event goes out from the callbacks queue
    try:
        with logs.bound():  # the call's ids on this command's log lines, and no further
            answer, _ = operations.cancel(tool_call_id, body, {}, _operator())  # an operator's, unscoped
    except queries.NotFound:
        _not_found(tool_call_id, as_json)
    except lifecycle.Refused as refused:
        if as_json:
            _json(_error_body(refused))
        else:
            # the state machine's own sentence: "Too late to cancel: the action is already under way."
            _echo(f"Refused ({refused.code}): {refused} Status: {refused.status}.", err=True)
        raise SystemExit(EXIT_REFUSED)
    if as_json:
        _json(answer)
        return
    _echo(f"{answer['tool_call_id']} CANCELLED: {answer['error_message']}")
    _echo(f"voice_response: {answer['voice_response']}")


@calls.command("stats")
@click.option("--since", type=Since(), help="Only calls created since: 15m, 2h, 7d ago, or an ISO time.")
@click.option("--tool", type=LazyChoice(_tool_names), help="Only this tool.")
@click.option("--json", "as_json", is_flag=True, help="JSON, with the count of every status.")
@click.pass_context
def stats(ctx: click.Context, since: datetime | None, tool: str | None, as_json: bool) -> None:
    """Per tool: calls by status, success rate, p50/p95 execution_time_ms, callback failures.

    Success rate is COMPLETED / (COMPLETED + FAILED); the percentiles are over COMPLETED calls.
    """
    from tasks.calls import admin

    _connect(ctx)
    rows = admin.stats(since=since, tool=tool)
    if as_json:
        _json(rows)
        return
    if not rows:
        _echo("No calls match.")
        return
    _echo(_table(
        [[r["tool"], r["total"], r["by_status"]["COMPLETED"], r["by_status"]["FAILED"], r["by_status"]["CANCELLED"],
          r["by_status"]["EXPIRED"], r["open"],
          None if r["success_rate"] is None else f"{r['success_rate']:.1%}", r["p50_ms"], r["p95_ms"],
          r["callbacks_failed"], r["callback_failed_attempts"]] for r in rows],
        ["TOOL", "CALLS", "COMPLETED", "FAILED", "CANCELLED", "EXPIRED", "OPEN", "SUCCESS", "P50 MS", "P95 MS",
         "CB FAILED", "CB FAILED TRIES"],
    ))


@calls.command("purge")
@click.option("--older-than", "older_than", type=Age(),
              help="Remove ended calls and settled events older than this (30d, 12h, ...); "
                   "default: each table's retention (VOICE_TOOLS_RETAIN_CALLS_DAYS, VOICE_TOOLS_RETAIN_EVENTS_DAYS).")
@click.option("--dry-run", is_flag=True, help="Count what would be removed; remove nothing.")
@click.option("--batch", type=click.IntRange(1, 100000), help="Rows per transaction (default VOICE_TOOLS_PURGE_BATCH, 1000).")
@click.option("--json", "as_json", is_flag=True, help="The counts as JSON.")
@click.pass_context
def purge(ctx: click.Context, older_than: float | None, dry_run: bool, batch: int | None, as_json: bool) -> None:
    """Remove what is past its retention, in small batches: ended calls (COMPLETED, FAILED, CANCELLED,
    EXPIRED) with their events, settled events of ended calls, and expired session context.

    Never an open call, never an event still pending (a call with one is kept until it is settled).
    Beat's retention sweep does the same every VOICE_TOOLS_RETENTION_SWEEP_EVERY seconds.
    """
    from tasks.calls import admin

    _connect(ctx)
    out = admin.purge(older_than_s=older_than, dry_run=dry_run, batch=batch)
    counts = {"calls": out.calls, "events": out.events, "context": out.context}
    if as_json:
        _json({"dry_run": dry_run, **counts, "batches": out.batches, "retained_s": out.retained})
        return
    age = {name: "kept forever" if seconds is None else f"older than {_duration(seconds)}"
           for name, seconds in out.retained.items()}
    verb = "Would remove" if dry_run else "Removed"
    _echo(f"{verb} {out.calls} ended calls ({age['calls_s']}) with their events, {out.events} events in all "
               f"(settled ones {age['events_s']}), {out.context} expired context values"
               + ("." if dry_run else f", in {out.batches} batches."))


def _duration(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds / size:g}{unit}"
    return f"{seconds:g}s"


# -- callbacks --------------------------------------------------------------------------------

@click.group()
def callbacks() -> None:
    """Callback deliveries to the relay."""


@callbacks.command("redeliver")
@click.option("--failed", "failed_only", is_flag=True,
              help="Only deliveries whose retries were exhausted (state failed).")
@click.option("--call", "tool_call_id", help="Only this call's deliveries.")
@click.option("--json", "as_json", is_flag=True, help="JSON: the deliveries queued.")
@click.pass_context
def redeliver(ctx: click.Context, failed_only: bool, tool_call_id: str | None, as_json: bool) -> None:
    """Send undelivered callbacks again, from the callbacks queue (a worker posts them).

    --failed: every delivery given up; --call ID: that call's failed or still-retrying ones
    (both: that call's failed ones). A failed delivery gets one more attempt.
    """
    from models import queries
    from tasks.calls import admin, schemas
    from tasks.calls.callers import acted

    if not failed_only and tool_call_id is None:
        raise click.UsageError("say which: --failed (every failed delivery), --call ID, or both")
    if tool_call_id is not None:
        tool_call_id = _check(schemas.ToolCallPath, {"tool_call_id": tool_call_id})["tool_call_id"]
    _connect(ctx, broker=True)
    try:
        sent = admin.redeliver(failed_only=failed_only, tool_call_id=tool_call_id, acted=acted(_operator()))
    except queries.NotFound:
        _not_found(tool_call_id, as_json)
    if as_json:
        _json([{"event_id": d.event_id, "tool_call_id": d.tool_call_id, "seq": d.seq, "event": d.event,
                "url": d.url, "was": d.state, "attempts": d.attempts} for d in sent])
        return
    if not sent:
        _echo("Nothing to redeliver.")
        return
    _echo(_table([[d.tool_call_id, d.seq, d.event, d.state, d.attempts, d.url] for d in sent],
                      ["CALL", "SEQ", "EVENT", "WAS", "ATTEMPTS", "URL"]))
    _echo(f"{len(sent)} deliver{'y' if len(sent) == 1 else 'ies'} queued on the callbacks queue.")
