"""Requests over real HTTP, timed: one client after another, or 16 at once.

Every request is timed from before ``requests`` sends it to its whole answer read, on a
keep-alive ``requests.Session`` per client (a thread) and server. One client asks the API and its
floor alternately (:func:`pair_of`), so both see the same machine at the same moment; 16 clients
ask one side at a time, in blocks of each side in turn (:func:`run_blocks`), so each side meets
16 clients at once.

Under gunicorn a keep-alive connection stays with the worker that accepted it, and the kernel
spreads connections over the workers unevenly (16 clients over 2 workers land anywhere from 8/8
to 14/2, on each side independently): a side whose clients crowd one worker waits on that
process while the other idles. So :func:`run_pairs`, given the servers' workers, first opens
each client's connection to every server and keeps only connections that leave every server's
workers holding the same number of clients (:func:`open_evenly`; 8 and 8 for 16 clients on 2
workers, on the API and on its floor alike), and afterwards checks that every connection lasted
through the block.
"""
from __future__ import annotations

import math
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable
from urllib.parse import urlsplit

import psutil
import requests

_local = threading.local()


def base_of(url: str) -> str:
    """``scheme://host:port`` of ``url``: the server it asks."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}"


def session(url: str) -> requests.Session:
    """This thread's keep-alive session to the server of ``url`` (one connection per client and server)."""
    sessions = _local.__dict__.setdefault("sessions", {})
    base = base_of(url)
    if base not in sessions:
        sessions[base] = requests.Session()
    return sessions[base]


def call(method: str, url: str, expect: int, **kwargs: Any) -> tuple[float, Any]:
    """(seconds, JSON answer) of one request; AssertionError when the status is not ``expect``."""
    started = time.perf_counter()
    answer = session(url).request(method, url, timeout=60, **kwargs)
    elapsed = time.perf_counter() - started
    assert answer.status_code == expect, (method, url, answer.status_code, answer.text[:500])
    return elapsed, answer.json()


def summary(samples_s: list[float]) -> dict[str, float]:
    ms = sorted(s * 1000 for s in samples_s)
    q = statistics.quantiles(ms, n=100, method="inclusive")
    return {"n": len(ms), "p50": statistics.median(ms), "p95": q[94], "p99": q[98], "min": ms[0], "max": ms[-1]}


# One timed request of one side: given the request's index, its seconds.
Side = Callable[[int], float]
# A request maker: given the request's index, its sides' seconds in a dict by side name.
Pair = Callable[[int], dict[str, float]]


def pair_of(sides: dict[str, Side]) -> Pair:
    """Each side asked in turn by the same client: both see the same machine at the same moment."""
    return lambda i: {name: side(i) for name, side in sides.items()}


# A server's workers: worker pid -> the client ports of the connections it holds open (``Stack.holders``).
Holders = Callable[[], dict[int, set[int]]]


class Spread:
    """Each client's keep-alive connection to each server, and the worker that holds it."""

    def __init__(self, servers: dict[str, Holders], clients: int):
        self.servers = servers
        self.clients = clients
        self.sessions: list[dict[str, requests.Session]] = [{} for _ in range(clients)]
        self.ports: dict[str, list[int]] = {base: [0] * clients for base in servers}
        self.worker: dict[str, list[int]] = {base: [0] * clients for base in servers}

    def per_worker(self, base: str) -> list[int]:
        """How many of the clients each worker of ``base`` holds, most first."""
        workers = self.servers[base]()
        return sorted((sum(1 for w in self.worker[base] if w == pid) for pid in workers), reverse=True)

    def kept(self) -> dict[str, int]:
        """By server: how many clients still hold the connection opened for them, on the same worker."""
        out = {}
        for base, holders in self.servers.items():
            held = holders()
            out[base] = sum(1 for port, pid in zip(self.ports[base], self.worker[base]) if port in held.get(pid, ()))
        return out

    def close(self) -> None:
        for sessions in self.sessions:
            for s in sessions.values():
                s.close()


