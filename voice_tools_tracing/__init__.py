"""One trace per call (OpenTelemetry): the relay's request, every link, every callback, in one tree.

Off unless ``OTEL_EXPORTER_OTLP_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` is set (and
``OTEL_SDK_DISABLED`` is not ``true``): then nothing of OpenTelemetry is imported and every
function here answers at once (no span, no thread). On, each process starts the SDK once, as it
starts (``voice_tools_tracing.sdk.start``: the API's app factory, a worker's main process, beat, the
MCP face), and its hooks make the spans:

- ``app.server_spans``: a server span per HTTP request (Flask, and the MCP face's ASGI app), whose
  parent is the relay's ``traceparent``, or the trace kept with the call the request is about;
- ``tasks.worker.run_spans``: a span per task run (named after the task, with the call, tool, step,
  attempt and outcome) and per publish, from Celery's signals; ``tasks.worker.tracing``: the attempt a
  killed pool child lost;
- ``voice_tools_tracing.callbacks``: the span of a callback's POST, whose context it sends
  (``traceparent``, ``tracestate``).
- ``voice_tools_tracing.headers``: the one propagator of the process: ``traceparent`` and a bounded
  ``tracestate`` read and sent, ``baggage`` never; nothing a client sent logged by OpenTelemetry.

Asked for on an install without the ``tracing`` extra, a process runs untraced and says so in one line
(:func:`missing_line`, the SDK's start). At its end a process exports the spans it still holds
(``voice_tools_tracing.sdk.stop``, within a bound).

This module is ground floor and imports nothing of ours; the hooks import OpenTelemetry only
when they are called with tracing on. With tracing off, importing it also keeps redis-py from
loading the SDK's metrics (:func:`keep_the_sdk_out`): gunicorn's config, the app factory, the Celery
app and the ``voice-tools`` command import it before anything that imports redis (a ``celery`` command
loads its plug-ins first, Flower's among them, which imports redis: there it comes too late).
"""
from __future__ import annotations

import os
import sys
import threading
import time
from collections import OrderedDict
from typing import Any, Mapping

ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
TRACER = "voice_tools"

_started = False  # set by voice_tools_tracing.sdk.start in the process that started the SDK
_tracer: Any = None  # this process's tracer, made at its first use
_instrument_redis: Any = None  # set by voice_tools_tracing.sdk.start unless Redis's instrumentation is left out
_statements = False  # set by voice_tools_tracing.sdk.start unless psycopg2's statements are left out

# The trace contexts of the calls this process recorded lately: a call keeps the one it was recorded
# with for its whole life, so a later request about it on this process (the relay's keep-alive
# connection) joins it without reading it again (models.trace_context). Bounded in size and in time
# (a call id used again after its call was deleted is not found here).
KEPT_HERE_S = 600.0
KEPT_HERE_MAX = 4096
_kept_here: OrderedDict[str, tuple[float, str]] = OrderedDict()
_kept_lock = threading.Lock()


def enabled(environ: Mapping[str, str] | None = None) -> bool:
    """Are traces asked for (an OTLP endpoint is set, the SDK is not disabled)?"""
    env = os.environ if environ is None else environ
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    return any(env.get(name, "").strip() for name in ENDPOINT_VARIABLES)


def asked_by(environ: Mapping[str, str] | None = None) -> list[str]:
    """The endpoint variables set (what asks for traces), in the order the SDK prefers them."""
    env = os.environ if environ is None else environ
    return [name for name in ENDPOINT_VARIABLES if env.get(name, "").strip()]


def _protocol(env: Mapping[str, str]) -> str:
    chosen = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
    return (chosen or "http/protobuf").strip().lower()


def destination(environ: Mapping[str, str] | None = None) -> str:
    """Where the spans go: the traces endpoint as the SDK's exporter makes it (OTLP/HTTP: the base
    ``OTEL_EXPORTER_OTLP_ENDPOINT`` with ``/v1/traces``; the full ``..._TRACES_ENDPOINT`` as it is;
    gRPC: the endpoint as it is), with its protocol."""
    env = os.environ if environ is None else environ
    protocol = _protocol(env)
    full, base = (env.get(name, "").strip() for name in ENDPOINT_VARIABLES)
    where = full or (base if protocol == "grpc" else base.rstrip("/") + "/v1/traces")
    return f"{where} (OTLP {protocol})"


# what the SDK's start imports (the ``tracing`` extra of setup.cfg): (distribution, module, needed when)
PACKAGES = (("opentelemetry-sdk", "opentelemetry.sdk", None),
            ("opentelemetry-exporter-otlp-proto-http", "opentelemetry.exporter.otlp.proto.http", "http"),
            ("opentelemetry-exporter-otlp-proto-grpc", "opentelemetry.exporter.otlp.proto.grpc", "grpc"),
            ("opentelemetry-instrumentation-psycopg2", "opentelemetry.instrumentation.psycopg2", "psycopg2"),
            ("opentelemetry-instrumentation-redis", "opentelemetry.instrumentation.redis", "redis"))


