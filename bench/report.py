"""The benchmark's table and goals, from one run's samples (seconds) and rates (per second)."""
from __future__ import annotations

import statistics
from typing import Any

from bench.load import summary

READ4_LINKS = 4  # the 4-step read's steps: the bare chain has as many links

# (goal, how it is computed from the results, target, "max" or "min")
GOALS = (
    ("pending p50 vs floor (1 client)", lambda r: _ratio(r["api"]["1"]["pending"]), 1.2, "max"),
    ("confirm → checkpoint p50 vs bare 2-link chain", lambda r: _ratio(r["checkpoint"]), 1.3, "max"),
    ("confirm → completed p50 (4-step read) vs bare 4-link chain", lambda r: _ratio(r["read4"]), 1.3, "max"),
    ("the 4-step read's time beyond the bare chain, per link (ms)",
     lambda r: (r["read4"]["api"]["p50"] - r["read4"]["bare"]["p50"]) / READ4_LINKS, 1.5, "max"),
    ("calls/s vs bare chains/s (median of the blocks' ratios)", lambda r: _throughput_ratio(r["throughput"]), 0.8,
     "min"),
    ("context p50 at 100k calls vs floor", lambda r: _ratio(r["scale"]["context"]), 2.0, "max"),
    ("worst p99 / p50 at 16 clients (API)", lambda r: max(
        s["api"]["p99"] / s["api"]["p50"] for s in r["api"]["16"].values()), 5.0, "max"),
    ("context p50 at 16 clients vs floor (median of the blocks' ratios)",
     lambda r: r["blocks"]["context"]["median"], 1.2, "max"),
)


def _throughput_ratio(t: dict[str, Any]) -> float:
    """The median of the blocks' api / bare ratios (a run before blocks: its one ratio)."""
    if "blocks" not in t:
        return t["api"] / t["bare"]
    return statistics.median(block["api"] / block["bare"] for block in t["blocks"])


def _blocks_row(t: dict[str, Any]) -> str:
    api = ", ".join(f"{block['api']:.1f}" for block in t["blocks"])
    bare = ", ".join(f"{block['bare']:.1f}" for block in t["blocks"])
    ratios = ", ".join(f"{block['api'] / block['bare']:.2f}x" for block in t["blocks"])
    return (f"| the same, block by block (the sides in turn, their order reversed at every block) | {api} | {bare} "
            f"| {ratios}; median **{_throughput_ratio(t):.2f}x** |")


def _ratio(pair: dict[str, dict[str, float]]) -> float:
    return pair["api"]["p50"] / pair["bare"]["p50"]


def summarize(samples: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    return {side: summary(values) for side, values in samples.items()}


def blocks(taken: list[dict[str, Any]]) -> dict[str, Any]:
    """The blocks of one kind (``bench.load.run_blocks``): each pair of blocks' p50 ratio, their median and
    range, and the median CPU per request of each side's workers."""
    for one in taken:
        one["ratio"] = round(one["api"]["p50"] / one["bare"]["p50"], 3)
    ratios = [one["ratio"] for one in taken]
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios),
            "cpu_ms": {side: statistics.median(one[side]["cpu_ms"] for one in taken) for side in ("api", "bare")},
            "each": taken}


