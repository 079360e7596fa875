"""The bare side of the chain benchmark: Celery tasks that do nothing.

Loaded into the benchmark's worker with ``celery -A tasks worker --include bench.noop``.
The tasks have the same options as a chain link (acks late, reject on worker lost, no
result) and run on their own queue; the last one posts a signed event to the same
local receiver, over the same pooled HTTP session, as the engine's ``completed``
callback, so the two sides differ only by what the engine does in each link.
"""
from __future__ import annotations

import json
import time

from models import settings
from tasks import app, callback_http

QUEUE = "bench.noop"


@app.task(name="bench.noop", queue=QUEUE, ignore_result=True, acks_late=True, reject_on_worker_lost=True)
def noop(key: str, receiver_url: str | None = None) -> None:
    if receiver_url is None:
        return
    body = json.dumps({"tool_call_id": key, "event": "completed"}).encode()
    timestamp = str(int(time.time()))
    callback_http.http().post(receiver_url, data=body, timeout=5, headers={
        "Content-Type": "application/json",
        "X-Voice-Tools-Timestamp": timestamp,
        "X-Voice-Tools-Signature": callback_http.sign(settings.load().callback_secret, timestamp, body),
    }).raise_for_status()
