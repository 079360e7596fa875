"""One engine per process and the session factory.

The engine is made lazily, so a forked Celery child or gunicorn worker makes its
own after the fork (see ``dispose``, called from ``worker_process_init``).

Round trips are what a link and a request pay for, so: :func:`statement` runs one
statement as its own transaction (autocommit: no ``BEGIN``, no ``COMMIT``, one round
trip); and a pooled connection is pinged before use only when it has lain idle for
``IDLE_PING_S`` (one that served a statement a moment ago is alive; after a database
restart the first error invalidates the whole pool, and an idle one is pinged).
"""
from __future__ import annotations

import os
import time
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Callable, Iterator

from sqlalchemy import Connection, Engine, create_engine, event, exc
from sqlalchemy.orm import Session, sessionmaker

Executor = Session | Connection  # what a statement runs on: a session, or db.statement()'s connection

_engine: Engine | None = None
_factory: sessionmaker[Session] | None = None
_current: ContextVar[Session | None] = ContextVar("voice_tools_session", default=None)


def database_url() -> str:
    url = os.environ.get("DATABASE_URL", "")
    if not url:
        raise RuntimeError("DATABASE_URL is not set (servers.ensure_servers() sets it for the embedded server)")
    for prefix in ("postgres://", "postgresql://"):
        if url.startswith(prefix):  # SQLAlchemy 2.1 would pick psycopg 3; we ship psycopg2
            url = "postgresql+psycopg2://" + url[len(prefix):]
    return url


def listen_url() -> str:
    """The libpq URL of the LISTEN connection (``models/listen.py``): ``DATABASE_LISTEN_URL``, else
    ``DATABASE_URL``. Every other connection uses ``DATABASE_URL``, which may name a PgBouncer in
    transaction mode; LISTEN holds session state, so it needs a direct connection to PostgreSQL
    (or a session-mode pool)."""
    url = os.environ.get("DATABASE_LISTEN_URL", "").strip() or database_url()
    for prefix in ("postgresql+psycopg2://", "postgres://"):
        if url.startswith(prefix):
            url = "postgresql://" + url[len(prefix):]
    return url


def engine() -> Engine:
    global _engine, _factory
    if _engine is None:
        _engine = _new_engine(pool_size=int(os.environ.get("VOICE_TOOLS_DB_POOL_SIZE", "10")))
        _factory = sessionmaker(_engine, expire_on_commit=False)
    return _engine


def _new_engine(pool_size: int, **connect_args: Any) -> Engine:
    made = create_engine(database_url(), pool_size=pool_size, max_overflow=20, pool_recycle=1800,
                         connect_args=connect_args)
    _ping_when_idle(made)
    _given_up_when_gone(made)
    event.listen(made, "handle_error", _refused_plan_is_transient)
    return made


# PostgreSQL's answer to a prepared statement whose result's columns changed type since it was
# prepared (a migration under a running process): feature_not_supported, with this message
REFUSED_PLAN_CODE, REFUSED_PLAN_MESSAGE = "0A000", "cached plan must not change result type"


class PlanRefused(exc.OperationalError):
    """PostgreSQL refused a statement prepared before a schema change (``cached plan must not change
    result type``): nothing ran, and the statement runs once prepared again. An ``OperationalError``, as
    a lost connection is: a task runs again later, the API answers 503 (``models/compiled.py`` prepares
    its own statements again at once, so this reaches a caller only from a statement prepared elsewhere)."""


def plan_refused(error: BaseException) -> bool:
    """Is ``error`` (the driver's) PostgreSQL refusing a plan prepared before a schema change?"""
    return (getattr(error, "pgcode", None) == REFUSED_PLAN_CODE
            and str(error).lstrip().startswith(REFUSED_PLAN_MESSAGE))


def _refused_plan_is_transient(context: Any) -> BaseException | None:
    """SQLAlchemy's ``handle_error`` hook: a refused plan is raised as :class:`PlanRefused`."""
    if not plan_refused(context.original_exception):
        return None
    return PlanRefused(context.statement, context.parameters, context.original_exception,
                       hide_parameters=context.engine.hide_parameters if context.engine else False)


DEAD_CLIENT_S = 60  # VOICE_TOOLS_DB_DEAD_CLIENT_S's default


