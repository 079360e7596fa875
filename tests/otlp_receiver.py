"""A trace collector for the tests: a real HTTP server on 127.0.0.1 (``tests/http_double.py``'s double)
that takes OTLP/HTTP protobuf (``POST /v1/traces``) and decodes each request with ``opentelemetry-proto``'s
own message classes (``ExportTraceServiceRequest``), keeping every span it received."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from tests.http_double import HttpDouble, Request


def _value(any_value: Any) -> Any:
    kind = any_value.WhichOneof("value")
    return getattr(any_value, kind) if kind else None


@dataclass
class Span:
    trace_id: str
    span_id: str
    parent_id: str
    name: str
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    links: list[tuple[str, str]]
    status_code: int
    service: str
    resource: dict[str, Any] = field(repr=False, default_factory=dict)

    @property
    def ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6


class Receiver:
    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.requests = 0
        self.paths: list[str] = []
        self._lock = threading.Condition()
        self._http = HttpDouble().answer("POST", r"^/v1/traces$", self._export, times=None,
                                         headers={"Content-Type": "application/x-protobuf"})

    @property
    def endpoint(self) -> str:
        return self._http.url

    def __enter__(self) -> "Receiver":
        self._http.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._http.__exit__(*exc)

    def _export(self, request: Request) -> bytes:
        """One OTLP/HTTP export: its spans kept, answered with an empty ``ExportTraceServiceResponse``."""
        assert request.headers.get("content-type") == "application/x-protobuf", request.headers
        message = ExportTraceServiceRequest()
        message.ParseFromString(request.body)
        self._add(request.path, message)
        return ExportTraceServiceResponse().SerializeToString()

    def _add(self, path: str, request: ExportTraceServiceRequest) -> None:
        found = []
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for s in scope_spans.spans:
                    found.append(Span(
                        trace_id=s.trace_id.hex(), span_id=s.span_id.hex(), parent_id=s.parent_span_id.hex(),
                        name=s.name, kind=s.kind, start_ns=s.start_time_unix_nano, end_ns=s.end_time_unix_nano,
                        attributes={a.key: _value(a.value) for a in s.attributes},
                        links=[(link.trace_id.hex(), link.span_id.hex()) for link in s.links],
                        status_code=s.status.code, service=str(resource.get("service.name")), resource=resource))
        with self._lock:
            self.requests += 1
            self.paths.append(path)
            self.spans.extend(found)
            self._lock.notify_all()

    def wait(self, condition: Callable[[list[Span]], bool], timeout: float = 30.0) -> list[Span]:
        """Block until ``condition(spans)`` holds; the spans (AssertionError on timeout)."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while not condition(list(self.spans)):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"timed out: {[s.name for s in self.spans]}")
                self._lock.wait(left)
            return list(self.spans)


def tree(spans: list[Span]) -> str:
    """The spans as an indented tree (children by start time), with each one's duration and service."""
    by_id = {s.span_id: s for s in spans}
    children: dict[str, list[Span]] = {}
    for s in spans:
        children.setdefault(s.parent_id if s.parent_id in by_id else "", []).append(s)
    origin = min((s.start_ns for s in spans), default=0)
    lines: list[str] = []

    def walk(parent: str, depth: int) -> None:
        for s in sorted(children.get(parent, []), key=lambda x: x.start_ns):
            note = f" [attempt {s.attributes['voice_tools.attempt']}, {s.attributes.get('voice_tools.outcome')}]" \
                if "voice_tools.attempt" in s.attributes else ""
            orphan = " (parent not exported)" if depth == 0 and s.parent_id else ""
            lines.append(f"{'  ' * depth}{s.name}  +{(s.start_ns - origin) / 1e6:.1f} ms  {s.ms:.2f} ms  "
                         f"({s.service}){note}{orphan}")
            walk(s.span_id, depth + 1)

    walk("", 0)
    return "\n".join(lines)


class GrpcReceiver(Receiver):
    """The same collector over OTLP/gRPC (``TraceService/Export``), on 127.0.0.1."""

    def __init__(self) -> None:
        from concurrent import futures

        import grpc
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

        super().__init__()  # its OTLP/HTTP endpoint is served too, and never posted to
        receiver = self

        class Service(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request: ExportTraceServiceRequest, context: Any) -> ExportTraceServiceResponse:  # noqa: N802
                receiver._add("grpc", request)
                return ExportTraceServiceResponse()

        self._grpc = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), self._grpc)
        self._port = self._grpc.add_insecure_port("127.0.0.1:0")

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._port}"

    def __enter__(self) -> "GrpcReceiver":
        super().__enter__()
        self._grpc.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._grpc.stop(grace=None)
        super().__exit__(*exc)
