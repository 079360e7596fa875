"""Sessions of a relay driving send_email calls through the HTTP API, for the load and fault runs.

Each session makes ``ops`` operations drawn at random from :data:`OPERATIONS` on its
latest call (recording one first when the operation needs it): record it (pending),
correct it (modify), confirm it (``?wait`` for its checkpoint), proceed at the
checkpoint (resume), cancel it, or have the relay answer ``{"cancel": true}`` to its
next cancellable event (relay_cancel, then confirmed so that the event comes). Every
call has the relay's URL as ``callback_url``.

Every answer is recorded (operation, HTTP status, when the request started); an
answer outside :data:`EXPECTED` (a 5xx, a 4xx other than a lost race's 409, a request
that got no answer) is a problem, except a 503 inside a fault's window (the database
or the broker down: the API says so, docs/relay-guide.md, Errors). A ``?wait`` past the
caller's open share is told 429 ``too_many_open``, having done nothing; the relay sends it
again after ``Retry-After``, as the relay guide says, and counts it (``pauses``).
The calls whose cancel answered 200 are kept for :func:`tests.invariants.check`.
"""
from __future__ import annotations

import random
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import requests

OPERATIONS = ("pending", "modify", "confirm", "resume", "cancel", "relay_cancel")
EXPECTED = {200, 201, 202, 409}  # 409: the losing side of a race (too_late, already_terminal, invalid_status)
WAIT_S = 5


@dataclass(frozen=True)
class Answer:
    operation: str
    status: int | None  # None: no answer (the request failed)
    started: float  # time.monotonic()
    ended: float
    error: str = ""

    def during(self, window: tuple[float, float]) -> bool:
        """Whether the request was under way at some time inside ``window``."""
        return self.started <= window[1] and self.ended >= window[0]


