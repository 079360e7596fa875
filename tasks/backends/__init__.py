"""Side effects and data sources of the tools. No Celery, no Flask: only ``models``.

A backend module that has a demo data set defines ``load_demo() -> int``: it adds
the rows it is missing (safe to run twice) and says how many it added.
``voice-tools load-demo`` runs them all; ``voice-tools run`` does on a database
that has never had a call.
"""
from __future__ import annotations

import importlib
import pkgutil


def load_demo() -> dict[str, int]:
    """Run every backend's ``load_demo``; ``{backend: rows added}``."""
    added: dict[str, int] = {}
    for module in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        loader = getattr(importlib.import_module(f"{__name__}.{module.name}"), "load_demo", None)
        if callable(loader):
            added[module.name] = int(loader() or 0)
    return added
