"""CPU time per call, by process group: where a chain's ratio to its floor comes from.

On a machine with few cores a sequential chain is bound by CPU as much as by round
trips, so its ratio to the bare chain follows the ratio of the CPU both spend. A block of
calls of one side runs alone (not alternating with the other side), and the user + system
time every process spent meanwhile is read from the kernel (``psutil``) before and after:

- ``API (gunicorn)``: the side's web line (``web`` or ``bare_web``) and its workers;
- ``workers``: the side's worker lines and their pool children (``writes``, ``reads``,
  ``callbacks``; or ``bare``);
- ``PostgreSQL``, ``Redis``: every process of that name on the machine (the servers are
  shared by both sides: the other side is idle meanwhile);
- ``bench (client, relay)``: this process, which sends the requests and receives the callbacks.

Wall-clock time varies by a third from one minute to the next on a shared virtual
machine; CPU time per call varies much less, so this table says which part of the
engine costs what, and how much of it is beyond the floor.
"""
from __future__ import annotations

import os
from typing import Any, Callable

import psutil

GROUPS = ("API (gunicorn)", "workers", "PostgreSQL", "Redis", "bench (client, relay)")
BARE = {"API (gunicorn)": ("bare_web",), "workers": ("bare",)}
SIDES = {"api": {"API (gunicorn)": ("web",), "workers": ("writes", "reads", "callbacks")},
         "bare": BARE, "bare_recording": BARE}


def _cpu(process: psutil.Process) -> float:
    try:
        times = process.cpu_times()
        return times.user + times.system
    except psutil.Error:
        return 0.0


def _family(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def snapshot(stack: Any, side: str, servers: dict[str, int] | None = None) -> dict[str, dict[int, float]]:
    """CPU seconds so far of each process of each group, by pid (a process that ends is dropped).

    ``servers`` (``{"PostgreSQL": postmaster pid, "Redis": server pid}``) counts those servers'
    process families only, instead of every process of that name on the machine."""
    taken: dict[str, dict[int, float]] = {group: {} for group in GROUPS}
    for group, names in SIDES[side].items():
        for name in names:
            for process in _family(stack.procs[name].pid):
                taken[group][process.pid] = _cpu(process)
    if servers:
        for group, pid in servers.items():
            for process in _family(pid):
                taken[group][process.pid] = _cpu(process)
        taken["bench (client, relay)"][os.getpid()] = _cpu(psutil.Process())
        return taken
    for process in psutil.process_iter(["name"]):
        name = process.info["name"] or ""
        group = "PostgreSQL" if name.startswith("postgres") else "Redis" if name.startswith("redis") else None
        if group:
            taken[group][process.pid] = _cpu(process)
    taken["bench (client, relay)"][os.getpid()] = _cpu(psutil.Process())
    return taken


def _spent(before: dict[str, dict[int, float]], after: dict[str, dict[int, float]]) -> dict[str, float]:
    """Seconds spent by each group between two snapshots (processes started meanwhile count from 0)."""
    return {group: sum(seconds - before[group].get(pid, 0.0) for pid, seconds in after[group].items())
            for group in GROUPS}


def per_call(stack: Any, sides: dict[str, Callable[[], Any]], calls: int, blocks: int = 2) -> dict[str, dict[str, float]]:
    """Milliseconds of CPU per call of each side (``{"api": one call, "bare": one call, ...}``), by group.

    ``blocks`` blocks of ``calls`` calls per side, in turn (api, bare, api, bare ...).
    """
    spent = {side: {group: 0.0 for group in GROUPS} for side in sides}
    for _ in range(blocks):
        for side, one_call in sides.items():
            before = snapshot(stack, side)
            for _ in range(calls):
                one_call()
            after = snapshot(stack, side)
            for group, seconds in _spent(before, after).items():
                spent[side][group] += seconds
    return {side: {group: round(seconds * 1000 / (calls * blocks), 2) for group, seconds in by_group.items()}
            for side, by_group in spent.items()}