def _open(base: str) -> tuple[requests.Session, int]:
    """A session holding one new keep-alive connection to ``base`` (opened by a ``/healthz``), and the
    connection's local port."""
    s = requests.Session()
    answer = s.get(f"{base}/healthz", timeout=10, stream=True)
    port = answer.raw.connection.sock.getsockname()[1]
    assert answer.status_code == 200 and answer.content
    return s, port


def open_evenly(servers: dict[str, Holders], clients: int, tries: int = 10, rounds: int = 50,
                idle_s: float = 0.5) -> Spread:
    """One keep-alive connection of each client to each server, such that every worker of a server holds
    as many of them as the others (at most one more where they do not divide). The connections still
    missing are opened together, each one's worker found by its port; one to a worker holding its share
    already is closed, and the missing ones opened again, up to ``rounds`` times. gunicorn closes a
    connection idle for its keep-alive (2 s): those kept are used again once idle for ``idle_s``
    meanwhile, and all once more at the end, when every one must still be where it was opened
    (otherwise all again, up to ``tries`` times)."""
    for _attempt in range(tries):
        spread = Spread(servers, clients)
        used: dict[tuple[int, str], float] = {}

        def use(c: int, base: str) -> None:
            assert spread.sessions[c][base].get(f"{base}/healthz", timeout=10).status_code == 200
            used[c, base] = time.monotonic()

        def keep_alive() -> None:
            for (c, base), last in list(used.items()):
                if time.monotonic() - last > idle_s:
                    use(c, base)

        with ThreadPoolExecutor(clients) as pool:
            for base, holders in servers.items():
                share = math.ceil(clients / len(holders()))
                taken: dict[int, int] = {}
                for _round in range(rounds):
                    missing = [c for c in range(clients) if base not in spread.sessions[c]]
                    if not missing:
                        break
                    keep_alive()
                    opened = list(pool.map(lambda _c: _open(base), missing))
                    worker_of = {port: pid for pid, ports in holders().items() for port in ports}
                    for c, (s, port) in zip(missing, opened):
                        pid = worker_of.get(port)
                        if pid is not None and taken.get(pid, 0) < share:
                            taken[pid] = taken.get(pid, 0) + 1
                            spread.sessions[c][base], spread.ports[base][c], spread.worker[base][c] = s, port, pid
                            used[c, base] = time.monotonic()
                        else:
                            s.close()
                else:
                    raise RuntimeError(f"{base}: its workers did not take {share} connections each in {rounds} rounds")
        for c, base in list(used):
            use(c, base)
        if all(kept == clients for kept in spread.kept().values()):
            return spread
        spread.close()
    raise RuntimeError(f"the connections did not stay where they were opened in {tries} tries")


def run_pairs(pair: Pair, requests_each: int, clients: int = 1, warmup: int = 0,
              servers: dict[str, Holders] | None = None, spread: dict[str, Any] | None = None,
              first: int = 0) -> dict[str, list[float]]:
    """``requests_each`` timed pairs per client (after ``warmup`` untimed), ``clients`` threads at once;
    client ``c``'s ``i``-th pair is ``pair(first + c * 1_000_000 + i)``.

    With ``servers`` (base URL -> its workers' :data:`Holders`), the clients' connections are opened first,
    evenly over each server's workers (:func:`open_evenly`), and ``spread`` (a dict, when given) gets by
    base URL: the clients each worker held (``per_worker``), how many connections lasted the block
    (``kept``), and the CPU time (user + system) of the server's workers per pair (``cpu_ms``: the
    warm-up pairs' included, the ``/healthz`` opening the connections not)."""
    opened = open_evenly(servers, clients) if servers else None
    cpu_before = {base: _cpu(holders()) for base, holders in servers.items()} if servers else {}

    def client(c: int) -> dict[str, list[float]]:
        if opened is not None:
            _local.sessions = dict(opened.sessions[c])
        samples: dict[str, list[float]] = {}
        for i in range(warmup + requests_each):
            timed = pair(first + c * 1_000_000 + i)
            if i >= warmup:
                for side, seconds in timed.items():
                    samples.setdefault(side, []).append(seconds)
        return samples

    merged: dict[str, list[float]] = {}
    with ThreadPoolExecutor(clients) as pool:
        for samples in pool.map(client, range(clients)):
            for side, values in samples.items():
                merged.setdefault(side, []).extend(values)
    if opened is not None and servers:
        pairs = clients * (warmup + requests_each)
        cpu_ms = {base: (_cpu(holders()) - cpu_before[base]) * 1000 / pairs for base, holders in servers.items()}
        kept = opened.kept()
        if spread is not None:
            spread.update({base: {"per_worker": opened.per_worker(base), "kept": kept[base],
                                  "cpu_ms": round(cpu_ms[base], 3)} for base in servers})
        opened.close()
    return merged


