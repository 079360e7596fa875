"""The Flask API, from an app factory (``gunicorn 'app:create_app()'``, ``flask --app app``).

Blueprints, error handlers, auth and metrics are registered here, in one place.
The API's one route table is registered twice: at the root and under ``/webhook``
(the paths of the original n8n workflows), so a relay moving off n8n changes only its
base URL and adds its token (docs/relay-guide.md, 'The legacy aliases and the `/webhook` paths').
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # Flask is imported by create_app: gunicorn's master reads app.gunicorn_conf only (~8 MB less)
    from flask import Flask

from app.limits import MAX_BODY_BYTES

N8N_PREFIX = "/webhook"


def create_app(config: dict[str, Any] | None = None) -> Flask:
    from app import server_spans as tracing  # first: with tracing off, redis-py will not load the SDK (voice_tools_tracing/)
    from flask import Flask

    from app import (api, auth, console, errors, health, inputs, metrics, request_log, schema_gate, share_hooks,
                     stream)

    app = Flask(__name__, static_folder=None)
    # no automatic OPTIONS answer (an empty text/html 200): OPTIONS is a JSON 405 naming the methods
    app.config.update(MAX_CONTENT_LENGTH=MAX_BODY_BYTES, JSON_SORT_KEYS=False, PROVIDE_AUTOMATIC_OPTIONS=False)
    app.config.update(config or {})
    app.json.sort_keys = False  # type: ignore[attr-defined]
    request_log.register(app)  # first: a refused request has its id and context too
    tracing.register(app)  # a server span per request, with OTEL_EXPORTER_OTLP_ENDPOINT set (app/server_spans.py)
    metrics.register(app)  # then, so refused requests are counted and timed too
    auth.register(app)
    schema_gate.register(app)  # after the token: on a schema too old for this release, a 503 naming it
    share_hooks.register(app)  # after the token: each caller's rate and open share (app/shares.py)
    errors.register(app)
    inputs.register(app)  # an answer that leaves the body unread closes the connection
    app.register_blueprint(api.bp)
    app.register_blueprint(api.bp, name="n8n", url_prefix=N8N_PREFIX)  # the same table, n8n's paths
    app.add_url_rule(f"{N8N_PREFIX}/resume-execution/<tool_call_id>", endpoint="n8n.resume_execution",
                     view_func=api.resume, methods=["POST"])  # the n8n workflows' resume_webhook
    app.register_blueprint(stream.bp)
    app.register_blueprint(health.bp)
    console.register(app)  # the operator console at /console (app/console/)
    return app
