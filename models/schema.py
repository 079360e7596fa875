"""The schema revisions this release runs on, and the check every process makes of the database's.

A release's code needs the tables and columns of its migrations up to :data:`OLDEST`; it knows the
migrations up to :data:`NEWEST` (its head). Migrations only expand a schema for the release that
adds them (new tables, nullable or defaulted columns, indexes built concurrently; ``docs/operations.md``,
"Upgrading"), so a schema newer than a release knows still serves that release: the previous
release's processes keep running while the next release's migrations are applied under them.

Revision ids are numbers in order (``0001``, ``0002``, ...; ``tests/test_migrations.py`` holds every
migration to it), so any release can tell an older schema from a newer one, even one whose
migrations it has never seen.

Every process checks at start and the API in ``/readyz``: on a schema older than :data:`OLDEST` the API
answers 503 and a worker consumes nothing, each logging :func:`Verdict.line` (the revision found, the
one needed, the command that migrates), until the database is migrated.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from sqlalchemy import Connection, text

from models import db

log = logging.getLogger(__name__)

OLDEST = "0022"  # the oldest schema this release's code runs on
NEWEST = "0022"  # the newest this release knows: its own migrations' head
MIGRATE_COMMAND = "voice-tools migrate"


@dataclass(frozen=True)
class Verdict:
    """What the database's schema is to this release."""

    found: str | None  # the database's revision (None: never migrated)

    @property
    def too_old(self) -> bool:
        return self.found is None or _number(self.found) < _number(OLDEST)

    @property
    def newer(self) -> bool:
        """Newer than this release knows: it still runs on it (migrations only expand)."""
        return self.found is not None and _number(self.found) > _number(NEWEST)

    def line(self) -> str:
        """One line for an operator: what was found, what this release needs, what to do."""
        found = f"revision {self.found}" if self.found else "no revision (never migrated)"
        if self.too_old:
            return (f"the database schema is at {found}; this release needs revision {OLDEST} or newer: "
                    f"run `{MIGRATE_COMMAND}` (nothing is served until then)")
        if self.newer:
            return (f"the database schema is at {found}, newer than this release knows ({NEWEST}): it runs on "
                    f"it, as the previous release does during an upgrade; upgrade this process")
        return f"the database schema is at {found}; this release runs on {OLDEST} to {NEWEST}"


def _number(revision: str) -> int:
    try:
        return int(revision)
    except ValueError:  # not one of ours: never taken for new enough
        return -1


def revision(conn: Connection) -> str | None:
    """The database's revision (Alembic's ``alembic_version``), None when it has none."""
    found = conn.execute(text("SELECT to_regclass('alembic_version') IS NOT NULL")).scalar()
    if not found:
        return None
    return conn.execute(text("SELECT version_num FROM alembic_version LIMIT 1")).scalar()


def verdict(conn: Connection) -> Verdict:
    return Verdict(revision(conn))


class SchemaTooOld(Exception):
    """This process may not serve: the database's schema is older than this release needs (a 503)."""

    def __init__(self, verdict: Verdict):
        super().__init__(verdict.line())
        self.verdict = verdict


class Gate:
    """A process's answer to "may I serve?": read from the database at most every ``every_s`` while the
    schema is too old; once it is new enough, never read again (a schema is not migrated backwards
    under a running release: to roll back, the code goes first)."""

    def __init__(self, every_s: float = 2.0):
        self.every_s = every_s
        self.passed = False
        self.last: Verdict | None = None
        self._checked_at = float("-inf")
        self._lock = threading.Lock()

    def verdict(self) -> Verdict | None:
        """None when the process may serve; else the verdict that says why not."""
        if self.passed:
            return None
        with self._lock:
            now = time.monotonic()
            if self.last is None or now - self._checked_at >= self.every_s:
                with db.engine().connect() as conn:
                    found = verdict(conn)
                if found.too_old and found != self.last:
                    log.error("%s", found.line())
                elif not found.too_old and found.newer:
                    log.warning("%s", found.line())
                self.last, self._checked_at = found, now
                self.passed = not found.too_old
        return None if self.passed else self.last

    def require(self) -> None:
        """Raise :class:`SchemaTooOld` unless the process may serve (a database that does not answer
        raises its own error: a 503 too)."""
        found = self.verdict()
        if found is not None:
            raise SchemaTooOld(found)


GATE = Gate()  # this process's
