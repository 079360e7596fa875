"""``python -m bench.footprint``: the memory (PSS) of a local run, idle and used, on a fresh data dir.

    .venv/bin/python -m bench.footprint [--runs 1] [--settle 60] [--queries 50] [--checkout PATH ...]

Each run starts ``voice-tools run`` on a fresh data dir (its own ports), waits until every face
listens (the MCP port is not connected to), lets it settle ``--settle`` seconds and measures it
idle; then it plays ``voice-tools demo --scenario all``, makes one MCP tool call (``list_tools``
over streamable HTTP) and ``--queries`` document searches (``search_documentation`` through
``/voice-tools/execute?wait``, each with its own question), waits 10 s and measures it used; then
it stops the run with SIGTERM. Memory is what ``voice-tools footprint`` reads: the PSS of each
process of the run's tree, by role; the embedded PostgreSQL and Redis apart (not in the total).

``--checkout PATH`` (repeatable) runs the system from that source tree (``PYTHONPATH``) instead of
this one, with this venv's libraries; given two or more, the runs alternate between them (before and
after in the same hour). The medians of each checkout's runs are printed as a Markdown table.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import psutil
import requests

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from support.procs import free_port  # noqa: E402
from voice_tools.footprint import pss_kib  # noqa: E402

TOKEN = "bench-footprint-token"
QUESTIONS = ("how do I reset my password", "what is the refund policy", "how to configure the API token",
             "where are the backups kept", "what are the Q3 sales figures", "how do I book a meeting room",
             "what is the vacation policy", "how to install on Linux", "who do I call for support",
             "what does the training cover")
ROLES = ("voice-tools run", "sh -c (the lines' shells)", "gunicorn master", "gunicorn worker (API)", "MCP",
         "worker main", "worker pool child", "Flower", "other")


def role(proc: psutil.Process, root: int) -> str:
    """What a process of the run is, from its command line and its parent's."""
    if proc.pid == root:
        return "voice-tools run"
    try:
        cmd = " ".join(proc.cmdline())
        parent = " ".join(proc.parent().cmdline()) if proc.parent() else ""
        parent = "" if parent.startswith("/bin/sh -c") else parent  # a line's shell is not its process
    except psutil.Error:
        return "other"
    if cmd.startswith("/bin/sh -c"):
        return "sh -c (the lines' shells)"
    if "gunicorn" in cmd:
        return "gunicorn worker (API)" if "gunicorn" in parent else "gunicorn master"
    if "voice-tools mcp" in cmd:
        return "MCP"
    if "celery" in cmd and "worker" in cmd:
        return "worker pool child" if "celery" in parent and "worker" in parent else "worker main"
    if "flower" in cmd:
        return "Flower"
    return "other"


def measure(root: int, data_dir: Path) -> dict[str, float]:
    """MB of PSS by role, ``total``, ``processes`` and ``embedded servers``."""
    tree = [psutil.Process(root), *psutil.Process(root).children(recursive=True)]
    by_role: dict[str, float] = defaultdict(float)
    for proc in tree:
        kib = pss_kib(proc.pid)
        if kib is not None:
            by_role[role(proc, root)] += kib / 1024
    by_role["total"] = sum(by_role[name] for name in ROLES)
    by_role["processes"] = len(tree)
    servers = 0.0
    for proc in psutil.process_iter(["name"]):
        try:
            if proc.info["name"] in ("postgres", "redis-server") and Path(proc.cwd()).is_relative_to(data_dir):
                servers += (pss_kib(proc.pid) or 0) / 1024
        except psutil.Error:
            continue
    by_role["embedded servers"] = servers
    return dict(by_role)


