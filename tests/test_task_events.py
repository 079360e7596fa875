"""Celery's task events (what Flower shows) are still published, from a thread of each process
(tasks/worker/task_events.py): every link of a chain is seen sent, received, started and succeeded."""
from __future__ import annotations

import socket
import threading
import time

from tasks import app, tools
from tasks.calls import actions
from tests.helpers import make_call, wait_status


def test_every_link_is_seen_sent_received_started_and_succeeded(worker):
    seen: list[dict] = []
    listening = threading.Event()
    stop = threading.Event()

    def listen() -> None:
        with app.connection_for_read() as conn:
            receiver = app.events.Receiver(conn, handlers={"*": seen.append})
            receiver.on_consume_ready = lambda *_, **__: listening.set()
            receiver.should_stop = False
            stopper = threading.Thread(target=lambda: (stop.wait(), setattr(receiver, "should_stop", True)),
                                       daemon=True)
            stopper.start()
            receiver.capture(limit=None, timeout=None, wakeup=False)

    thread = threading.Thread(target=listen, daemon=True)
    thread.start()
    assert listening.wait(10)
    call = make_call()
    actions.confirm(call.tool_call_id)
    assert wait_status(call.tool_call_id, "PREPARED").status == "PREPARED"
    ran = [step.name for step in tools.TOOLS["send_email"].steps[:1]]  # the links up to the checkpoint
    names = {f"tools.send_email.{step}" for step in ran}

    def kinds() -> dict[str, set[str]]:
        found: dict[str, set[str]] = {}
        by_id = {e["uuid"]: e.get("name") for e in seen if e.get("type") in ("task-sent", "task-received")}
        for event in seen:
            name = by_id.get(event.get("uuid"))
            if name in names:
                found.setdefault(name, set()).add(event["type"])
        return found

    wanted = {"task-sent", "task-received", "task-started", "task-succeeded"}
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not all(wanted <= kinds().get(name, set()) for name in names):
        time.sleep(0.1)
    stop.set()
    thread.join(5)
    assert all(wanted <= kinds().get(name, set()) for name in names), kinds()


def test_the_events_of_a_moment_are_published_in_one_pipeline():
    """Ten events put 5 ms apart (a link's four, and the next link's) are published together: one
    batch (one pipeline on Redis), not one per event, and they arrive in their order."""
    from celery.events import Event

    from tasks.worker import task_events

    dispatcher = app.events.Dispatcher(enabled=True)
    publisher = task_events._Publisher(app)
    received: list[str] = []
    listening, stop = threading.Event(), threading.Event()

    def listen() -> None:
        with app.connection_for_read() as conn:
            receiver = app.events.Receiver(conn, handlers={
                "task-succeeded": lambda e: received.append(e["uuid"]) if e["hostname"] == "moment" else None})
            receiver.on_consume_ready = lambda *_, **__: listening.set()
            threading.Thread(target=lambda: (stop.wait(), setattr(receiver, "should_stop", True)), daemon=True).start()
            receiver.capture(limit=None, timeout=None, wakeup=False)

    thread = threading.Thread(target=listen, daemon=True)
    thread.start()
    assert listening.wait(10)
    # The ten puts must fall within the publisher's wait (0.1 s) for the promise to apply: on a loaded machine
    # 5 ms sleeps can stretch past it, and then the round is put again (its events received all the same).
    spans: list[float] = []
    for round_ in range(5):
        received.clear()
        before = publisher.batches
        started = time.monotonic()
        for i in range(10):
            publisher.put((Event("task-succeeded", uuid=f"moment-{i}", hostname="moment", clock=i, pid=1),
                           "task.succeeded", dispatcher.exchange, dispatcher.serializer, dispatcher.headers,
                           dispatcher.delivery_mode))
            if i < 9:
                time.sleep(0.005)
        spans.append(time.monotonic() - started)
        assert publisher.drain(5)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and len(received) < 10:
            time.sleep(0.05)
        assert received == [f"moment-{i}" for i in range(10)]
        if spans[-1] < task_events.LINGER_S * 0.8:
            break
    stop.set()
    thread.join(5)
    dispatcher.close()
    assert spans[-1] < task_events.LINGER_S * 0.8, f"the puts took {spans} s: the machine is too loaded to tell"
    assert publisher.batches - before == 1, f"{publisher.batches - before} batches for ten events put in {spans[-1]:.3f} s"
