"""Requests over real HTTP, timed: one client after another, or 16 at once.

Every request is timed from before ``requests`` sends it to its whole answer read, on a
keep-alive ``requests.Session`` per client (a thread). The API and its floor are asked
alternately by the same client, so both see the same machine at the same moment.
"""
from __future__ import annotations

import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import requests

_local = threading.local()


def session() -> requests.Session:
    """This thread's keep-alive session."""
    if not hasattr(_local, "session"):
        _local.session = requests.Session()
    return _local.session


def call(method: str, url: str, expect: int, **kwargs: Any) -> tuple[float, Any]:
    """(seconds, JSON answer) of one request; AssertionError when the status is not ``expect``."""
    started = time.perf_counter()
    answer = session().request(method, url, timeout=60, **kwargs)
    elapsed = time.perf_counter() - started
    assert answer.status_code == expect, (method, url, answer.status_code, answer.text[:500])
    return elapsed, answer.json()


def summary(samples_s: list[float]) -> dict[str, float]:
    ms = sorted(s * 1000 for s in samples_s)
    q = statistics.quantiles(ms, n=100, method="inclusive")
    return {"n": len(ms), "p50": statistics.median(ms), "p95": q[94], "p99": q[98], "min": ms[0], "max": ms[-1]}


# A request maker: given the request's index, its sides' (seconds, answer) in a dict by side name.
Pair = Callable[[int], dict[str, float]]


def run_pairs(pair: Pair, requests_each: int, clients: int = 1, warmup: int = 0) -> dict[str, list[float]]:
    """``requests_each`` timed pairs per client (after ``warmup`` untimed), ``clients`` threads at once."""

    def client(c: int) -> dict[str, list[float]]:
        samples: dict[str, list[float]] = {}
        for i in range(warmup + requests_each):
            timed = pair(c * 1_000_000 + i)
            if i >= warmup:
                for side, seconds in timed.items():
                    samples.setdefault(side, []).append(seconds)
        return samples

    merged: dict[str, list[float]] = {}
    with ThreadPoolExecutor(clients) as pool:
        for samples in pool.map(client, range(clients)):
            for side, values in samples.items():
                merged.setdefault(side, []).extend(values)
    return merged


def throughput(start_one: Callable[[int], str], wait_all: Callable[[list[str]], None], n: int,
               clients: int) -> float:
    """Items per second: ``n`` items started by ``clients`` threads, until ``wait_all`` sees every one done."""
    started = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        keys = list(pool.map(start_one, range(n)))
    wait_all(keys)
    return n / (time.perf_counter() - started)