def goals(results: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for name, compute, target, kind in GOALS:
        value = compute(results)
        out.append({"goal": name, "value": round(value, 3), "target": target, "kind": kind,
                    "met": value <= target if kind == "max" else value >= target})
    return out


def _pair_row(name: str, pair: dict[str, dict[str, float]]) -> str:
    a, b = pair["api"], pair["bare"]
    return (f"| {name} | {a['n']} | {a['p50']:.2f} | {a['p99']:.2f} | {b['p50']:.2f} | {b['p99']:.2f} "
            f"| **{a['p50'] / b['p50']:.2f}x** |")


def table(results: dict[str, Any], header: list[str]) -> str:
    head = "| what | n | voice-tools p50 | p99 | floor p50 | p99 | p50 ratio |\n|---|---|---|---|---|---|---|"
    lines = [*header, "", "## API over HTTP (gunicorn, the Procfile's web line) against a bare Flask app doing "
             "the same statement (ms)", "", head]
    for clients in ("1", "16"):
        for endpoint, pair in results["api"][clients].items():
            lines.append(_pair_row(f"{endpoint}, {clients} client{'s' if clients != '1' else ''}", pair))
    seeded = results["scale"]["seeded"]
    for endpoint in ("context", "status"):
        lines.append(_pair_row(f"{endpoint}, {seeded['calls']:,} calls over {seeded['sessions']:,} sessions",
                               results["scale"][endpoint]))
    if "blocks" in results:
        lines += _block_rows(results["blocks"])
    lines += ["", "## Chains: confirm → callback at a local relay, against a plain Celery app's chain of as many "
              "links, each reading the status and writing the step in one statement, then posting its event (ms)",
              "", head]
    for name, pair in results["chains"].items():
        lines.append(_pair_row(name, pair))
    lines += ["", "The same chains against a second floor, bare links doing by hand the work every link must do "
              "(read the status; record the progress and insert the event row with its `seq` in one durable "
              "statement; post it; record the attempt after the next link is sent): what the engine costs beyond "
              "that work (for reading; no goal is set on it).",
              "", head]
    for name, pair in results["chains"].items():
        if "bare_recording" in pair:
            lines.append(_pair_row(f"{name}, floor recording", {"api": pair["api"], "bare": pair["bare_recording"]}))
    if "cpu" in results:
        lines += _cpu_rows(results["cpu"])
    t = results["throughput"]
    lines += ["", "## Throughput", "", "| what | voice-tools | bare | ratio |", "|---|---|---|---|",
              f"| {t['what']} | {t['api']:.1f}/s | {t['bare']:.1f}/s | **{t['api'] / t['bare']:.2f}x** |",
              *([f"| the same bare calls, links recording what every link must (`bench/noop.py`) "
                 f"| {t['api']:.1f}/s | {t['bare_recording']:.1f}/s | **{t['api'] / t['bare_recording']:.2f}x** "
                 f"(the recording floor itself: **{t['bare_recording'] / t['bare']:.2f}x** bare) |"]
                if "bare_recording" in t else []),
              *([_blocks_row(t)] if "blocks" in t else []),
              "", "## Goals (ratios of this run)", "", "| goal | measured | target | met |", "|---|---|---|---|"]
    for g in results["goals"]:
        sign = "≤" if g["kind"] == "max" else "≥"
        lines.append(f"| {g['goal']} | {g['value']:.2f} | {sign} {g['target']} | {'yes' if g['met'] else '**no**'} |")
    return "\n".join(lines) + "\n"


def _cpu_rows(cpu: dict[str, Any]) -> list[str]:
    """CPU time per call by process group (``bench/cpu.py``), the engine beside its floor."""
    api, bare, recording = cpu["api"], cpu["bare"], cpu.get("bare_recording")
    lines = ["", f"## CPU per call, by process group: {cpu['what']} (ms of user + system time; `bench/cpu.py`)", "",
             "| where | voice-tools | floor | difference | floor recording (the work every link must do) |",
             "|---|---|---|---|---|"]
    for group in api:
        extra = f"{recording[group]:.1f}" if recording else ""
        lines.append(f"| {group} | {api[group]:.1f} | {bare[group]:.1f} | {api[group] - bare[group]:+.1f} | {extra} |")
    total_api, total_bare = sum(api.values()), sum(bare.values())
    extra = f"**{sum(recording.values()):.1f}** (**{sum(recording.values()) / total_bare:.2f}x**)" if recording else ""
    lines.append(f"| **all** | **{total_api:.1f}** | **{total_bare:.1f}** | **{total_api - total_bare:+.1f}** "
                 f"(**{total_api / total_bare:.2f}x**) | {extra} |")
    return lines


def _block_rows(by_kind: dict[str, dict[str, Any]]) -> list[str]:
    """The 16-client rows block by block: how their connections were spread, and how their ratios scatter."""
    some = next(iter(by_kind.values()))["each"]
    lines = ["", f"The 16-client rows: {len(some)} blocks of each side, one side at a time (so that each meets 16 "
             "clients at once), the sides in turn and their order swapped at every block. Before each block every "
             "client opens its keep-alive connection, and only connections that leave the side's gunicorn workers "
             "as many clients each are kept, on the API and on its floor alike (a keep-alive connection stays "
             "with the worker that accepted it, and the kernel spreads them unevenly, anywhere from 8 and 8 to "
             "14 and 2); after the block every connection must still be there. The p50 ratio of each pair of blocks, the "
             "clients per worker, and the CPU time (user + system) of each side's gunicorn workers per request "
             "(ms; the warm-up requests included):", "",
             "| what | p50 ratio per pair of blocks | median (range) | clients per worker, voice-tools / floor "
             "| connections kept | CPU per request, voice-tools / floor (ms) |", "|---|---|---|---|---|---|"]
    for kind, taken in by_kind.items():
        each = taken["each"]
        spreads = sorted({"/".join(map(str, one["api"]["per_worker"])) + " / "
                          + "/".join(map(str, one["bare"]["per_worker"])) for one in each})
        kept = min(min(one["api"]["kept"], one["bare"]["kept"]) for one in each)
        clients = sum(each[0]["api"]["per_worker"])
        ratios = ", ".join(f"{one['ratio']:.2f}x" for one in each)
        cpu = taken["cpu_ms"]
        lines.append(f"| {kind}, 16 clients | {ratios} | **{taken['median']:.2f}x** ({taken['min']:.2f}–{taken['max']:.2f}) "
                     f"| {', '.join(spreads)} | {kept} of {clients}, each side "
                     f"| {cpu['api']:.2f} / {cpu['bare']:.2f} (**{cpu['api'] / cpu['bare']:.2f}x**) |")
    return lines
