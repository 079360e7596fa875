"""The operator CLI (``celery -A tasks calls ...``, ``celery -A tasks callbacks redeliver``):
Celery's own command line with our commands, run on rows made through the API and the
lifecycle, against this run's PostgreSQL and Redis (and, for redeliver, a real worker
and relay). One test runs it as a separate process in a second "terminal" with no
server variables, beside a process holding a data dir's servers.
"""
from __future__ import annotations

import configparser
import json
import os
import subprocess
import sys
import tempfile
from datetime import datetime, timedelta, timezone
from importlib import metadata
from pathlib import Path

import pytest
from click.testing import CliRunner
from sqlalchemy import update

from models import db, lifecycle
from models.calls import ToolCall
from tasks import tools
from tasks.calls import actions
from tasks.delivery import attempts
from tasks.delivery import events
from tests.conftest import AUTH
from tests.helpers import deliveries, make_call, row, wait_delivered
from support.procs import ROOT, bare_env, hold_servers, server_answers, stop_process, voice_tools, wait_none_running

# Celery's CLI with our commands: the setup.cfg entry points add them once installed
# (pip install -e .); until this tree is the installed one, they are added here the same way.
RUN_CELERY = """
import sys
from celery.bin.celery import celery, main
from voice_tools.celery_commands import calls, callbacks
for command in (calls, callbacks):
    celery.commands.setdefault(command.name, command)
sys.exit(main())
"""


def celery_group():
    from celery.bin.celery import celery

    from voice_tools.celery_commands import calls, callbacks as callbacks_group

    for command in (calls, callbacks_group):
        celery.commands.setdefault(command.name, command)
    # Celery's group adds the app's preload options (``--data-dir``) to every command at each
    # invocation, made for one invocation per process; here there are many: it adds them again.
    from tasks import app

    preload = app.user_options["preload"]
    for command in celery.commands.values():
        command.params[:] = [param for param in command.params if param not in preload]
    return celery


def cli(*args: str):
    """``celery -A tasks <args>`` in this process (CliRunner on Celery's own click group)."""
    result = CliRunner().invoke(celery_group(), ["-A", "tasks", *args], catch_exceptions=False)
    return result


