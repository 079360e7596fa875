"""Operations endpoints: liveness, readiness, metrics and the OpenAPI document."""
from __future__ import annotations

from flask import Blueprint, current_app, jsonify
from sqlalchemy import text

from app import metrics, openapi
from tasks.calls import schemas
from app.openapi import doc
from models import db, release, schema
from tasks.celery_app import app as celery_app  # the broker: no task module, nor the workers' callbacks' HTTP

bp = Blueprint("ops", __name__)


def database_error() -> str | None:
    try:
        with db.engine().connect() as conn:
            conn.execute(text("SELECT 1"))
    except Exception as exc:  # any failure means "not ready"
        return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"[:300]
    return None


def broker_error() -> str | None:
    try:
        with celery_app.connection_for_write() as conn:
            conn.ensure_connection(max_retries=1, interval_start=0, interval_step=0, timeout=2)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"[:300]
    return None


@bp.get("/healthz")
@doc("Liveness (no token needed)", tag="meta", responses={200: schemas.HealthAnswer}, public=True)
def healthz():
    return schemas.HealthAnswer().dump({"status": "ok", "version": release.VERSION}), 200


@bp.get("/readyz")
@doc("Readiness: the database and the broker answer", tag="meta", responses={200: schemas.ReadyAnswer})
def readyz():
    problems = {name: error for name, error in (("database", database_error()), ("broker", broker_error())) if error}
    if "database" not in problems:
        try:
            found = schema.GATE.verdict()
        except Exception as exc:  # the database went away since
            problems["database"] = f"{type(exc).__name__}: {exc}"[:300]
        else:
            if found is not None:
                return jsonify(error="unavailable", message=f"Not ready: {found.line()}.",
                               details={"down": ["database"], "reasons": {"database": "schema"},
                                        "schema": {"found": found.found, "needed": schema.OLDEST}}), 503
    if problems:
        down = " and ".join(sorted(problems))
        return jsonify(error="unavailable", message=f"Not ready: the {down} is unavailable.",
                       details={"down": sorted(problems), "reasons": problems}), 503
    return schemas.ReadyAnswer().dump({"status": "ready", "checks": {"database": "ok", "broker": "ok"}}), 200


@bp.get("/metrics")
@doc("Prometheus metrics", tag="meta", responses={200: "Prometheus text format"})
def metrics_text():
    return metrics.render()


@bp.get("/openapi.json")
@doc("This API's OpenAPI document", tag="meta", responses={200: "The OpenAPI 3 document"})
def openapi_json():
    document = current_app.extensions.get("openapi")
    if document is None:
        document = current_app.extensions["openapi"] = openapi.build(current_app)
    return jsonify(document), 200
