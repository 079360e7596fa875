"""A ``before_request`` hook: on a database schema older than this release needs, every request but
``/healthz`` and ``/readyz`` is answered 503 (``models/schema.py``; ``/readyz`` says why itself)."""
from __future__ import annotations

from flask import Flask, request

from models import schema

OPEN_PATHS = frozenset({"/healthz", "/readyz"})


def register(app: Flask) -> None:
    try:  # at start: one line if the schema does not fit (a database that does not answer is /readyz's to say)
        schema.GATE.verdict()
    except Exception:
        pass

    @app.before_request
    def _schema_fits() -> None:
        if not schema.GATE.passed and request.path not in OPEN_PATHS:
            schema.GATE.require()  # SchemaTooOld: a 503 naming the revision found, the one needed, the command