def wait_listening(port: int, timeout: float) -> None:
    """Wait until something listens on ``port`` (read from the kernel's table: nothing connects to it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(conn.laddr.port == port and conn.status == psutil.CONN_LISTEN
               for conn in psutil.net_connections(kind="tcp")):
            return
        time.sleep(0.5)
    raise TimeoutError(f"nothing listens on {port} after {timeout:.0f} s")


def use(api: str, mcp: str, env: dict[str, str], queries: int) -> None:
    """The demos, one MCP tool call, ``queries`` document searches."""
    played = subprocess.run([str(Path(sys.executable).with_name("voice-tools")), "demo", "--scenario", "all",
                             "--url", api, "--token", TOKEN], env=env, capture_output=True, text=True, timeout=300)
    if played.returncode != 0:
        raise RuntimeError(f"the demos failed: {played.stdout[-2000:]} {played.stderr[-2000:]}")
    auth = {"Authorization": f"Bearer {TOKEN}"}
    called = requests.post(mcp, timeout=120, headers={**auth, "Accept": "application/json, text/event-stream"},
                           json={"jsonrpc": "2.0", "id": 1, "method": "tools/call",
                                 "params": {"name": "list_tools", "arguments": {}}})
    if called.status_code != 200 or called.json().get("result", {}).get("isError"):
        raise RuntimeError(f"the MCP call failed: {called.status_code} {called.text[:500]}")
    with requests.Session() as http:
        for n in range(queries):
            done = http.post(f"{api}/voice-tools/execute?wait=30", headers=auth, timeout=60, json={
                "session_id": f"bench_footprint_{n // 10}", "function": "search_documentation",
                "parameters": {"query": f"{QUESTIONS[n % len(QUESTIONS)]} ({n})"}})
            if done.status_code != 200 or done.json()["status"] != "COMPLETED":
                raise RuntimeError(f"search {n} failed: {done.status_code} {done.text[:500]}")


def one_run(checkout: Path, settle: float, queries: int) -> dict[str, dict[str, float]]:
    data_dir = Path(tempfile.mkdtemp(prefix="voice-tools-footprint-"))
    port, mcp_port, flower_port, metrics_port = free_port(), free_port(), free_port(), free_port()
    env = {k: v for k, v in os.environ.items()
           if k not in ("DATABASE_URL", "REDIS_URL", "CELERY_BROKER_URL", "HOST")}
    env.update(VOICE_TOOLS_DATA_DIR=str(data_dir), PORT=str(port), MCP_PORT=str(mcp_port),
               FLOWER_PORT=str(flower_port), WORKER_METRICS_PORT=str(metrics_port),
               VOICE_TOOLS_API_TOKENS=f"bench:{TOKEN}", PYTHONPATH=str(checkout))
    log = open(data_dir.with_suffix(".log"), "wb")
    proc = subprocess.Popen([str(Path(sys.executable).with_name("voice-tools")), "run"], cwd=tempfile.gettempdir(),
                            env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    api = f"http://127.0.0.1:{port}"
    try:
        for listening in (port, mcp_port, flower_port, metrics_port):
            wait_listening(listening, 300)
        deadline = time.monotonic() + 120
        while requests.get(f"{api}/readyz", timeout=10, headers={"Authorization": f"Bearer {TOKEN}"}).status_code != 200:
            if time.monotonic() > deadline:
                raise TimeoutError("the API is not ready")
            time.sleep(1)
        time.sleep(settle)
        idle = measure(proc.pid, data_dir)
        use(api, f"http://127.0.0.1:{mcp_port}/mcp", env, queries)
        time.sleep(10)
        used = measure(proc.pid, data_dir)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
    return {"idle": idle, "used": used}


def table(results: dict[str, list[dict[str, dict[str, float]]]]) -> list[str]:
    names = list(results)
    head = "| PSS, MB (median of each checkout's runs) | " + " | ".join(
        f"{Path(name).name} idle | {Path(name).name} used" for name in names) + " |"
    lines = [head, "|---|" + "---|---|" * len(names)]
    for key in (*ROLES, "total", "processes", "embedded servers"):
        cells = []
        for name in names:
            for state in ("idle", "used"):
                values = [run[state].get(key, 0.0) for run in results[name]]
                cells.append(f"{statistics.median(values):.1f}" if key != "processes"
                             else f"{statistics.median(values):.0f}")
        if any(cell not in ("0.0", "0") for cell in cells):
            label = f"**{key}**" if key == "total" else key
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.footprint", description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=1, help="runs per checkout (alternating)")
    parser.add_argument("--settle", type=float, default=60.0, help="seconds idle before the idle measure")
    parser.add_argument("--queries", type=int, default=50, help="document searches after the demos")
    parser.add_argument("--checkout", action="append", type=Path, help="the source tree to run (default: this one)")
    parser.add_argument("--json", type=Path, help="write every run's figures here")
    args = parser.parse_args(argv)
    checkouts = [path.resolve() for path in (args.checkout or [ROOT])]
    results: dict[str, list[dict[str, dict[str, float]]]] = {str(path): [] for path in checkouts}
    for n in range(args.runs):
        for checkout in checkouts:
            started = time.strftime("%H:%M:%S", time.gmtime())
            run = one_run(checkout, args.settle, args.queries)
            results[str(checkout)].append(run)
            print(f"{started} UTC {checkout} run {n + 1}: idle {run['idle']['total']:.1f} MB "
                  f"({run['idle']['processes']:.0f} processes), used {run['used']['total']:.1f} MB; "
                  f"embedded servers {run['idle']['embedded servers']:.1f} / {run['used']['embedded servers']:.1f}",
                  flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    print("\n".join(table(results)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
