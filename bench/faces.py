"""The relay's faces side by side: the event stream against callbacks, MCP against REST.

    .venv/bin/python bench/faces.py [--calls 100] [--requests 300]

In one run, on one database, one broker and one worker:

(a) an event's delay from the moment it was recorded (the ``created_at`` of its
    ``callback_deliveries`` row: the start of the transaction that recorded it, on the
    database's clock, which is this machine's) to its arrival (i) on an open
    ``GET /voice-tools/events/<session>`` stream and (ii) at a callback receiver, for the
    same events: ``search_contacts`` calls started with ``/voice-tools/execute``, each
    posting a ``progress`` and a ``completed`` event to the receiver and onto the stream;
(b) ``request_tool`` over MCP (the SDK's client, streamable HTTP, one session) against
    ``POST /voice-tools/pending`` over REST (``requests``, one keep-alive session), both
    recording the same call, alternating request by request.

The API is served by werkzeug's threaded server and the MCP face by uvicorn, each in a
thread of this process; the worker is a ``celery -A tasks worker --pool prefork -c 2``
subprocess. Embedded servers unless ``DATABASE_URL``/``REDIS_URL`` are set. Results are
printed and written to ``bench/FACES.md``.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.calls import API_TOKEN, AUTH  # noqa: E402
from bench.run import bench_servers, machine  # noqa: E402


def pct(values: list[float], p: int) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[p - 1]


def row(name: str, ms: list[float]) -> str:
    return (f"| {name} | {len(ms)} | {statistics.median(ms):.2f} | {pct(ms, 95):.2f} | {pct(ms, 99):.2f} "
            f"| {min(ms):.2f} | {max(ms):.2f} |")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def serve_api() -> str:
    import logging

    from werkzeug.serving import make_server

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # no line per request

    from app import create_app

    server = make_server("127.0.0.1", 0, create_app(), threaded=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_port}"


def serve_mcp() -> str:
    import uvicorn

    from app.mcp_server import create_mcp_app

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_mcp_app(), host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.02)
    return f"http://127.0.0.1:{port}/mcp"


# -- (a) the stream against callbacks -----------------------------------------------------

def events_bench(api: str, calls: int) -> tuple[list[float], list[float]]:
    import requests
    from sqlalchemy import select

    from models import db
    from models.calls import CallbackDelivery
    from support.relay import Relay
    from support.sse_client import Stream

    session_id = f"bench_sse_{int(time.time())}"
    arrived_cb: dict[str, float] = {}
    arrived_sse: dict[str, float] = {}
    with Relay(secret=os.environ["VOICE_TOOLS_CALLBACK_SECRET"]) as relay:
        relay.answer(lambda event: arrived_cb.setdefault(event["event_id"], time.time()) and None)
        stream = Stream(f"{api}/voice-tools/events/{session_id}", AUTH)

        def read() -> None:
            try:
                while True:
                    event_id, _ = stream.next_event()
                    arrived_sse.setdefault(event_id, time.time())
            except Exception:
                pass

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        http = requests.Session()
        http.headers.update(AUTH)
        for i in range(calls):
            started = http.post(f"{api}/voice-tools/execute", json={
                "session_id": session_id, "function": "search_contacts", "parameters": {"query": "Ann"},
                "callback_url": relay.url})
            assert started.status_code == 202, started.text
            relay.wait_for(started.json()["tool_call_id"], "completed", timeout=60)
        deadline = time.monotonic() + 30
        with db.session() as s:
            rows = s.execute(select(CallbackDelivery.event_id, CallbackDelivery.created_at)
                             .where(CallbackDelivery.session_id == session_id)).all()
        while len(arrived_sse) < len(rows) and time.monotonic() < deadline:
            time.sleep(0.05)
        stream.close()
    recorded = {event_id: created.timestamp() for event_id, created in rows}
    sse = [(arrived_sse[e] - t) * 1000 for e, t in recorded.items() if e in arrived_sse]
    callback = [(arrived_cb[e] - t) * 1000 for e, t in recorded.items() if e in arrived_cb]
    assert len(sse) == len(callback) == len(recorded) == 2 * calls, (len(sse), len(callback), len(recorded))
    return sse, callback


# -- (b) MCP against REST -----------------------------------------------------------------------

async def _mcp_and_rest(mcp_url: str, api: str, runs: int, warmup: int) -> tuple[list[float], list[float]]:
    import httpx2
    import requests
    from mcp import Client
    from mcp.client.streamable_http import streamable_http_client

    rest = requests.Session()
    rest.headers.update(AUTH)
    body = {"session_id": "bench_faces", "function": "send_email",
            "parameters": {"to": "bench@example.com", "subject": "Bench"}}
    mcp_ms: list[float] = []
    rest_ms: list[float] = []
    async with httpx2.AsyncClient(headers={"Authorization": f"Bearer {API_TOKEN}"}) as http:
        async with Client(streamable_http_client(mcp_url, http_client=http)) as mcp:
            for i in range(warmup + runs):
                started = time.perf_counter()
                result = await mcp.call_tool("request_tool", body)
                m = time.perf_counter() - started
                assert not result.is_error, result.structured_content
                started = time.perf_counter()
                answer = await asyncio.to_thread(rest.post, f"{api}/voice-tools/pending", json=body)
                r = time.perf_counter() - started
                assert answer.status_code == 201, answer.text
                if i >= warmup:
                    mcp_ms.append(m * 1000)
                    rest_ms.append(r * 1000)
    return mcp_ms, rest_ms


def report(args: argparse.Namespace, sse: list[float], callback: list[float], mcp: list[float],
           rest: list[float]) -> str:
    info = machine()
    header = ["| measurement | n | p50 | p95 | p99 | min | max |", "|---|---|---|---|---|---|---|"]
    return "\n".join([
        "# voice-tools faces benchmark",
        "",
        f"- measured on {datetime.now(timezone.utc).strftime('%Y-%m-%d')} with "
        f"`.venv/bin/python bench/faces.py --calls {args.calls} --requests {args.requests}`",
        f"- machine: {info['cpu']}; {info['os']}; Python {info['python']}",
        f"- {info['versions']}; servers {info['servers']}",
        f"- {info['load']}",
        "",
        "## (a) An event's delay from its row to the relay (ms)",
        "",
        f"{args.calls} `search_contacts` calls, 2 events each; the same events on both sides.",
        "",
        *header,
        row("(i) event stream (`GET /voice-tools/events/<session>`)", sse),
        row("(ii) callback (inline POST from the worker)", callback),
        "",
        f"p50 ratio stream/callback: **{statistics.median(sse) / statistics.median(callback):.2f}x** "
        "(goal: the stream no slower than the callback). The callback is posted by the link right after "
        "its transaction commits; the stream is woken by NOTIFY at the commit and reads the row.",
        "",
        "## (b) Recording a call: MCP `request_tool` against REST `POST /voice-tools/pending` (ms)",
        "",
        *header,
        row("MCP `request_tool` (SDK client, streamable HTTP)", mcp),
        row("REST `POST /voice-tools/pending` (requests, keep-alive)", rest),
        "",
        f"p50 ratio MCP/REST: **{statistics.median(mcp) / statistics.median(rest):.2f}x** (goal: at most 1.5x).",
        "",
    ])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=100, help="search_contacts calls for (a) (default 100)")
    parser.add_argument("--requests", type=int, default=300, help="requests of each face for (b) (default 300)")
    parser.add_argument("--output", default=str(ROOT / "bench" / "FACES.md"))
    args = parser.parse_args(argv)

    with bench_servers("voice-tools-bench-faces-") as data_dir:
        from tasks import app, tools
        from voice_tools_backends import load_demo
        from support.worker_process import WorkerProcess

        load_demo()
        queues = [tools.TOOLS["search_contacts"].queue, "callbacks"]
        with app.connection_for_write() as conn:
            for name in queues:
                conn.default_channel.queue_purge(name)
        api, mcp_url = serve_api(), serve_mcp()
        with WorkerProcess(app, queues, pool="prefork", concurrency=2, log_dir=data_dir, name="bench-faces"):
            print(f"(a) {args.calls} calls ...", flush=True)
            events_bench(api, 5)  # warm-up
            sse, callback = events_bench(api, args.calls)
            print(f"(b) {args.requests} requests of each face ...", flush=True)
            mcp, rest = asyncio.run(_mcp_and_rest(mcp_url, api, args.requests, max(args.requests // 10, 10)))
        text = report(args, sse, callback, mcp, rest)
        Path(args.output).write_text(text)
        print(text)
        print(f"written to {args.output}")
        return 0


if __name__ == "__main__":
    sys.exit(main())
