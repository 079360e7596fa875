"""``voice-tools migrate``: the database's schema brought to this release's, under running processes.

- ``voice-tools migrate`` runs what this release's migrations have that the database has not (Alembic's
  ``upgrade head``). Each migration waits at most a bounded time for its locks (``migrations/env.py``);
  one that timed out is run again after a pause, up to :data:`LOCK_TRIES` times. On a database newer
  than this release knows it runs nothing and says so (this release still runs on it).
- ``voice-tools migrate --check`` changes nothing: it says the revision found, what this release runs
  on, each migration that would run and what it is to the previous release's running processes
  (``running_release`` in the migration: ``safe``, or ``restart``: restart them right after it), and
  exits 1 when the schema is too old for this release.
- ``voice-tools migrate --to REVISION`` goes to an older revision (a rollback, after the code went
  back): every downgrade here keeps the data (a column or table the older release does not use stays).
"""
from __future__ import annotations

import argparse
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Alembic's scripts: in a checkout a link to the top-level migrations/, in the wheel the files.
MIGRATIONS = Path(__file__).parent / "migrations"
LOCK_TRIES = 30  # a migration that met a lock held longer than its lock_timeout, run again (~1 minute in all)
LOCK_PAUSE_S = 2.0
LOCK_NOT_AVAILABLE = "55P03"

log = logging.getLogger(__name__)


def alembic_config() -> Any:
    """Alembic's configuration, made here (no ini file): the scripts shipped with this package."""
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    config.set_main_option("path_separator", "os")
    return config


@dataclass(frozen=True)
class Step:
    """One migration that would run."""

    revision: str
    title: str
    running_release: str  # "safe" under the previous release's processes, or "restart" them after it
    why: str

    def line(self) -> str:
        said = ("safe under running processes" if self.running_release == "safe"
                else "NOT safe under the previous release's running processes: restart them right after it")
        return f"  {self.revision}  {self.title}\n        {said} ({self.why})"


def steps(found: str | None) -> list[Step]:
    """This release's migrations after revision ``found`` (every one of them when None), oldest first."""
    from alembic.script import ScriptDirectory

    scripts = ScriptDirectory.from_config(alembic_config())
    pending = list(scripts.iterate_revisions("heads", found or "base"))
    pending.reverse()
    return [Step(s.revision, (s.doc or "").strip().splitlines()[0] if s.doc else "",
                 getattr(s.module, "running_release", "safe"),
                 getattr(s.module, "running_release_why", "part of the first release"))
            for s in pending if s.revision != found]


def found_revision() -> str | None:
    from models import db, schema

    with db.engine().connect() as conn:
        return schema.revision(conn)


def migrate(revision: str = "head") -> None:
    """Bring the database to this release's ``revision`` (its head); nothing on a newer database."""
    from alembic import command
    from sqlalchemy.exc import OperationalError

    from models import schema

    found = schema.Verdict(found_revision())
    if found.newer:
        print(f"voice-tools migrate: {found.line()}; nothing to run", flush=True)
        return
    for tried in range(1, LOCK_TRIES + 1):
        try:
            command.upgrade(alembic_config(), revision)
            return
        except OperationalError as exc:
            if getattr(exc.orig, "pgcode", None) != LOCK_NOT_AVAILABLE or tried == LOCK_TRIES:
                raise
            log.warning("a migration waited past its lock_timeout for a lock the running processes hold "
                        "(try %d of %d); it runs again in %.0f s", tried, LOCK_TRIES, LOCK_PAUSE_S)
            time.sleep(LOCK_PAUSE_S)


def downgrade(revision: str) -> None:
    from alembic import command

    command.downgrade(alembic_config(), revision)


def check() -> int:
    """What ``migrate`` would do, changing nothing; 1 when the schema is too old for this release."""
    from models import schema

    verdict = schema.Verdict(found_revision())
    print(verdict.line())
    if verdict.newer:
        print("nothing to run: this release's migrations are all in the database")
        return 0
    pending = steps(verdict.found)
    if pending:
        print(f"`voice-tools migrate` would run {len(pending)} migration(s):")
        for step in pending:
            print(step.line())
    else:
        print("nothing to run: the database is at this release's newest revision")
    return 1 if verdict.too_old else 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="voice-tools migrate",
                                     description="Migrate the database to this release's schema.")
    parser.add_argument("--check", action="store_true",
                        help="change nothing: say what would run and whether each migration is safe under running "
                             "processes; exit 1 when the schema is too old for this release")
    parser.add_argument("--to", metavar="REVISION",
                        help="go down to an older REVISION (a rollback, once the older release's code runs): "
                             "every downgrade keeps the data")
    args = parser.parse_args(argv)
    if args.check:
        return check()
    if args.to:
        downgrade(args.to)
        print(f"voice-tools migrate: the database is at revision {found_revision()}", flush=True)
        return 0
    migrate()
    return 0