def missing_packages(environ: Mapping[str, str] | None = None) -> list[str]:
    """The ``tracing`` extra's packages this process's tracing would import and cannot (looked for, not
    imported): the SDK, the exporter of the protocol chosen, the instrumentations not left out
    (``OTEL_PYTHON_DISABLED_INSTRUMENTATIONS``, as ``voice_tools_tracing.sdk`` reads it)."""
    from importlib.util import find_spec

    env = os.environ if environ is None else environ
    protocol = "grpc" if _protocol(env) == "grpc" else "http"
    left_out = {name.strip() for name in env.get("OTEL_PYTHON_DISABLED_INSTRUMENTATIONS", "").split(",")}
    missing = []
    for distribution, module, when in PACKAGES:
        if when in ("http", "grpc") and when != protocol:
            continue  # the other protocol's exporter
        if when in ("psycopg2", "redis") and {when, "*"} & left_out:
            continue  # an instrumentation left out
        try:
            found = find_spec(module) is not None
        except (ImportError, ValueError):  # its parent package is not there either
            found = False
        if not found:
            missing.append(distribution)
    return missing


def missing_line(environ: Mapping[str, str] | None = None) -> str | None:
    """With traces asked for and the ``tracing`` extra not installed, the one line that says so (the
    variable seen, the packages missing, the command that installs them): the process runs untraced.
    None when tracing is off or can start."""
    if not enabled(environ):
        return None
    missing = missing_packages(environ)
    if not missing:
        return None
    return (f"tracing is asked for ({' and '.join(asked_by(environ))} set) but its packages are not installed "
            f"({', '.join(missing)}): running untraced; install them with "
            f"`{sys.executable} -m pip install 'voice-tools[tracing]'`, or unset the variable")


def keep_the_sdk_out() -> None:
    """With tracing off, mark ``opentelemetry.sdk.metrics`` as absent for this process, unless already loaded.

    redis-py 8 (``redis/observability/providers.py``, imported by ``redis.connection``) runs
    ``from opentelemetry.sdk.metrics import MeterProvider`` at its own import whenever the SDK is
    installed, and only uses it when its own OpenTelemetry metrics are switched on (we never do): about
    3 MB in every process that imports redis. ``None`` in ``sys.modules`` is Python's own way of saying
    a module cannot be imported: that import raises ``ImportError``, which redis-py catches (its
    metrics are then unavailable) before ``opentelemetry.sdk`` is loaded. With tracing on, nothing is
    marked: the SDK is loaded anyway."""
    if not enabled():
        sys.modules.setdefault("opentelemetry.sdk.metrics", None)  # type: ignore[arg-type]


def active() -> bool:
    """Has this process started the SDK (so spans are made here)?"""
    return _started


def current_ids() -> dict[str, str]:
    """``trace_id`` and ``span_id`` (hex) of the span under way; {} with tracing off or outside a span."""
    if not _started:
        return {}
    from opentelemetry import trace

    context = trace.get_current_span().get_span_context()
    if not context.is_valid:
        return {}
    return {"trace_id": format(context.trace_id, "032x"), "span_id": format(context.span_id, "016x")}


def traceparent() -> str | None:
    """The W3C ``traceparent`` of the span under way (what a call recorded now keeps); None with tracing off."""
    ids = current_ids()
    if not ids:
        return None
    from opentelemetry import trace

    flags = int(trace.get_current_span().get_span_context().trace_flags)
    return f"00-{ids['trace_id']}-{ids['span_id']}-{flags:02x}"


def remember(tool_call_id: str, kept: str | None) -> None:
    """The context a call was just recorded with here (nothing with tracing off)."""
    if not _started or not kept:
        return
    with _kept_lock:
        _kept_here[tool_call_id] = (time.monotonic() + KEPT_HERE_S, kept)
        _kept_here.move_to_end(tool_call_id)
        while len(_kept_here) > KEPT_HERE_MAX:
            _kept_here.popitem(last=False)


def remembered(tool_call_id: str) -> str | None:
    """The context this process recorded the call with, lately; None if not known here."""
    with _kept_lock:
        found = _kept_here.get(tool_call_id)
        if found is None:
            return None
        if found[0] < time.monotonic():
            del _kept_here[tool_call_id]
            return None
        return found[1]


def statement_spans() -> bool:
    """Are the statements of ``models/compiled.py`` spans of ours in this process
    (``voice_tools_tracing.statements``)? False with tracing off, or psycopg2's statements left out."""
    return _statements


def redis_client(client: Any) -> Any:
    """One of our own Redis clients (the fair shares' counts): with tracing on, each of its commands
    inside a trace is a span (opentelemetry's Redis instrumentation, on this client alone). The broker's
    connection is never instrumented: a publish is its ``apply_async/<task>`` span, and its polls,
    acknowledgements and heartbeats belong to no trace (each would cost a worker's consumer a span that is
    never recorded). Returns ``client``."""
    if _instrument_redis is not None:
        _instrument_redis(client)
    return client


def tracer() -> Any:
    """The one tracer of our own spans in this process (the SDK's ``get_tracer`` builds its scope and
    resets the warnings filters at each call: made once)."""
    global _tracer
    if _tracer is None:
        from opentelemetry import trace

        _tracer = trace.get_tracer(TRACER)
    return _tracer


keep_the_sdk_out()