class Traffic:
    def __init__(self, base_url: str, auth: dict[str, str], relay: Any, *, ops: int = 5, seed: int = 14,
                 timeout: float = 60.0):
        self.base = base_url
        self.auth = auth
        self.relay = relay
        self.ops = ops
        self.timeout = timeout
        self.rng = random.Random(seed)
        self.answers: list[Answer] = []
        self.cancelled: set[str] = set()  # cancel answered 200
        self.relay_cancels: set[str] = set()
        self.sessions = 0
        self.pauses = 0  # 429 too_many_open answers to a ?wait, each sent again after Retry-After
        self._lock = threading.Lock()
        self._local = threading.local()
        relay.answer(self._relay_answer)

    # -- the relay's side ----------------------------------------------------------------

    def _relay_answer(self, event: dict[str, Any]) -> dict[str, Any] | None:
        cancellable = event.get("cancellable") or event["event"] == "checkpoint"
        if cancellable and event["tool_call_id"] in self.relay_cancels:
            return {"cancel": True, "reason": "The caller hung up"}
        return None

    # -- one session -----------------------------------------------------------------------

    def session(self, number: int, stop: threading.Event | None = None) -> None:
        """One session's operations (fewer if ``stop`` is set meanwhile)."""
        rng = random.Random(self.rng.random() + number)
        call: dict[str, Any] = {}
        for _ in range(self.ops):
            if stop is not None and stop.is_set():
                break
            operation = rng.choice(OPERATIONS)
            call = getattr(self, f"_{operation}")(number, call, rng)
        with self._lock:
            self.sessions += 1

    def _request(self, operation: str, method: str, path: str, **kw: Any) -> dict[str, Any] | None:
        http = getattr(self._local, "http", None)
        if http is None:
            http = self._local.http = requests.Session()
        started = time.monotonic()
        try:
            while True:
                response = http.request(method, f"{self.base}{path}", headers=self.auth, timeout=self.timeout, **kw)
                if not self._told_to_pause(response) or time.monotonic() - started > self.timeout:
                    break
                time.sleep(int(response.headers["Retry-After"]))  # as a relay does: again after the pause
        except requests.RequestException as exc:
            self._record(Answer(operation, None, started, time.monotonic(), f"{type(exc).__name__}: {exc}"[:300]))
            return None
        self._record(Answer(operation, response.status_code, started, time.monotonic(),
                            "" if response.status_code in EXPECTED else response.text[:300]))
        if response.status_code >= 300:
            return None
        return response.json()

    def _told_to_pause(self, response: requests.Response) -> bool:
        """A 429 ``too_many_open`` (this caller's ``?wait`` requests fill its open share): counted, and
        the relay sends the same request again after ``Retry-After`` (for at most ``timeout``
        seconds in all). Any other 429 is an answer like any other."""
        if response.status_code != 429 or response.json().get("error") != "too_many_open":
            return False
        with self._lock:
            self.pauses += 1
        return True

    def _record(self, answer: Answer) -> None:
        with self._lock:
            self.answers.append(answer)

    def _new(self, number: int, rng: random.Random) -> dict[str, Any]:
        body = {"session_id": f"sess_load_{number}", "function": "send_email", "callback_url": self.relay.url,
                "parameters": {"to": f"caller{number}@example.com", "subject": f"Load {rng.randrange(10**6)}"}}
        return self._request("pending", "POST", "/voice-tools/pending", json=body) or {}

    def _pending(self, number: int, call: dict[str, Any], rng: random.Random) -> dict[str, Any]:
        return self._new(number, rng)

    def _ensure(self, number: int, call: dict[str, Any], rng: random.Random) -> dict[str, Any]:
        return call if call.get("tool_call_id") else self._new(number, rng)

    def _modify(self, number: int, call: dict[str, Any], rng: random.Random) -> dict[str, Any]:
        call = call if call.get("status") == "PENDING" else self._new(number, rng)
        if not call:
            return call
        changed = self._request("modify", "PATCH", f"/voice-tools/modify/{call['tool_call_id']}",
                                json={"parameters": {"subject": f"Changed {rng.randrange(10**6)}"}})
        return {**call, **(changed or {})}

    def _confirm(self, number: int, call: dict[str, Any], rng: random.Random) -> dict[str, Any]:
        call = call if call.get("status") == "PENDING" else self._new(number, rng)
        if not call:
            return call
        started = self._request("confirm", "POST", f"/voice-tools/confirm/{call['tool_call_id']}",
                                params={"wait": WAIT_S}, json={})
        return {**call, **(started or {})}

    def _resume(self, number: int, call: dict[str, Any], rng: random.Random) -> dict[str, Any]:
        if call.get("status") != "PREPARED":
            call = self._confirm(number, call, rng)
        if not call.get("tool_call_id"):
            return call
        resumed = self._request("resume", "POST", f"/voice-tools/resume/{call['tool_call_id']}",
                                json={"action": "proceed"})
        return {**call, **(resumed or {})}

    def _cancel(self, number: int, call: dict[str, Any], rng: random.Random) -> dict[str, Any]:
        call = self._ensure(number, call, rng)
        if not call:
            return call
        cancelled = self._request("cancel", "DELETE", f"/voice-tools/cancel/{call['tool_call_id']}",
                                  json={"reason": "Changed my mind"})
        if cancelled is not None:
            with self._lock:
                self.cancelled.add(call["tool_call_id"])
        return {**call, **(cancelled or {})}

    def _relay_cancel(self, number: int, call: dict[str, Any], rng: random.Random) -> dict[str, Any]:
        call = self._ensure(number, call, rng)
        if not call:
            return call
        with self._lock:
            self.relay_cancels.add(call["tool_call_id"])
        return self._confirm(number, call, rng) if call.get("status") == "PENDING" else call

    # -- running sessions --------------------------------------------------------------------

    def run(self, sessions: int, concurrency: int | None = None) -> None:
        """``sessions`` sessions, ``concurrency`` at once (all at once by default)."""
        with ThreadPoolExecutor(concurrency or sessions) as pool:
            list(pool.map(self.session, range(sessions)))

    @contextmanager
    def streaming(self, concurrency: int) -> Iterator["Traffic"]:
        """Sessions one after another on ``concurrency`` threads until the block ends (then the last
        ones stop after their current operation)."""
        stop = threading.Event()
        counter = iter(range(10**9))
        counter_lock = threading.Lock()
        errors: list[BaseException] = []

        def loop() -> None:
            try:
                while not stop.is_set():
                    with counter_lock:
                        number = next(counter)
                    self.session(number, stop)
            except BaseException as exc:  # noqa: BLE001 - surfaced below
                errors.append(exc)

        threads = [threading.Thread(target=loop, daemon=True) for _ in range(concurrency)]
        for thread in threads:
            thread.start()
        try:
            yield self
        finally:
            stop.set()
            for thread in threads:
                thread.join(self.timeout * self.ops * 2)
        assert not errors, errors
        assert not any(thread.is_alive() for thread in threads), "a session did not finish"

    # -- what was answered ---------------------------------------------------------------------

    def codes(self) -> Counter:
        with self._lock:
            return Counter(a.status for a in self.answers)

    def problems(self, windows: list[tuple[float, float]] = ()) -> list[str]:
        """Answers outside :data:`EXPECTED`, but a 503 to a request under way during one of ``windows``."""
        with self._lock:
            answers = list(self.answers)
        return [f"{a.operation}: {a.status} {a.error}" for a in answers
                if a.status not in EXPECTED
                and not (a.status == 503 and any(a.during(window) for window in windows))]

    def server_errors(self) -> int:
        with self._lock:
            return sum(1 for a in self.answers if a.status is None or a.status >= 500)

    def summary(self) -> str:
        return (f"{self.sessions} sessions, {len(self.answers)} requests {dict(sorted(self.codes().items(), key=str))}, "
                f"{self.pauses} sent again after a 429 too_many_open")