def cli_json(*args: str):
    result = cli(*args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def _ids(listed) -> list[str]:
    return [c["tool_call_id"] for c in listed]


def _confirmed(call_id: str) -> ToolCall:
    with db.session() as s:
        return lifecycle.confirm(s, call_id)


# -- the entry points ---------------------------------------------------------------------------

def test_setup_cfg_registers_the_commands_as_celery_entry_points():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    lines = dict(line.split(" = ") for line in cfg["options.entry_points"]["celery.commands"].strip().splitlines())
    assert lines == {"calls": "voice_tools.celery_commands:calls", "callbacks": "voice_tools.celery_commands:callbacks"}
    from voice_tools import celery_commands as module

    for name, target in lines.items():
        assert getattr(module, target.split(":")[1]).name == name
    installed = {ep.name: ep.value for ep in metadata.entry_points(group="celery.commands")}
    if "calls" in installed:  # an install of this tree (CI) has them as declared
        assert installed["calls"] == "voice_tools.celery_commands:calls" and installed["callbacks"] == "voice_tools.celery_commands:callbacks"


@pytest.mark.slow
def test_the_real_cli_in_its_own_process_lists_and_counts():
    """``python -m celery -A tasks calls ...`` when the entry points are installed; the same
    main() with the commands added otherwise. This run's DATABASE_URL/REDIS_URL are inherited."""
    call = make_call(session_id="sess_proc")
    installed = "calls" in {ep.name for ep in metadata.entry_points(group="celery.commands")}
    prefix = [sys.executable, "-m", "celery"] if installed else [sys.executable, "-c", RUN_CELERY]
    done = subprocess.run([*prefix, "-A", "tasks", "calls", "list"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    header, rule, line = done.stdout.splitlines()[:3]
    assert header.split()[:4] == ["ID", "TOOL", "STATUS", "OUTCOME"] and set(rule) <= {"-", " "}
    assert line.split()[:3] == [call.tool_call_id, "send_email", "PENDING"]
    done = subprocess.run([*prefix, "-A", "tasks", "calls", "stats", "--json"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert [(r["tool"], r["total"], r["by_status"]["PENDING"]) for r in json.loads(done.stdout)] == \
        [("send_email", 1, 1)]


# -- calls list --------------------------------------------------------------------------------

def test_list_filters_by_status_session_tool_since_and_limit():
    first = make_call(session_id="sess_a")
    cancelled = make_call(session_id="sess_a", parameters={"to": "ann@example.com", "subject": "Lunch"})
    actions.cancel(cancelled.tool_call_id, "Changed my mind")
    other = make_call("create_task", {"title": "Call the bank"}, session_id="sess_b")

    assert _ids(cli_json("calls", "list")) == [other.tool_call_id, cancelled.tool_call_id, first.tool_call_id]
    assert _ids(cli_json("calls", "list", "--status", "CANCELLED")) == [cancelled.tool_call_id]
    assert _ids(cli_json("calls", "list", "--status", "pending", "--status", "CANCELLED")) == \
        [other.tool_call_id, cancelled.tool_call_id, first.tool_call_id]
    assert _ids(cli_json("calls", "list", "--session", "sess_b")) == [other.tool_call_id]
    assert _ids(cli_json("calls", "list", "--tool", "send_email")) == [cancelled.tool_call_id, first.tool_call_id]
    assert _ids(cli_json("calls", "list", "--tool", "send_email", "--status", "PENDING")) == [first.tool_call_id]
    assert _ids(cli_json("calls", "list", "--limit", "1")) == [other.tool_call_id]
    assert len(cli_json("calls", "list", "--since", "1h")) == 3
    later = (datetime.now(timezone.utc) + timedelta(minutes=5)).isoformat()
    assert cli_json("calls", "list", "--since", later) == []
    listed = cli_json("calls", "list", "--status", "CANCELLED")[0]
    assert listed["error_message"] == "Changed my mind" and listed["status_history"][-1]["status"] == "CANCELLED"
    assert listed["outcome"] == "not_done"

    table = cli("calls", "list", "--session", "sess_a")
    assert table.exit_code == 0
    lines = table.stdout.splitlines()
    assert lines[0].split() == ["ID", "TOOL", "STATUS", "OUTCOME", "STEP", "SESSION", "CREATED", "(UTC)", "MS",
                                "CALLER"]
    assert [line.split()[:4] for line in lines[2:]] == [
        [cancelled.tool_call_id, "send_email", "CANCELLED", "not_done"],
        [first.tool_call_id, "send_email", "PENDING", "-"]]  # an open call has no outcome yet
    assert cli("calls", "list", "--session", "nobody").stdout == "No calls match.\n"


def test_list_says_when_its_limit_cut_the_list():
    made = [make_call(session_id="sess_cut") for _ in range(3)]
    note = ("The newest 2 calls; more match: raise --limit, or narrow with --status, --session, --tool "
            "or --since.")
    cut = cli("calls", "list", "--limit", "2")
    assert cut.exit_code == 0
    lines = cut.stdout.splitlines()
    assert lines[-1] == note and len([line for line in lines if line.startswith("tc_")]) == 2
    whole = cli("calls", "list", "--limit", "3")
    assert whole.exit_code == 0 and note.replace("2", "3", 1) not in whole.stdout and "more match" not in whole.stdout
    as_json = cli("calls", "list", "--limit", "2", "--json")
    assert len(json.loads(as_json.stdout)) == 2 and as_json.stderr.strip() == note  # stdout stays the JSON list
    assert "more match" not in cli("calls", "list", "--limit", "3", "--json").stderr
    assert {c["tool_call_id"] for c in cli_json("calls", "list")} == {c.tool_call_id for c in made}


def test_list_refuses_unknown_filters_naming_what_is_known():
    unknown = cli("calls", "list", "--tool", "launch_rockets")
    assert unknown.exit_code == 2 and "send_email" in unknown.stderr and "launch_rockets" in unknown.stderr
    assert cli("calls", "list", "--status", "DONE").exit_code == 2
    since = cli("calls", "list", "--since", "yesterday-ish")
    assert since.exit_code == 2 and "neither a duration" in since.stderr
    bad_session = cli("calls", "list", "--session", "no spaces allowed")
    assert bad_session.exit_code == 2 and "session_id" in bad_session.stderr


# -- calls show --------------------------------------------------------------------------------

def test_show_prints_both_histories_step_outputs_and_every_callback_attempt(client, worker, relay):
    answer = client.post("/voice-tools/pending", headers=AUTH, json={
        "session_id": "sess_show", "function": "send_email", "callback_url": relay.url,
        "parameters": {"to": "john@example.com", "subject": "Q3"}})
    tool_call_id = answer.get_json()["tool_call_id"]
    assert client.patch(f"/voice-tools/modify/{tool_call_id}", headers=AUTH,
                        json={"parameters": {"subject": "Q3 numbers"}}).status_code == 200
    assert client.post(f"/voice-tools/confirm/{tool_call_id}?wait=15", headers=AUTH).get_json()["status"] == "PREPARED"
    done = client.post(f"/voice-tools/resume/{tool_call_id}?wait=15", headers=AUTH, json={"action": "proceed"})
    assert done.get_json()["status"] == "COMPLETED"
    relay.wait_for(tool_call_id, "completed")
    call = row(tool_call_id)
    # an attempt's outcome is recorded once the link's work is done, just after the relay has it
    sent = [wait_delivered(d.event_id) for d in deliveries(tool_call_id)]

    shown = cli_json("calls", "show", tool_call_id)
    assert shown["status"] == "COMPLETED" and shown["parameters"]["subject"] == "Q3 numbers"
    assert shown["status_history"] == client.get(f"/voice-tools/status/{tool_call_id}", headers=AUTH) \
        .get_json()["status_history"]  # the API's own record
    assert [e["status"] for e in shown["status_history"]] == \
        ["PENDING", "MODIFIED", "PENDING", "EXECUTING", "PREPARED", "EXECUTING", "COMPLETED"]
    assert [(c["field"], c["old"], c["new"]) for c in shown["parameters_history"]] == [("subject", "Q3", "Q3 numbers")]
    assert shown["step_outputs"] == call.step_outputs and set(shown["step_outputs"]) >= {"PREPARING", "SENDING"}
    chain = [step.name for step in tools.TOOLS["send_email"].steps]
    assert list(shown["step_outputs"]) == [name for name in chain if name in call.step_outputs]  # the chain's order
    assert [(c["seq"], c["event"], c["state"], c["attempts"], len(c["attempt_log"])) for c in shown["callbacks"]] == \
        [(d.seq, d.event, "delivered", 1, 1) for d in sent]
    assert {"checkpoint", "completed"} <= {c["event"] for c in shown["callbacks"]}

    text = cli("calls", "show", tool_call_id)
    assert text.exit_code == 0
    out = text.stdout
    for heading in ("Status history", "Parameter changes", "Step outputs", "Result", "Callbacks", "Callback attempts"):
        assert f"\n{heading}\n" in out, heading
    assert out.count(" MODIFIED ") == 1 and "Q3 numbers" in out
    assert shown["outcome"] == "done" and any(line.split() == ["outcome", "done"] for line in out.splitlines())
    step_lines = out.split("\nStep outputs\n")[1].split("\n\n")[0].splitlines()[2:]
    assert [line.split()[0] for line in step_lines] == list(shown["step_outputs"])  # PREPARING before SENDING
    attempt_lines = out.split("\nCallback attempts\n")[1].splitlines()[2:]
    assert len(attempt_lines) == len(sent) and all(" 200 " in line for line in attempt_lines)


CONTROLS = "".join(chr(c) for c in (*range(0x00, 0x20), 0x7f, *range(0x80, 0xa0)))  # C0, DEL, C1


def test_a_stored_control_character_is_printed_escaped_by_show_list_and_cancel(client):
    """A row stored before the input rules held DEL and C1 (or written by another tool): the operator's
    terminal is shown each control character escaped, never raw, in tables and in JSON (read back whole)."""
    text = f"a{CONTROLS[1:]}\x1b[31mred"  # PostgreSQL stores no NUL
    call = make_call(session_id="sess_controls", parameters={"to": "john@example.com", "subject": "x"})
    with db.session() as s:
        s.execute(update(ToolCall).where(ToolCall.tool_call_id == call.tool_call_id).values(
            parameters={"to": "john@example.com", "subject": text}, voice_response=text, error_message=text))
    for args in (("calls", "show", call.tool_call_id), ("calls", "list", "--session", "sess_controls"),
                 ("calls", "show", call.tool_call_id, "--json"), ("calls", "list", "--session", "sess_controls", "--json")):
        printed = cli(*args)
        assert printed.exit_code == 0, printed.output
        raw = [c for c in printed.output if c in CONTROLS and c != "\n"]
        assert not raw, (args, sorted(set(raw)), printed.output[:2000])
    shown = cli_json("calls", "show", call.tool_call_id)
    assert shown["parameters"]["subject"] == text and shown["voice_response"] == text  # JSON escapes, the same text
    cancelled = cli("calls", "cancel", call.tool_call_id, "--reason", "stop")
    assert cancelled.exit_code == 0 and not [c for c in cancelled.output if c in CONTROLS and c != "\n"], \
        cancelled.output


def test_show_of_an_unknown_call_exits_3(client):
    missing = cli("calls", "show", "tc_000000000000")
    assert missing.exit_code == 3 and "No tool call tc_000000000000." in missing.stderr
    as_json = cli("calls", "show", "tc_000000000000", "--json")
    assert as_json.exit_code == 3
    assert json.loads(as_json.stdout) == client.get("/voice-tools/status/tc_000000000000", headers=AUTH).get_json()


# -- calls cancel ------------------------------------------------------------------------------

def test_cancel_follows_the_api_rules(client, relay):
    call = make_call(callback_url=relay.url)
    done = cli("calls", "cancel", call.tool_call_id, "--reason", "Operator stopped it")
    assert done.exit_code == 0, done.output
    assert done.stdout.startswith(f"{call.tool_call_id} CANCELLED: Operator stopped it")
    cancelled = row(call.tool_call_id)
    assert cancelled.status == "CANCELLED" and cancelled.error_message == "Operator stopped it"
    assert cancelled.status_history[-1]["reason"] == "Operator stopped it"
    assert [d.event for d in deliveries(call.tool_call_id)] == ["cancelled"]  # announced once, as the API does

    again = cli("calls", "cancel", call.tool_call_id)
    assert again.exit_code == 1
    assert again.stderr == "Refused (already_terminal): Cannot cancel: the call is already CANCELLED. Status: CANCELLED.\n"
    api = client.delete(f"/voice-tools/cancel/{call.tool_call_id}", headers=AUTH)
    as_json = cli("calls", "cancel", call.tool_call_id, "--json")
    assert as_json.exit_code == 1 and api.status_code == 409
    assert json.loads(as_json.stdout) == api.get_json()  # the same refusal, word for word

    committed = make_call(parameters={"to": "ann@example.com", "subject": "Contract"})
    _confirmed(committed.tool_call_id)
    with db.session() as s:
        assert lifecycle.commit_point(s, committed.tool_call_id, "SENDING") is not None
    late = cli("calls", "cancel", committed.tool_call_id)
    assert late.exit_code == 1
    assert late.stderr == ("Refused (too_late): Too late to cancel: the action is already under way."
                           " Status: EXECUTING.\n")
    assert row(committed.tool_call_id).status == "EXECUTING"  # nothing changed
    late_json = cli("calls", "cancel", committed.tool_call_id, "--json")
    assert json.loads(late_json.stdout) == \
        client.delete(f"/voice-tools/cancel/{committed.tool_call_id}", headers=AUTH).get_json()

    unknown = cli("calls", "cancel", "tc_000000000000")
    assert unknown.exit_code == 3 and "No tool call" in unknown.stderr
    too_long = cli("calls", "cancel", committed.tool_call_id, "--reason", "x" * 501)
    assert too_long.exit_code == 2 and "reason" in too_long.stderr  # the API's schema: at most 500


# -- calls stats -------------------------------------------------------------------------------

def _finish(tool_call_id: str, ms: int | None, ok: bool = True) -> None:
    """Run a call to its end through the lifecycle, then give it a known execution time."""
    _confirmed(tool_call_id)
    with db.session() as s:
        if ok:
            assert lifecycle.complete(s, tool_call_id, {"ok": True}, "Done.") is not None
        else:
            assert lifecycle.fail(s, tool_call_id, "Backend said no.", "Failed.") is not None
        if ms is not None:  # test data: the time the steps took is not ours to choose otherwise
            s.execute(update(ToolCall).where(ToolCall.tool_call_id == tool_call_id).values(execution_time_ms=ms))


def test_stats_per_tool_counts_rates_percentiles_and_callback_failures(relay, monkeypatch):
    for ms in (100, 200, 300, 400):
        _finish(make_call().tool_call_id, ms)
    _finish(make_call().tool_call_id, 5000, ok=False)  # failed: counts against the rate, not in the percentiles
    actions.cancel(make_call().tool_call_id)
    make_call()  # still PENDING: open
    _finish(make_call("create_task", {"title": "Call the bank"}).tool_call_id, 50)

    # one send_email event the relay refuses until its retries (1 here) are exhausted
    monkeypatch.setenv("VOICE_TOOLS_CALLBACK_MAX_ATTEMPTS", "1")
    relay.answer(lambda event: 500)
    refused = make_call(callback_url=relay.url)
    with db.session() as s:
        delivery = events.record(s, row(refused.tool_call_id), "progress", message="Working", inline=True)
    assert attempts.deliver_inline(delivery).delivered is False
    assert deliveries(refused.tool_call_id)[0].state == "failed"

    rows = {r["tool"]: r for r in cli_json("calls", "stats")}
    email = rows["send_email"]
    assert email["total"] == 8 and email["open"] == 2
    assert {k: v for k, v in email["by_status"].items() if v} == {"COMPLETED": 4, "FAILED": 1, "CANCELLED": 1,
                                                                  "PENDING": 2}
    assert email["success_rate"] == 0.8
    assert (email["p50_ms"], email["p95_ms"]) == (250, 385)  # percentile_cont over 100, 200, 300, 400
    assert (email["callbacks_failed"], email["callback_failed_attempts"]) == (1, 1)
    task = rows["create_task"]
    assert (task["total"], task["success_rate"], task["p50_ms"], task["callbacks_failed"]) == (1, 1.0, 50, 0)

    assert [r["tool"] for r in cli_json("calls", "stats", "--tool", "create_task")] == ["create_task"]
    assert cli_json("calls", "stats", "--since", (datetime.now(timezone.utc) + timedelta(minutes=1)).isoformat()) == []

    table = cli("calls", "stats")
    assert table.exit_code == 0
    email_line = next(line for line in table.stdout.splitlines() if line.startswith("send_email"))
    assert email_line.split() == ["send_email", "8", "4", "1", "1", "0", "2", "80.0%", "250", "385", "1", "1"]


# -- callbacks redeliver -----------------------------------------------------------------------

def test_redeliver_sends_a_failed_delivery_again_to_the_relay(worker, relay, monkeypatch):
    monkeypatch.setenv("VOICE_TOOLS_CALLBACK_MAX_ATTEMPTS", "1")
    relay.answer(lambda event: 503)  # the relay is down
    call = make_call(callback_url=relay.url)
    actions.cancel(call.tool_call_id, deliver_now=True)
    failed = deliveries(call.tool_call_id)[0]
    assert (failed.event, failed.state, failed.attempts) == ("cancelled", "failed", 1)
    other = make_call(parameters={"to": "ann@example.com", "subject": "Other"}, callback_url=relay.url)
    actions.cancel(other.tool_call_id, deliver_now=True)
    assert deliveries(other.tool_call_id)[0].state == "failed"

    relay.answer(lambda event: None)  # back up
    done = cli("callbacks", "redeliver", "--failed", "--call", call.tool_call_id)
    assert done.exit_code == 0, done.output
    assert done.stdout.splitlines()[-1] == "1 delivery queued on the callbacks queue."
    again = wait_delivered(failed.event_id)
    assert (again.state, again.attempts, again.response_code) == ("delivered", 2, 200)
    # the relay got the same event twice (refused with 503, then taken): same event_id, so it can drop a duplicate
    assert [(e["event"], e["event_id"]) for e in relay.events_for(call.tool_call_id)] == \
        [("cancelled", failed.event_id)] * 2
    assert [a["response_code"] for a in again.attempt_log] == [503, 200]
    assert deliveries(other.tool_call_id)[0].state == "failed"  # --call kept to that call

    queued = cli_json("callbacks", "redeliver", "--failed")
    assert [(q["tool_call_id"], q["was"]) for q in queued] == [(other.tool_call_id, "failed")]
    assert wait_delivered(queued[0]["event_id"]).state == "delivered"
    assert cli("callbacks", "redeliver", "--failed").stdout == "Nothing to redeliver.\n"
    assert len(relay.events_for(call.tool_call_id)) == 2 and len(relay.events_for(other.tool_call_id)) == 2


def test_redeliver_needs_a_selection_and_a_known_call():
    assert cli("callbacks", "redeliver").exit_code == 2
    unknown = cli("callbacks", "redeliver", "--call", "tc_000000000000")
    assert unknown.exit_code == 3


# -- a second terminal with no exports ------------------------------------------------------------

@pytest.mark.slow
def test_from_a_second_terminal_with_no_exports_it_joins_the_running_servers_and_leaves_them_up():
    """A process holds a data dir's servers (as ``voice-tools run`` does); ``celery -A tasks calls``
    run with only VOICE_TOOLS_DATA_DIR finds them, lists and cancels, and leaves them running."""
    with tempfile.TemporaryDirectory(prefix="voice-tools-cli-") as path:
        data_dir = Path(path)
        holder, urls = hold_servers(data_dir)
        try:
            migrate = voice_tools(data_dir, "migrate", stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            assert migrate.wait(timeout=180) == 0, migrate.stderr.read()
            before = server_answers(urls)
            made = subprocess.run(
                [sys.executable, "-c", "from tests.helpers import make_call; print(make_call().tool_call_id)"],
                cwd=ROOT, env=bare_env(DATABASE_URL=urls["DATABASE_URL"]), capture_output=True, text=True, timeout=120)
            assert made.returncode == 0, made.stderr
            tool_call_id = made.stdout.split()[-1]

            def terminal(*args: str) -> subprocess.CompletedProcess:
                return subprocess.run([sys.executable, "-c", RUN_CELERY, "-A", "tasks", *args], cwd=ROOT,
                                      env=bare_env(VOICE_TOOLS_DATA_DIR=str(data_dir)), capture_output=True,
                                      text=True, timeout=120)

            listed = terminal("calls", "list", "--json")
            assert listed.returncode == 0, listed.stderr
            assert _ids(json.loads(listed.stdout)) == [tool_call_id]
            cancelled = terminal("calls", "cancel", tool_call_id, "--reason", "From the second terminal")
            assert cancelled.returncode == 0, cancelled.stderr
            shown = json.loads(terminal("calls", "show", tool_call_id, "--json").stdout)
            assert (shown["status"], shown["error_message"]) == ("CANCELLED", "From the second terminal")
            assert server_answers(urls) == before  # the holder's PostgreSQL and Redis still answer
            from voice_tools import servers

            assert servers.redis_users(data_dir / "redis") == [holder.pid]
        finally:
            stop_process(holder)
        assert wait_none_running(data_dir) == []


def test_celerys_cli_loads_nothing_of_the_product_for_another_app(tmp_path):
    """Installing voice-tools adds its commands to Celery's CLI (the ``celery.commands`` entry
    points), so every ``celery`` command of every app in the environment loads them: that must
    import nothing of the product and connect none of its handlers to another app's signals."""
    other = tmp_path / "other_app.py"
    other.write_text("from celery import Celery\napp = Celery('other_app', broker='memory://')\n"
                     "@app.task\ndef add(x, y):\n    return x + y\n")
    probe = (
        "import sys\n"
        "import celery.bin.celery  # Celery's CLI, with every installed plug-in command\n"
        "import other_app\n"
        "from celery import signals\n"
        "ours = ('tasks', 'models', 'app', 'voice_tools_tracing')\n"
        "loaded = sorted({m.split('.')[0] for m in sys.modules if m.split('.')[0] in ours}\n"
        "                | {m for m in sys.modules if m.startswith('voice_tools_backends')})\n"
        "import weakref\n"
        "def target(ref):\n"
        "    return ref() if isinstance(ref, weakref.ReferenceType) else ref\n"
        "hooked = sorted({getattr(target(r[1]), '__module__', '?') for name in dir(signals)\n"
        "                 if name != 'user_preload_options'  # ours looks at the app: 'tasks' only\n"
        "                 for r in getattr(getattr(signals, name), 'receivers', None) or []})\n"
        "print(loaded, [h for h in hooked if h.split('.')[0] in ours + ('voice_tools',)])\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[] []", done.stdout
