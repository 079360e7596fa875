"""What tracing costs a chain: confirm → ``completed`` of the 4-step read tool, tracing off against on.

    .venv/bin/python -m bench.tracing_cost [--pairs 60] [--warmup 5] [--disable psycopg2] [--set NAME=VALUE]
    .venv/bin/python -m bench.tracing_cost --blocks 3 [--runs 30]

The chain is the one ``python -m bench`` times: the 4-step read tool's confirm → ``completed``
callback at a local relay (``support/relay.py``), timed from the POST confirm to the event. The
Procfile's web, writes, reads and callbacks lines (``bench/stack.py``) run twice: tracing off (no
``OTEL_`` variable at all in their environment: nothing of OpenTelemetry loaded) and tracing on
(``OTEL_EXPORTER_OTLP_ENDPOINT`` set to a local receiver started here: a real HTTP server that
decodes every export with ``opentelemetry-proto`` and counts its spans; the SDK's default batch
settings).

By default (interleaved) both stacks are up at once, each with its own ports and its own broker
database on the same PostgreSQL and Redis, and one chain of each side runs in turn, the order
swapped at every pair, ``--pairs`` times after ``--warmup`` chains of each: the machine's pace,
which moves from one minute to the next on a shared machine, is the same for both sides of a pair.
It prints the p50 and p99 of each side, the ratio of the p50s (on / off) and the median of the
pairs' ratios (the goal: at most 1.10), the CPU time (user + system) the processes of each stack
spent over the pairs per chain (and by process) and their ratio, the spans received per chain, and
the load average.

``--disable`` sets ``OTEL_PYTHON_DISABLED_INSTRUMENTATIONS`` on the traced side (``psycopg2``: no span per
statement), to measure what tracing costs without those spans. ``--set`` sets any other variable there:
``OTEL_TRACES_SAMPLER=always_off`` (every hook runs, no span is recorded: what tracing costs before its
spans), ``OTEL_SDK_DISABLED=true`` (both sides off: the measurement's own bias, about 1 %).

``--blocks N`` runs the former way instead: one stack at a time, ``--runs`` chains per block,
``N`` blocks of each side, their order swapped at every block; each pair of blocks gives a p50 ratio.

It never asserts a time, and it writes nothing; the figure goes to ``bench/RESULTS.md`` by hand.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
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


OFF, ON = "off", "on"


def without_tracing(env: dict[str, str]) -> None:
    """No ``OTEL_`` variable at all: tracing off as a process that never heard of it."""
    for name in [name for name in env if name.startswith("OTEL_")]:
        del env[name]


def block(data_dir: Any, relay: Any, runs: int, warmup: int, tracing: dict[str, str]) -> dict[str, float]:
    from bench.stack import PRODUCT, Stack

    stack = Stack(data_dir, names=PRODUCT)
    without_tracing(stack.env)
    stack.env.update(tracing)
    with stack:
        chain = ChainBench(stack.urls["web"], stack.urls["bare_web"], relay, four_step_read_tool())
        for _ in range(warmup):
            chain.engine_once()
        return summary([chain.engine_once() for _ in range(runs)])


def blocks(data_dir: Any, relay: Any, sink: "Sink", on: dict[str, str], args: argparse.Namespace) -> None:
    ratios = []
    for i in range(args.blocks):
        taken: dict[str, dict[str, float]] = {}
        for side in ((OFF, ON) if i % 2 == 0 else (ON, OFF)):
            print(f"block {i + 1}: tracing {side}, {args.warmup} + {args.runs} chains ...", flush=True)
            taken[side] = block(data_dir / f"block-{i}-{side}", relay, args.runs, args.warmup, on if side == ON else {})
        ratio = taken[ON]["p50"] / taken[OFF]["p50"]
        ratios.append(ratio)
        print(f"  off p50 {taken[OFF]['p50']:.1f} ms p99 {taken[OFF]['p99']:.1f} ms | "
              f"on p50 {taken[ON]['p50']:.1f} ms p99 {taken[ON]['p99']:.1f} ms | on/off {ratio:.3f}", flush=True)
    print(f"4-link chain, tracing on / off, p50 ratio: median {statistics.median(ratios):.3f} "
          f"(blocks {', '.join(f'{r:.3f}' for r in ratios)}); {sink.spans} spans received; goal <= 1.10")


def stack_cpu(stack: Any) -> dict[str, float]:
    """CPU seconds (user + system) so far of each of the stack's processes with its children, by name."""
    from bench.cpu import _cpu, _family

    return {name: sum(_cpu(process) for process in _family(proc.pid)) for name, proc in stack.procs.items()}


def settled(sink: "Sink", quiet: float = 6.0, timeout: float = 30.0) -> int:
    """The spans received once exports have stopped for ``quiet`` seconds (the batch processor's
    delay is 5 s by default: the spans of the chains just run arrive within it)."""
    deadline = time.monotonic() + timeout
    seen, since = sink.spans, time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.25)
        if sink.spans != seen:
            seen, since = sink.spans, time.monotonic()
        elif time.monotonic() - since >= quiet:
            break
    return seen


