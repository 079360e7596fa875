"""Every migration read for the rules an upgrade under running processes needs (``docs/operations.md``,
"Upgrading"; ``docs/contributing.md``, "Writing a migration").

- Revision ids are numbers in order, one chain: any release tells an older schema from a newer one.
- Each migration after the first release says what it is to the previous release's running processes
  (``running_release``: ``safe``, or ``restart``) and why; from this release on, every one is ``safe``.
- A ``safe`` migration only expands: new tables, nullable or defaulted columns, indexes built
  concurrently; no drop, no rename, no change of a column's type, no rewrite of ``tool_calls`` or
  its events. Every downgrade after the first release keeps the data (it says so) or refuses.
- CHANGELOG.md's section of each release lists its migrations, each as safe or not.
- ``voice-tools migrate`` waits at most its ``lock_timeout`` behind a lock and runs the migration again.
"""
from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from sqlalchemy import text

from models import db, schema

ROOT = Path(__file__).resolve().parent.parent
VERSIONS = ROOT / "migrations" / "versions"
FIRST_RELEASE_HEAD = "0017"  # 0.1.0's newest: the migrations after it ran under a running release
RESTART_ALLOWED = {"0020"}  # the one migration of 0.2.0 that 0.1.0's processes must be restarted after
# what an expanding migration never does, in its upgrade
FORBIDDEN_OPS = {"drop_column", "drop_table", "rename_table", "drop_constraint", "execute_rename"}
FORBIDDEN_SQL = re.compile(r"\b(DROP\s+(TABLE|COLUMN)|RENAME\b|ALTER\s+COLUMN\s+\w+\s+(SET\s+DATA\s+)?TYPE|"
                           r"VACUUM\s+FULL|CLUSTER\b|SET\s+NOT\s+NULL)", re.I)


def migrations() -> list[tuple[Path, ast.Module, dict[str, object]]]:
    found = []
    for path in sorted(VERSIONS.glob("[0-9]*.py")):
        tree = ast.parse(path.read_text(), str(path))
        values = {node.targets[0].id: ast.literal_eval(node.value) for node in tree.body
                  if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                  and isinstance(node.value, ast.Constant)}
        found.append((path, tree, values))
    return found


def function(tree: ast.Module, name: str) -> ast.FunctionDef:
    return next(node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == name)


def after_first_release():
    return [m for m in migrations() if int(m[2]["revision"]) > int(FIRST_RELEASE_HEAD)]


def test_revisions_are_numbers_in_one_chain():
    previous = None
    for path, _tree, values in migrations():
        revision = values["revision"]
        assert re.fullmatch(r"\d{4}", revision) and path.name.startswith(f"{revision}_"), path.name
        assert values["down_revision"] == previous, (path.name, values["down_revision"], previous)
        assert previous is None or int(revision) > int(previous)
        previous = revision
    assert previous == schema.NEWEST


def test_each_migration_after_the_first_release_says_what_it_is_to_running_processes():
    for path, _tree, values in after_first_release():
        assert values.get("running_release") in ("safe", "restart"), path.name
        assert len(str(values.get("running_release_why", ""))) > 20, path.name
        if values["running_release"] == "restart":
            assert values["revision"] in RESTART_ALLOWED, \
                f"{path.name}: from this release on every migration runs under the previous release's processes"


def _calls(function_node: ast.FunctionDef) -> list[ast.Call]:
    return [node for node in ast.walk(function_node) if isinstance(node, ast.Call)]


def _op(call: ast.Call) -> str | None:
    target = call.func
    if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "op":
        return target.attr
    return None


def _keywords(call: ast.Call) -> dict[str, object]:
    return {k.arg: (ast.literal_eval(k.value) if isinstance(k.value, ast.Constant) else k.value) for k in call.keywords}