def run_blocks(sides: dict[str, Side], servers: dict[str, tuple[str, Holders]], requests_each: int,
               clients: int, blocks: int, warmup: int = 0) -> tuple[dict[str, list[float]], list[dict[str, Any]]]:
    """``blocks`` blocks of each side, in turn, the order swapped at every block (api, bare, bare, api ...):
    in a side's block ``clients`` threads ask that side only, so each side meets the same number of
    clients at once, whatever the other costs (asked in turn by the same clients, the slower side would
    hold more of them). Each block is :func:`run_pairs` of one side, its connections opened evenly over the
    side's workers (``servers``: by side, its base URL and :data:`Holders`). Returns every side's samples,
    and by block, each side's ``p50`` (seconds) with its :func:`run_pairs` ``spread``."""
    samples: dict[str, list[float]] = {name: [] for name in sides}
    taken: list[dict[str, Any]] = []
    names = list(sides)
    for block in range(blocks):
        one: dict[str, Any] = {}
        for name in names if block % 2 == 0 else names[::-1]:
            base, holders = servers[name]
            spread: dict[str, Any] = {}
            side = sides[name]
            got = run_pairs(lambda i, side=side, name=name: {name: side(i)}, requests_each, clients, warmup,
                            servers={base: holders}, spread=spread, first=block * 100_000_000)[name]
            samples[name].extend(got)
            one[name] = {"p50": statistics.median(got), **spread[base]}
        taken.append(one)
    return samples, taken


def _cpu(workers: dict[int, set[int]]) -> float:
    """CPU seconds (user + system) so far of the processes ``workers`` names."""
    total = 0.0
    for pid in workers:
        try:
            times = psutil.Process(pid).cpu_times()
            total += times.user + times.system
        except psutil.Error:
            pass
    return total


def throughput(start_one: Callable[[int], str], wait_all: Callable[[list[str]], None], n: int,
               clients: int) -> float:
    """Items per second: ``n`` items started by ``clients`` threads, until ``wait_all`` sees every one done."""
    started = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        keys = list(pool.map(start_one, range(n)))
    wait_all(keys)
    return n / (time.perf_counter() - started)


def throughput_blocks(sides: dict[str, tuple[Callable[[int], str], Callable[[list[str]], None]]], n: int,
                      clients: int, blocks: int) -> dict[str, Any]:
    """:func:`throughput` of each side in ``blocks`` blocks of ``n // blocks`` items, the sides in turn and
    their order reversed at every block, so that each pair of blocks meets the machine as it is then (a
    shared machine's pace moves by a fifth from one minute to the next). Returns each side's rate over
    all its blocks, and by block, each side's rate."""
    each = max(1, n // blocks)
    names = list(sides)
    taken: list[dict[str, float]] = []
    seconds = {name: 0.0 for name in names}
    for block in range(blocks):
        one: dict[str, float] = {}
        for name in names if block % 2 == 0 else names[::-1]:
            start_one, wait_all = sides[name]
            rate = throughput(start_one, wait_all, each, clients)
            one[name] = rate
            seconds[name] += each / rate
        taken.append(one)
    return {**{name: each * blocks / seconds[name] for name in names}, "blocks": taken}
