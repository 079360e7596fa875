"""What tracing costs a chain: confirm → ``completed`` of the 4-step read tool, tracing off against on.

    .venv/bin/python -m bench.tracing_cost [--runs 30] [--blocks 3]

The Procfile's web, writes, reads and callbacks lines (``bench/stack.py``) are started once with no
OTLP variable (tracing off: nothing of it loaded) and once with ``OTEL_EXPORTER_OTLP_ENDPOINT`` set to a
local receiver started here (a real HTTP server that decodes every export with ``opentelemetry-proto``
and counts its spans; the SDK's default batch settings), in turn, ``--blocks`` times each, their order
swapped at every block (a shared machine's pace moves from one minute to the next). In each block the
same chain as ``python -m bench`` times (the 4-step read tool's confirm → ``completed`` callback at a
local relay, ``support/relay.py``) runs ``--runs`` times after a warm-up. It prints each block's p50
and p99, each pair's p50 ratio (on / off) and their median: the goal is at most 1.10. It never
asserts a time, and it writes nothing; the figure goes to ``bench/RESULTS.md`` by hand.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from bench.load import summary
from bench.run import ChainBench, bench_servers, four_step_read_tool


class Sink:
    """An OTLP/HTTP receiver on 127.0.0.1 that decodes each export and counts the spans."""

    def __init__(self) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        self.spans = 0
        lock = threading.Lock()
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802
                request = ExportTraceServiceRequest()
                request.ParseFromString(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                with lock:
                    sink.spans += sum(len(s.spans) for r in request.resource_spans for s in r.scope_spans)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"


def block(data_dir: Any, relay: Any, runs: int, warmup: int, tracing: dict[str, str]) -> dict[str, float]:
    from bench.stack import Stack

    stack = Stack(data_dir)
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        stack.env.pop(name, None)
    stack.env.update(tracing)
    with stack:
        chain = ChainBench(stack.urls["web"], stack.urls["bare_web"], relay, four_step_read_tool())
        for _ in range(warmup):
            chain.engine_once()
        return summary([chain.engine_once() for _ in range(runs)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=30, help="timed chains per block (default 30)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed chains first in each block (default 5)")
    parser.add_argument("--blocks", type=int, default=3, help="blocks of each side (default 3)")
    args = parser.parse_args(argv)
    with bench_servers("voice-tools-bench-tracing-") as data_dir:
        from voice_tools.backends import load_demo
        from support.relay import Relay

        load_demo()
        sink = Sink()
        on = {"OTEL_EXPORTER_OTLP_ENDPOINT": sink.endpoint, "OTEL_SERVICE_NAME": "voice-tools-bench"}
        ratios = []
        with Relay(secret=os.environ["VOICE_TOOLS_CALLBACK_SECRET"]) as relay:
            for i in range(args.blocks):
                taken: dict[str, dict[str, float]] = {}
                for side in (("off", "on") if i % 2 == 0 else ("on", "off")):
                    print(f"block {i + 1}: tracing {side}, {args.warmup} + {args.runs} chains ...", flush=True)
                    taken[side] = block(data_dir, relay, args.runs, args.warmup, on if side == "on" else {})
                ratio = taken["on"]["p50"] / taken["off"]["p50"]
                ratios.append(ratio)
                print(f"  off p50 {taken['off']['p50']:.1f} ms p99 {taken['off']['p99']:.1f} ms | "
                      f"on p50 {taken['on']['p50']:.1f} ms p99 {taken['on']['p99']:.1f} ms | on/off {ratio:.3f}",
                      flush=True)
        print(f"4-link chain, tracing on / off, p50 ratio: median {statistics.median(ratios):.3f} "
              f"(blocks {', '.join(f'{r:.3f}' for r in ratios)}); {sink.spans} spans received; goal <= 1.10")
    return 0


if __name__ == "__main__":
    sys.exit(main())
