"""``voice-tools footprint``: the memory a running ``voice-tools run`` takes, per process and in all.

Memory is PSS (proportional set size, ``Pss`` in ``/proc/PID/smaps_rollup``): a page shared
by n processes counts 1/n in each, so the sum over processes is what the system takes
(RSS would count the pages a Celery pool child shares with its parent twice). The run is
the process tree of the ``voice-tools run`` holding the data dir's ``run.lock`` (its pid is
written there); the embedded PostgreSQL and Redis it started are daemons outside that tree,
counted apart (their working folder is in the data dir). Linux only.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import psutil

from voice_tools.servers import default_data_dir

RUN_LOCK = "run.lock"


def pss_kib(pid: int) -> int | None:
    """The process's PSS in KiB, or None if it is gone or not ours to read."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as rollup:
            for line in rollup:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def run_tree(data_dir: Path) -> list[psutil.Process]:
    """The running ``voice-tools run`` of ``data_dir`` and every process under it ([] if none runs)."""
    try:
        pid = int((data_dir / RUN_LOCK).read_text().strip() or 0)
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except (OSError, ValueError, psutil.Error):
        return []


def embedded_servers(data_dir: Path) -> list[psutil.Process]:
    """The embedded PostgreSQL and Redis processes of ``data_dir`` (known by their working folder)."""
    found = []
    for proc in psutil.process_iter(["name"]):
        try:
            if proc.info["name"] in ("postgres", "redis-server") and Path(proc.cwd()).is_relative_to(data_dir):
                found.append(proc)
        except psutil.Error:
            continue
    return found


def _command(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline()) or proc.name()
    except psutil.Error:
        return "?"


def report(procs: list[psutil.Process], title: str, width: int | None = None) -> list[str]:
    """A line per process (pid, PSS, its whole command line, or its first ``width`` characters), then the total."""
    lines, total, unreadable = [], 0, 0
    for proc in procs:
        kib = pss_kib(proc.pid)
        if kib is None:
            unreadable += 1
            continue
        total += kib
        command = _command(proc)
        lines.append(f"{proc.pid:>8} {kib / 1024:8.1f}  {command if not width else command[:width]}")
    tail = f" ({unreadable} not readable)" if unreadable else ""
    lines.append(f"{title}: {len(procs) - unreadable} processes, {total / 1024:.1f} MB PSS{tail}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="voice-tools footprint",
                                     description="The memory (PSS) of the running voice-tools run, per process.")
    parser.add_argument("--width", type=int, default=None,
                        help="show only this many characters of each command line (default: all of it: two "
                             "processes of one program may differ only at their ends)")
    args = parser.parse_args(argv)
    data_dir = default_data_dir()
    tree = run_tree(data_dir)
    if not tree:
        print(f"voice-tools footprint: no voice-tools run is using {data_dir}", flush=True)
        return 1
    print(f"{'pid':>8} {'PSS MB':>8}  command")
    for line in report(tree, "voice-tools run", args.width):
        print(line)
    for line in report(embedded_servers(data_dir), "embedded servers (PostgreSQL, Redis)", args.width):
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
