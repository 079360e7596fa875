"""The Flask API, from an app factory (``gunicorn 'app:create_app()'``, ``flask --app app``).

Blueprints, error handlers, auth and metrics are registered here, in one place.
"""
from __future__ import annotations

from typing import Any

from flask import Flask

MAX_BODY_BYTES = 256 * 1024


def create_app(config: dict[str, Any] | None = None) -> Flask:
    from app import api, auth, errors, metrics, ops

    app = Flask(__name__, static_folder=None)
    app.config.update(MAX_CONTENT_LENGTH=MAX_BODY_BYTES, JSON_SORT_KEYS=False)
    app.config.update(config or {})
    app.json.sort_keys = False  # type: ignore[attr-defined]
    metrics.register(app)  # first, so refused requests are counted and timed too
    auth.register(app)
    errors.register(app)
    app.register_blueprint(api.bp)
    app.register_blueprint(ops.bp)
    return app