def dead_client_settings(after_s: int) -> dict[str, int]:
    """The server's settings for this session that make it give up a client it has not heard from for
    about ``after_s`` seconds: TCP keepalives (the first probe after half of it idle, then three probes
    a sixth of it apart) and ``tcp_user_timeout`` (data it sent unacknowledged that long)."""
    return {"tcp_keepalives_idle": max(1, after_s // 2), "tcp_keepalives_interval": max(1, after_s // 6),
            "tcp_keepalives_count": 3, "tcp_user_timeout": after_s * 1000}


def _given_up_when_gone(engine: Engine) -> None:
    """Each new connection asks the server to give up this client once it stops answering
    (``VOICE_TOOLS_DB_DEAD_CLIENT_S``, 60; 0: the server's own settings). A host that vanishes in the
    middle of a transaction (its link down, its power gone) sends no FIN and no RST: without this, its
    backend keeps the transaction open, and the rows it locked, until the kernel gives the connection up
    (two hours and more by default), and every statement that needs those rows (a link's next run, the
    stuck-call sweep) waits as long. A live client is never given up however long its transaction stays
    quiet: its host answers the keepalives. One round trip per connection the pool opens; on a Unix
    socket the server ignores them."""
    after_s = int(os.environ.get("VOICE_TOOLS_DB_DEAD_CLIENT_S", str(DEAD_CLIENT_S)))
    if after_s <= 0:
        return
    statement = "; ".join(f"SET {name} = {value}" for name, value in dead_client_settings(after_s).items())

    @event.listens_for(engine, "connect")
    def _connected(dbapi_connection: Any, record: Any) -> None:
        with dbapi_connection.cursor() as cursor:
            cursor.execute(statement)
        if not dbapi_connection.autocommit:
            dbapi_connection.commit()  # psycopg2 opened a transaction for the SETs: end it (they stay)


IDLE_PING_S = 2.0
_LAST_USED = "voice_tools_last_used"


def _ping_when_idle(engine: Engine) -> None:
    """Pessimistic disconnect handling (SQLAlchemy's pool ``checkout`` recipe), only for a
    connection idle for ``IDLE_PING_S`` or more: a dead one is replaced before use."""

    @event.listens_for(engine.pool, "checkout")
    def _checkout(dbapi_connection: Any, record: Any, proxy: Any) -> None:
        last = record.info.get(_LAST_USED)
        if last is not None and time.monotonic() - last < IDLE_PING_S:
            return
        try:
            engine.dialect.do_ping(dbapi_connection)
        except Exception as error:
            raise exc.DisconnectionError(str(error)) from error

    @event.listens_for(engine.pool, "connect")
    @event.listens_for(engine.pool, "checkin")
    def _used(dbapi_connection: Any, record: Any) -> None:
        record.info[_LAST_USED] = time.monotonic()


def dispose() -> None:
    """Forget this process's engine (after a fork, or when DATABASE_URL changes)."""
    global _engine, _factory
    if _engine is not None:
        _engine.dispose(close=False)
    _engine = None
    _factory = None


@contextmanager
def session() -> Iterator[Session]:
    """A session whose transaction commits on success and rolls back on error."""
    engine()
    assert _factory is not None
    with _factory() as s, s.begin():
        token = _current.set(s)
        try:
            yield s
        finally:
            _current.reset(token)


def current() -> Session | None:
    """The session of the innermost :func:`session` block open in this thread, if any."""
    return _current.get()


def after_commit(s: Session, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    """Call ``fn(*args, **kwargs)`` once ``s``'s transaction has committed; never if it rolls back."""
    s.info.setdefault("after_commit", []).append((fn, args, kwargs))


@event.listens_for(Session, "after_commit")
def _run_after_commit(s: Session) -> None:
    for fn, args, kwargs in s.info.pop("after_commit", ()):
        fn(*args, **kwargs)


@event.listens_for(Session, "after_rollback")
def _forget_after_commit(s: Session) -> None:
    s.info.pop("after_commit", None)


@contextmanager
def statement() -> Iterator[Connection]:
    """A connection whose every statement is its own transaction (autocommit): for the hot
    paths, where one statement (a compare-and-set, a data-modifying CTE) is the whole work.

    psycopg2's own ``autocommit`` switch, not SQLAlchemy's ``AUTOCOMMIT`` isolation level:
    that one makes psycopg2 send a ``SET default_transaction_isolation`` each time (a round
    trip). SQLAlchemy's begin and rollback around it are then no-ops at the driver.
    """
    with engine().connect() as conn:
        raw = conn.connection.dbapi_connection
        raw.autocommit = True
        try:
            yield conn
        finally:
            if not raw.closed:
                raw.autocommit = False
