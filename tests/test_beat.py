"""Beat with no single point of failure: any number of beats may send the sweeps, each sweep works
once per period (``sweep_runs``, models/sweep_runs.py), and when one beat dies another's sends go
on within a period. No beat keeps a schedule file."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
from celery import signals
from sqlalchemy import text

from models import db, settings
from support.procs import ROOT, kill_group
from tasks import sweeps
from tasks.calls import maintenance
from tests.tasklog import TaskLog

EVERY = 2.0  # the test's period of the expiry sweep
NAME = "maintenance.expire_stale"


def test_one_run_of_many_takes_a_period():
    """Eight runs racing for one period: one takes it; a send of the next period takes that one."""
    got: list = []
    start = threading.Barrier(8)
    sent_at = 3600.0 * 480_000 + 1234.5  # some moment, well inside its hour

    def race() -> None:
        start.wait()
        got.append(maintenance.claim_period("maintenance.test", 3600.0, at=sent_at + len(got), by="racer"))

    racers = [threading.Thread(target=race) for _ in range(8)]
    for racer in racers:
        racer.start()
    for racer in racers:
        racer.join(30)
    taken = [g for g in got if g is not None]
    assert len(got) == 8 and len(taken) == 1, got
    assert taken[0].timestamp() == 3600.0 * 480_000  # the period starts on a multiple of its length
    assert maintenance.claim_period("maintenance.test", 3600.0, at=sent_at + 3600) is not None
    assert maintenance.claim_period("maintenance.test", 3600.0, at=sent_at + 3599) is None
    # with no time given, the database's now
    now = maintenance.claim_period("maintenance.now", 60.0)
    assert now is not None and 0 <= time.time() - now.timestamp() < 60 + 5 and now.timestamp() % 60 == 0
    # a claim keeps a day of the sweep's periods before its own
    assert maintenance.claim_period("maintenance.test", 3600.0, at=sent_at + 86400 + 3600) is not None
    with db.session() as s:
        kept = s.scalars(text("SELECT period_start FROM sweep_runs WHERE sweep = 'maintenance.test' ORDER BY 1")).all()
    assert [k.timestamp() - 3600.0 * 480_000 for k in kept] == [3600.0, 86400.0 + 3600.0]


def test_a_sweep_sent_twice_in_a_period_works_once_and_one_sent_by_hand_always_works(worker):
    with TaskLog() as log:
        sent_at = time.time() // 3600 * 3600 + 1800  # the middle of this hour: both sends in it
        sweeps.expire_stale.apply_async(kwargs={"every": 3600.0, "sent_at": sent_at})
        sweeps.expire_stale.apply_async(kwargs={"every": 3600.0, "sent_at": sent_at + 0.5})
        sweeps.expire_stale.apply_async()
        runs = log.wait_ran(None, "maintenance.expire_stale", count=3)
    assert all(r.state == "SUCCESS" for r in runs)
    assert sorted(r.retval is None for r in runs) == [False, False, True]  # one of the two periodic ones skipped
    with db.session() as s:
        assert s.execute(text("SELECT count(*) FROM sweep_runs WHERE sweep = 'maintenance.expire_stale'")).scalar() == 1


def test_the_schedule_sends_each_sweep_with_its_period():
    from tasks import app

    schedule = app.conf.beat_schedule
    assert set(schedule) == set(settings.SWEEPS)
    for name, entry in schedule.items():
        assert entry["kwargs"]["every"] == entry["schedule"], name
        assert abs(entry["kwargs"]["sent_at"]() - time.time()) < 5  # the time of each send, taken at the send
    assert app.conf.beat_scheduler == "celery.beat:Scheduler"  # in memory: no schedule file


def _beat(cwd, env) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "celery", "-A", "tasks", "beat", "--loglevel", "INFO"],
                            cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                            start_new_session=True)


def _periods() -> list[float]:
    with db.session() as s:
        return [p.timestamp() for p in s.scalars(
            text("SELECT period_start FROM sweep_runs WHERE sweep = :s ORDER BY period_start"), {"s": NAME})]


@pytest.mark.slow
def test_two_beat_processes_sweep_once_per_period_and_one_left_keeps_sweeping(worker, tmp_path):
    """Two real ``celery -A tasks beat`` processes send the expiry sweep every 2 s to the test's
    worker: it works once in each period (one row per period in ``sweep_runs``, one run of the two
    sends), the other send skips. One beat SIGKILLed, the other's sends go on working: no period
    is missed from then on. Neither beat writes a file."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VOICE_TOOLS_EXPIRE_EVERY": str(EVERY),
           **{var: "3600" for sweep, (var, _) in settings.SWEEPS.items() if sweep != NAME}}
    runs: list[tuple[float, object]] = []  # (when it ended, what it returned: None when it skipped)

    def ran(sender=None, retval=None, **_):
        if sender is not None and sender.name == NAME:
            runs.append((time.time(), retval))

    signals.task_postrun.connect(ran, weak=False)
    beats = []
    try:
        for i in (1, 2):
            (tmp_path / f"beat-{i}").mkdir()
            beats.append(_beat(tmp_path / f"beat-{i}", env))
        deadline = time.monotonic() + 90
        while len(_periods()) < 6 and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(EVERY / 2)  # the later send of the last period has run too
        both, sent_by_both = _periods(), list(runs)
        assert len(both) >= 6, f"the sweep worked in {len(both)} periods in 90 s"
        worked = [at for at, retval in sent_by_both if retval is not None]
        skipped = [at for at, retval in sent_by_both if retval is None]
        # one run worked per period, each its own row; the other beat's send of each period skipped
        assert len(worked) == len(both)
        assert len(skipped) >= len(worked) - 2, (len(worked), len(skipped))
        assert all(b - a == EVERY for a, b in zip(both, both[1:])), both  # consecutive: none missed

        kill_group(beats[0], [])
        killed_at = time.time()
        time.sleep(5 * EVERY + EVERY / 2)
        assert beats[1].poll() is None
        after = [(at, retval) for at, retval in runs if at > killed_at]
        worked_after = [at for at, retval in after if retval is not None]
        # the beat left works every send: at least four periods, none skipped (no second send) but
        # perhaps one, of the period whose first send the killed beat made just before it died
        assert len(worked_after) >= 4 and len(after) - len(worked_after) <= 1, after
        every_worked = [at for at, retval in runs if retval is not None]
        # it took over within a period: no gap between worked runs, across the kill too, above two periods
        gaps = [b - a for a, b in zip(every_worked, every_worked[1:])]
        assert max(gaps) < 2 * EVERY + 0.5, gaps
        kill_group(beats[1], [])  # no more sends: a sweep that claimed its period has also ended its run
        time.sleep(EVERY / 2)
        every_worked = [at for at, retval in runs if retval is not None]
        assert len(_periods()) == len(every_worked)
    finally:
        signals.task_postrun.disconnect(ran)
        for beat in beats:
            if beat.poll() is None:
                kill_group(beat, [])
    # beat keeps its schedule in memory: nothing written where either ran
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == ["beat-1", "beat-2"]
