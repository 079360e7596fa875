"""Side effects and data sources of the tools. No Celery, no Flask: only ``models``.

A backend raises :class:`Refused` for what retrying will not fix and :class:`Unavailable` for
what it may (429, 5xx and timeouts from a client library are recognised as they are);
the engine in ``tasks/chains.py`` turns them into a failed call or a retry, so tools need
not translate them.

A local backend's rows belong to a caller (``owner``: the token name of the call that
wrote them) or to the shared set (``SHARED``, ''), which every caller sees; a read sees
:func:`seen_by` its caller only (docs/promises.md, Callers).

A backend module that has a demo data set defines ``load_demo() -> int``: it adds
the rows it is missing (safe to run twice) and says how many it added; the demo set
is shared. ``voice-tools load-demo`` runs them all; ``voice-tools run`` does on a
database that has never had a call.
"""
from __future__ import annotations

import importlib
import pkgutil
from typing import Any

SHARED = ""  # the owner of the rows every caller sees (the demo data set)


def seen_by(owner: Any, caller: str | None) -> Any:
    """The condition on an ``owner`` column that a read for ``caller`` keeps: its own rows and the shared ones
    (a call without a caller, '', sees the shared rows alone)."""
    return owner.in_(sorted({caller or SHARED, SHARED}))


class Refused(Exception):
    """The backend's service refused the request (or the credentials are unusable): retrying will
    not help, and nothing was done by it. The engine fails the call with this message."""


class Unavailable(Exception):
    """A failure worth retrying that the HTTP status alone does not say (a 403 rate limit, a lost
    connection): the engine retries the step with backoff."""


class Unconfirmed(Exception):
    """The service's answers leave it unknown whether the effect happened (an earlier attempt
    may have acted and nothing shows that it did or did not): the engine ends the call FAILED
    with the outcome "unconfirmed" and the tool's unconfirmed sentence, never "not sent"."""


def load_demo() -> dict[str, int]:
    """Run every backend's ``load_demo``; ``{backend: rows added}``."""
    added: dict[str, int] = {}
    for module in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        loader = getattr(importlib.import_module(f"{__name__}.{module.name}"), "load_demo", None)
        if callable(loader):
            added[module.name] = int(loader() or 0)
    return added