def interleaved(data_dir: Any, relay: Any, sink: "Sink", on: dict[str, str], args: argparse.Namespace) -> None:
    from bench.stack import PRODUCT, Stack

    stacks = {OFF: Stack(data_dir / OFF, names=PRODUCT, broker_db=1),
              ON: Stack(data_dir / ON, names=PRODUCT, broker_db=2)}
    without_tracing(stacks[OFF].env)
    without_tracing(stacks[ON].env)
    stacks[ON].env.update(on)
    try:
        for stack in stacks.values():
            stack.start()
        chains = {side: ChainBench(stack.urls["web"], stack.urls["bare_web"], relay, four_step_read_tool())
                  for side, stack in stacks.items()}
        print(f"both stacks up; {args.warmup} chains of each, then {args.pairs} pairs ...", flush=True)
        for _ in range(args.warmup):
            for side in (OFF, ON):
                chains[side].engine_once()
        spans_before = settled(sink)
        load_before = os.getloadavg()
        cpu_before = {side: stack_cpu(stack) for side, stack in stacks.items()}
        taken: dict[str, list[float]] = {OFF: [], ON: []}
        ratios = []
        for i in range(args.pairs):
            for side in ((OFF, ON) if i % 2 == 0 else (ON, OFF)):
                taken[side].append(chains[side].engine_once())
            ratios.append(taken[ON][-1] / taken[OFF][-1])
        cpu_by = {side: {name: (seconds - cpu_before[side].get(name, 0.0)) * 1000 / args.pairs
                         for name, seconds in stack_cpu(stack).items()} for side, stack in stacks.items()}
        cpu = {side: sum(by_name.values()) for side, by_name in cpu_by.items()}
        load_after = os.getloadavg()
        spans = settled(sink) - spans_before
    finally:
        for stack in stacks.values():
            stack.stop()
    got = {side: summary(samples) for side, samples in taken.items()}
    ratio = got[ON]["p50"] / got[OFF]["p50"]
    print(f"  off p50 {got[OFF]['p50']:.1f} ms p99 {got[OFF]['p99']:.1f} ms | "
          f"on p50 {got[ON]['p50']:.1f} ms p99 {got[ON]['p99']:.1f} ms")
    print(f"  CPU per chain (the stack's web, writes, reads, callbacks): off {cpu[OFF]:.1f} ms | on {cpu[ON]:.1f} ms"
          f" | on/off {cpu[ON] / cpu[OFF]:.3f}")
    print("    by process, off / on: " + ", ".join(f"{name} {cpu_by[OFF][name]:.1f} / {cpu_by[ON][name]:.1f} ms"
                                                 for name in cpu_by[OFF]))
    print(f"  {spans / args.pairs:.1f} spans received per chain; load average {load_before[0]:.2f} -> {load_after[0]:.2f}")
    print(f"4-link chain, tracing on / off, interleaved, {args.pairs} pairs: p50 ratio {ratio:.3f}, "
          f"median of the pairs' ratios {statistics.median(ratios):.3f}, CPU ratio {cpu[ON] / cpu[OFF]:.3f}; goal <= 1.10")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=60, help="timed pairs (one chain of each side), interleaved (default 60)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed chains of each side first (default 5)")
    parser.add_argument("--blocks", type=int, default=0,
                        help="run block by block instead: this many blocks of each side, one stack at a time")
    parser.add_argument("--runs", type=int, default=30, help="timed chains per block, with --blocks (default 30)")
    parser.add_argument("--disable", default="", metavar="NAMES",
                        help="OTEL_PYTHON_DISABLED_INSTRUMENTATIONS of the traced side (psycopg2, redis; comma separated)")
    parser.add_argument("--set", action="append", default=[], metavar="OTEL_NAME=VALUE",
                        help="another variable of the traced side (OTEL_TRACES_SAMPLER=always_off, ...); repeatable")
    args = parser.parse_args(argv)
    with bench_servers("voice-tools-bench-tracing-") as data_dir:
        from voice_tools_backends import load_demo
        from support.relay import Relay

        load_demo()
        sink = Sink()
        on = {"OTEL_EXPORTER_OTLP_ENDPOINT": sink.endpoint, "OTEL_SERVICE_NAME": "voice-tools-bench",
              **({"OTEL_PYTHON_DISABLED_INSTRUMENTATIONS": args.disable} if args.disable else {}),
              **dict(setting.split("=", 1) for setting in args.set)}
        with Relay(secret=os.environ["VOICE_TOOLS_CALLBACK_SECRET"]) as relay:
            if args.blocks:
                blocks(data_dir, relay, sink, on, args)
            else:
                interleaved(data_dir, relay, sink, on, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
