"""Starting OpenTelemetry's SDK in this process, from the standard variables only.

The SDK reads them itself: the endpoint and headers (``OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT``,
``..._HEADERS``, ``..._TIMEOUT``), the resource (``OTEL_SERVICE_NAME``,
``OTEL_RESOURCE_ATTRIBUTES``), the sampler (``OTEL_TRACES_SAMPLER``, ``OTEL_TRACES_SAMPLER_ARG``)
and the batch processor (``OTEL_BSP_SCHEDULE_DELAY``, ...). ``OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL``
chooses the exporter: ``http/protobuf`` (the default) or ``grpc``. With no service name given,
the process says what it is: ``voice-tools-api``, ``-worker``, ``-beat``, ``-mcp``.

Then the libraries' own instrumentations, psycopg2 (each statement, but those of ``models/compiled.py``:
``voice_tools_tracing.statements``) and redis (each command of our own Redis clients,
``voice_tools_tracing.redis_client``), unless ``OTEL_PYTHON_DISABLED_INSTRUMENTATIONS`` names them. The
spans of Celery's task runs and publishes are ``tasks.worker.run_spans``'s, whose :func:`start` starts this SDK
with the release's version (the callers: ``app.server_spans``, ``tasks.worker.tracing``): this package
imports nothing of ours. What crosses the process's edge is ``voice_tools_tracing.headers``'s: ``traceparent``
and a bounded ``tracestate``, never ``baggage`` (``OTEL_PROPAGATORS`` is not read). The batch processor's
thread is made again in a forked child (a gunicorn worker, a Celery pool process) by the SDK itself.

At its end a process exports the spans it still holds, waiting at most :data:`STOP_S` seconds
(:func:`stop`): at its exit (``atexit``: the API's gunicorn worker, the MCP face, beat, a worker's main
process), and where a process ends without ``atexit`` or before its last spans would go on the schedule,
from Celery's signals (``tasks.worker.tracing``): a pool child as it exits (``worker_process_shutdown``;
billiard ends it with ``os._exit``) and a worker's main process at its warm stop (``worker_shutdown``).
"""
from __future__ import annotations

import atexit
import functools
import logging
import os
import threading
from typing import Any

import voice_tools_tracing as tracing

log = logging.getLogger(__name__)

_lock = threading.Lock()
STOP_S = 5.0  # at a process's end: the longest it waits for its last spans to be exported
_exporting: Any = None  # this process's batch processor, once started
_untraced: list[str] = []  # the line said when traces were asked for without the tracing extra


def protocol() -> str:
    chosen = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
    return (chosen or "http/protobuf").strip().lower()


def _exporter():
    if protocol() == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter  # type: ignore[assignment]
    return OTLPSpanExporter()


def start(role: str, version: str) -> bool:
    """Start the SDK in this process if tracing is asked for (once); True if it runs. ``version``: the
    release, the spans' ``service.version`` (handed by the caller: this package imports nothing of ours)."""
    with _lock:
        if tracing._started or not tracing.enabled():
            return tracing._started
        if _untraced:
            return False
        missing = tracing.missing_line()
        if missing:  # the tracing extra not installed: said in one line (once), the process runs untraced
            _untraced.append(missing)
            log.warning("%s", missing)
            return False
        from opentelemetry import trace
        from opentelemetry.sdk.resources import SERVICE_NAME, SERVICE_VERSION, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased

        from voice_tools_tracing import headers

        headers.install()  # W3C trace context alone, bounded, nothing of it logged (before any request is read)
        resource = Resource.create({"voice_tools.process": role, SERVICE_VERSION: version})
        if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
            resource = resource.merge(Resource({SERVICE_NAME: f"voice-tools-{role}"}))
        global _exporting
        exporting = BatchSpanProcessor(_exporter())  # one thread of this process (made again after a fork)
        # the sampler: OTEL_TRACES_SAMPLER (parentbased_always_on); at exit, stop() (bounded), not the SDK's 30 s
        provider = TracerProvider(resource=resource, shutdown_on_exit=False)
        provider.add_span_processor(exporting)
        # statements and Redis commands only inside a trace (a worker's broker polls, a batching thread's
        # statements are no trace of their own), sampled as their trace is
        children = TracerProvider(resource=resource, sampler=ParentBased(root=ALWAYS_OFF), shutdown_on_exit=False)
        children.add_span_processor(exporting)
        trace.set_tracer_provider(provider)
        _instrument(children)
        _exporting = exporting
        atexit.register(stop)
        tracing._started = True
        log.info("tracing on: %s spans to %s (%s)", resource.attributes.get(SERVICE_NAME),
                 os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"),
                 protocol())
        return True


def stop(timeout_s: float = STOP_S, **_: Any) -> None:
    """Export the spans this process still holds and stop exporting, waiting at most ``timeout_s`` seconds
    (the batch processor's shutdown); nothing if tracing never started here. Safe twice (the second call does
    nothing), and a Celery signal's receiver (its arguments ignored)."""
    if _exporting is None:
        return
    # the SDK's shutdown takes no timeout (its own wait is 30 s): it runs on a thread of its own, waited
    # for at most timeout_s (the process's exit ends that thread if the collector is slower)
    ending = threading.Thread(target=_shut, args=(_exporting,), name="tracing-stop", daemon=True)
    ending.start()
    ending.join(timeout_s)
    if ending.is_alive():
        log.warning("tracing: the last spans of this process were not exported within %.0f s", timeout_s)


def _shut(exporting: Any) -> None:
    try:
        exporting.shutdown()
    except Exception:  # the process is ending: say it, never raise from its exit
        log.warning("tracing: the last spans of this process were not all exported", exc_info=True)


def disabled_instrumentations() -> set[str]:
    """The libraries' instrumentations left out (``OTEL_PYTHON_DISABLED_INSTRUMENTATIONS``: their entry
    points' names, ``psycopg2``, ``redis``, comma separated; ``*``: all), as opentelemetry-python's
    own auto-instrumentation reads it."""
    return {name.strip() for name in os.environ.get("OTEL_PYTHON_DISABLED_INSTRUMENTATIONS", "").split(",")
            if name.strip()}


def _instrument(children: Any) -> None:
    left_out = disabled_instrumentations()
    wanted = lambda name: not {name, "*"} & left_out  # noqa: E731
    if wanted("psycopg2"):
        from opentelemetry.instrumentation.psycopg2 import Psycopg2Instrumentor

        Psycopg2Instrumentor().instrument(tracer_provider=children, skip_dep_check=True)  # psycopg2-binary's
        tracing._statements = True  # and models/compiled.py's, spans of ours (voice_tools_tracing.statements)
    if wanted("redis"):  # our own clients only, as they are made (the broker's: never)
        from opentelemetry.instrumentation.redis import RedisInstrumentor

        tracing._instrument_redis = functools.partial(RedisInstrumentor.instrument_client, tracer_provider=children)
