"""One engine per process and the session factory.

The engine is made lazily, so a forked Celery child or gunicorn worker makes its
own after the fork (see ``dispose``, called from ``worker_process_init``).
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Callable, Iterator

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.orm import Session, sessionmaker

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


def engine() -> Engine:
    global _engine, _factory
    if _engine is None:
        _engine = create_engine(
            database_url(),
            pool_size=int(os.environ.get("VOICE_TOOLS_DB_POOL_SIZE", "10")),
            max_overflow=20,
            pool_pre_ping=True,
            pool_recycle=1800,
        )
        _factory = sessionmaker(_engine, expire_on_commit=False)
    return _engine


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