def unsafe_steps(upgrade: ast.FunctionDef) -> list[str]:
    """What in an upgrade would break the previous release's processes or hold the table."""
    found = []
    for call in _calls(upgrade):
        name, kw = _op(call), _keywords(call)
        if name in FORBIDDEN_OPS:
            found.append(name)
        if name == "alter_column" and ({"type_", "new_column_name"} & set(kw) or kw.get("nullable") is False):
            found.append("alter_column changes a column the previous release uses")
        if name == "create_index" and kw.get("postgresql_concurrently") is not True:
            found.append("create_index not built concurrently")
        if name == "add_column":
            column = next((a for a in call.args if isinstance(a, ast.Call)), None)
            col_kw = _keywords(column) if column is not None else {}
            if col_kw.get("nullable") is False and "server_default" not in col_kw:
                found.append("add_column NOT NULL without a default (a rewrite, and the old inserts fail)")
        for arg in call.args:
            if name == "execute" and isinstance(arg, ast.Constant) and FORBIDDEN_SQL.search(str(arg.value)):
                found.append(f"execute: {FORBIDDEN_SQL.search(str(arg.value)).group(0)}")
            if name == "execute" and isinstance(arg, ast.Name):
                pass  # a module constant: read below
    return found


def test_safe_migrations_only_expand_and_every_downgrade_keeps_the_data_or_refuses():
    for path, tree, values in after_first_release():
        constants = " ".join(str(v) for v in values.values() if isinstance(v, str))
        if values["running_release"] == "safe":
            assert unsafe_steps(function(tree, "upgrade")) == [], path.name
            assert not FORBIDDEN_SQL.search(constants), (path.name, FORBIDDEN_SQL.search(constants).group(0))
        downgrade = function(tree, "downgrade")
        said = ast.get_docstring(downgrade) or ""
        refuses = any(isinstance(node, ast.Raise) for node in ast.walk(downgrade))
        assert said.startswith("Keeps the data") or refuses, f"{path.name}: its downgrade says neither"
        if not refuses:
            dropped = [_op(c) for c in _calls(downgrade) if _op(c) in ("drop_column", "drop_table")]
            assert dropped == [], (path.name, dropped)


def test_the_changelog_lists_each_releases_migrations_as_safe_or_not():
    changelog = (ROOT / "CHANGELOG.md").read_text()
    listed = dict(re.findall(r"^- `(\d{4})` .*?\b(safe under running processes|restart)\b", changelog, re.M))
    for path, _tree, values in after_first_release():
        assert values["revision"] in listed, f"{path.name} is in no release's section of CHANGELOG.md"
        assert (listed[values["revision"]] == "restart") == (values["running_release"] == "restart"), path.name


@pytest.mark.slow
def test_a_migration_waits_at_most_its_lock_timeout_behind_a_lock_and_runs_again():
    """A transaction holding ``tool_calls`` (as a long read of the running processes would) makes the
    migration's ALTER wait: past ``lock_timeout`` it gives up its place in the queue (so the running
    processes' statements are not queued behind it), and ``voice-tools migrate`` runs it again once
    the lock is free."""
    with db.session() as s:
        s.execute(text("UPDATE alembic_version SET version_num = '0021'"))  # 0022 to run again (it finds its column)
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with db.session() as s:
            s.execute(text("LOCK TABLE tool_calls IN ACCESS SHARE MODE"))
            held.set()
            release.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    migrating = None
    try:
        assert held.wait(10)
        env = dict(os.environ, VOICE_TOOLS_MIGRATION_LOCK_TIMEOUT_MS="300")
        migrating = subprocess.Popen([sys.executable, "-m", "voice_tools", "migrate"], cwd=ROOT, env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 20
        while True:  # the migration waits for the lock (each read its own transaction: a fresh snapshot)
            with db.statement() as s:
                waiting = s.execute(text("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                                         "AND query ILIKE 'ALTER TABLE tool_calls%'")).scalar()
            if waiting or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert waiting, "the migration never waited for the lock"
        time.sleep(1.5)  # several lock timeouts
        assert migrating.poll() is None, migrating.communicate()[0]  # still trying
        release.set()
        out, _ = migrating.communicate(timeout=60)
        assert migrating.returncode == 0, out
        assert "waited past its lock_timeout" in out, out
    finally:
        release.set()
        holder.join(30)
        if migrating is not None and migrating.poll() is None:
            migrating.communicate(timeout=60)
        with db.session() as s:
            assert s.execute(text("SELECT version_num FROM alembic_version")).scalar() == schema.NEWEST
