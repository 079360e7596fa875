"""``python -m bench --smoke`` runs end to end: the Procfile's processes and their floors start,
every measure is taken, and the results are written (so the benchmark keeps working as
the code changes). It asserts no time: only that each measure has its samples, and (inside
the bench) that the recording floor recorded the events it stands for and the relay got
only good signatures.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from bench.cpu import GROUPS
from support.procs import ROOT, bare_env

pytestmark = pytest.mark.slow  # the benchmark's processes, end to end


def test_the_benchmark_runs_end_to_end(tmp_path):
    # its own embedded servers (the bench seeds calls and purges queues) and its own settings: not the suite's
    env = {key: value for key, value in bare_env().items()
           if not key.startswith("VOICE_TOOLS_") and key != "PROMETHEUS_MULTIPROC_DIR"}
    done = subprocess.run([sys.executable, "-m", "bench", "--smoke", "--results", str(tmp_path)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    [written] = tmp_path.glob("*.json")
    run = json.loads(written.read_text())
    results = run["results"]
    assert run["command"] == "python -m bench --smoke"

    for clients in ("1", "16"):
        assert set(results["api"][clients]) == {"pending", "confirm", "status", "context"}
        for pair in results["api"][clients].values():
            assert pair["api"]["n"] == pair["bare"]["n"] > 0 and pair["api"]["p50"] > 0 < pair["bare"]["p50"]
    for name, blocks in results["blocks"].items():  # 16 clients on one side at a time, 8 on each of its 2 workers
        assert blocks["each"] and all(block[side]["per_worker"] == [8, 8] and block[side]["kept"] == 16
                                      for block in blocks["each"] for side in ("api", "bare")), (name, blocks)
    assert set(results["blocks"]) == {"pending", "confirm", "status", "context"}
    assert len(results["chains"]) == 2  # send_email to its checkpoint, the 4-step read tool
    for chain in results["chains"].values():
        assert set(chain) == {"api", "bare", "bare_recording"}
        assert all(side["n"] == 3 and side["p50"] > 0 for side in chain.values())
    for side in ("api", "bare", "bare_recording"):  # (a group may read 0: the kernel counts in 10 ms ticks)
        cpu = results["cpu"][side]
        assert set(cpu) == set(GROUPS) and cpu["workers"] > 0 and min(cpu.values()) >= 0, cpu
    assert all(results["throughput"][side] > 0 for side in ("api", "bare", "bare_recording"))
    assert len(results["throughput"]["blocks"]) == 2 and all(  # each side in each block, in turn
        set(block) == {"api", "bare", "bare_recording"} and min(block.values()) > 0
        for block in results["throughput"]["blocks"])
    assert "the same, block by block" in run["table"]
    assert results["scale"]["seeded"] == {"calls": 2000, "sessions": 200, "seconds": results["scale"]["seeded"]["seconds"]}
    assert [goal["goal"] for goal in results["goals"]][:1] == ["pending p50 vs floor (1 client)"]
    assert "## CPU per call, by process group" in run["table"]


def test_the_capacity_figures_are_measured_end_to_end(tmp_path):
    """``python -m bench.capacity`` with 2 calls of each kind: every kind has its figures, from outside."""
    env = {key: value for key, value in bare_env().items()
           if not key.startswith("VOICE_TOOLS_") and key != "PROMETHEUS_MULTIPROC_DIR"}
    done = subprocess.run([sys.executable, "-m", "bench.capacity", "--calls", "2", "--settle", "1", "--results", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    [written] = tmp_path.glob("capacity-*.json")
    run = json.loads(written.read_text())
    assert run["command"] == "python -m bench.capacity --calls 2 --settle 1" and run["calls"] == 2
    results = run["results"]
    assert set(results) == {"send_email", "get_calendar_availability", "search_contacts", "status", "context",
                            "idle (per second)"}
    for kind in ("send_email", "get_calendar_availability", "search_contacts"):
        row = results[kind]
        # a call writes: transactions, WAL, a tool_calls row, and broker messages (a chain's links)
        assert row["write_xacts"] >= 1 and row["wal_bytes"] > 0 and row["redis_lpush"] >= 1, (kind, row)
        assert set(row["cpu_ms"]) == set(GROUPS) and min(row["cpu_ms"].values()) >= 0, (kind, row)
        assert row["table_bytes_total"] >= 0
    assert "## Per call (idle rate subtracted)" in run["table"]


@pytest.mark.parametrize("by_hand", ["## Document search and ingest (by hand)\n\nSome figures.\n"])
def test_a_full_run_keeps_every_section_it_did_not_write(by_hand):
    """RESULTS.md holds the run's tables and sections written otherwise (``bench.stream``'s, and measurements
    made by hand): a full run replaces its own tables and keeps the others, in their order."""
    from bench.run import results_markdown

    current = ("# voice-tools benchmark\n\n- measured before\n\n## Goals (ratios of this run)\n\nold goals\n\n"
               "## Event streams: 1,000 open on one API process\n\nstream figures\n\n" + by_hand)
    text = "# voice-tools benchmark\n\n- measured now\n\n## Goals (ratios of this run)\n\nnew goals\n"
    merged = results_markdown(text, current)
    assert merged.startswith(text.rstrip("\n"))
    assert "old goals" not in merged and "- measured before" not in merged
    assert merged.index("## Event streams") < merged.index("## Document search and ingest (by hand)")
    assert merged.endswith("stream figures\n\n" + by_hand)


def test_the_console_tabs_cpu_is_measured_end_to_end(tmp_path):
    """``python -m bench.console_cpu`` with one short round: each phase has its figures, read from the
    browser's processes, and the live list showed the calls recorded meanwhile (it fails otherwise)."""
    from bench.console_cpu import KINDS, PHASES
    from support import browser

    if not browser.installed():
        if os.environ.get("CI") == "true":
            raise RuntimeError("CI: the console's CPU bench needs Debian's chromium and chromium-driver")
        pytest.skip("chromium and chromium-driver are not installed")
    env = {key: value for key, value in bare_env().items()
           if not key.startswith("VOICE_TOOLS_") and key != "PROMETHEUS_MULTIPROC_DIR"}
    done = subprocess.run([sys.executable, "-m", "bench.console_cpu", "--seconds", "2", "--rounds", "1", "--settle", "0.5",
                           "--held", "50",
                           "--results", str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    [written] = tmp_path.glob("console-cpu-*.json")
    run = json.loads(written.read_text())
    assert run["command"].startswith("python -m bench.console_cpu --seconds 2 --rounds 1")
    assert set(run["results"]) == set(PHASES)
    for phase, rounds in run["results"].items():
        [figures] = rounds
        assert set(figures["by_kind"]) == set(KINDS) and min(figures["by_kind"].values()) >= 0, (phase, figures)
        assert figures["browser_total"] >= 0 and figures["web"] >= 0
    assert run["results"]["live"][0]["calls_shown"] >= 1 and run["results"]["live"][0]["browser_total"] > 0
    assert "## The console tab's CPU" in run["table"]
