"""The bare side of the chain benchmark: Celery tasks doing what a link observably does, and no more.

Loaded into the benchmark's worker with ``celery -A tasks worker --include bench.noop``.
The tasks have the same options as a chain link (acks late, reject on worker lost, no
result) and run on their own queue. Each link reads its call's status (one ``SELECT``,
autocommit, on the same engine: what a link's gate reads) and, given a receiver, posts
one signed event to it over the same pooled HTTP session as the engine's callbacks
(``progress`` from each link but the last, then ``completed`` or ``checkpoint``), so the
two sides differ only by what the engine does in each link beyond that.

``write=True`` makes a second floor: each link writes its call instead of reading it (one
``UPDATE … RETURNING status``, committed with the flush to disk a link's own record waits
for), so a chain's ratio to it is what the engine costs beyond one durable write per link.
"""
from __future__ import annotations

import json
import time

from sqlalchemy import bindparam, select, update

from models import db, settings
from models.calls import ToolCall
from tasks import app, callback_http

QUEUE = "bench.noop"
_STATUS = select(ToolCall.status).where(ToolCall.tool_call_id == bindparam("p_id"))
_WRITE = (update(ToolCall).where(ToolCall.tool_call_id == bindparam("p_id"))
          .values(progress=bindparam("p_progress")).returning(ToolCall.status))


@app.task(name="bench.noop", queue=QUEUE, ignore_result=True, acks_late=True, reject_on_worker_lost=True)
def noop(key: str, receiver_url: str | None = None, event: str = "completed", write: bool = False) -> None:
    with db.statement() as conn:
        if write:
            conn.execute(_WRITE, {"p_id": key, "p_progress": 1.0 if event != "progress" else 0.5}).one_or_none()
        else:
            conn.execute(_STATUS, {"p_id": key}).one_or_none()
    if receiver_url is None:
        return
    body = json.dumps({"tool_call_id": key, "event": event}).encode()
    timestamp = str(int(time.time()))
    callback_http.http().post(receiver_url, data=body, timeout=5, headers={
        "Content-Type": "application/json",
        "X-Voice-Tools-Timestamp": timestamp,
        "X-Voice-Tools-Signature": callback_http.sign(settings.load().callback_secret, timestamp, body),
    }).raise_for_status()


def chain_of(key: str, links: int, receiver_url: str | None, until: str = "completed", write: bool = False) -> object:
    """A bare chain of ``links`` links for ``key``: each posts ``progress``, the last ``until``."""
    from celery import chain

    return chain(*[noop.si(key, receiver_url, "progress", write) for _ in range(links - 1)],
                 noop.si(key, receiver_url, until, write))
