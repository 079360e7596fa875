"""Each caller's fair share of the API (docs/relay-guide.md, "Limits and small rules"; docs/operations.md,
"Fair shares"): a rate of requests, and a number of long-held requests at once (``?wait`` and open
event streams) within each process's capacity for them, so that no caller takes the whole process;
past the rate, the open share or the process's capacity, 429 with ``Retry-After`` and the JSON error
body, and nothing done. ``/healthz`` is never limited. And a method name nobody uses is one metric label.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from support.brokers import RedisServer
from support.sse_client import Stream
from support.procs import ROOT
from tests.api_fixtures import GUIDE_EMAIL
from tests.conftest import AUTH
from tests.web_server import gunicorn_web

STANDARD_METHODS = {"GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"}


def a_caller(monkeypatch, admin: bool = False) -> tuple[str, dict[str, str]]:
    """A caller of its own (its name and its Authorization header): no other test's counts are its."""
    name = f"share-{uuid.uuid4().hex[:10]}"
    token = uuid.uuid4().hex
    monkeypatch.setenv("VOICE_TOOLS_API_TOKENS",
                       f"{os.environ['VOICE_TOOLS_API_TOKENS']},{name}:{token}{':admin' if admin else ''}")
    return name, {"Authorization": f"Bearer {token}"}


def limit(monkeypatch, *entries: str) -> None:
    """Per-caller limits (``VOICE_TOOLS_CALLER_LIMITS``: ``name:rate:open``, a blank part keeps the default)."""
    monkeypatch.setenv("VOICE_TOOLS_CALLER_LIMITS", ",".join(entries))


def assert_429(answer: requests.Response | object, error: str) -> dict:
    status = getattr(answer, "status_code")
    body = answer.json() if isinstance(answer, requests.Response) else answer.get_json()  # type: ignore[attr-defined]
    assert status == 429, (status, body)
    assert set(body) == {"error", "message", "details"} and body["error"] == error, body
    assert int(answer.headers["Retry-After"]) >= 1  # type: ignore[attr-defined]
    return body


# -- the rate ---------------------------------------------------------------------------------

def test_a_caller_past_its_rate_gets_429_with_retry_after_and_no_one_else_does(client, monkeypatch):
    name, auth = a_caller(monkeypatch)
    _, other = a_caller(monkeypatch)
    limit(monkeypatch, f"{name}:3/minute:")
    for _ in range(3):
        assert client.get("/voice-tools/context/s1", headers=auth).status_code == 200
    refused = client.get("/voice-tools/context/s1", headers=auth)
    body = assert_429(refused, "rate_limited")
    assert body["details"]["limit"] == "3 per 1 minute" and body["details"]["retry_after"] >= 1
    assert client.get("/voice-tools/context/s1", headers=other).status_code == 200  # its own share
    for _ in range(20):
        assert client.get("/healthz").status_code == 200  # never limited


def test_a_refused_request_changes_nothing(client, monkeypatch):
    name, auth = a_caller(monkeypatch)
    limit(monkeypatch, f"{name}:1/minute:")
    body = {"session_id": "s1", "function": "send_email", "parameters": GUIDE_EMAIL}
    assert client.post("/voice-tools/pending", headers=auth, json=body).status_code == 201
    assert_429(client.post("/voice-tools/pending", headers=auth, json=body), "rate_limited")
    assert len(client.get("/voice-tools/context/s1", headers=AUTH).get_json()["pending"]) == 0  # another caller's
    from tests.api_fixtures import call_count
    assert call_count() == 1


def test_an_admin_token_is_limited_too(client, monkeypatch):
    name, auth = a_caller(monkeypatch, admin=True)
    limit(monkeypatch, f"{name}:2/minute:")
    assert [client.get("/metrics", headers=auth).status_code for _ in range(3)] == [200, 200, 429]


def test_the_default_rate_is_set_for_every_caller(client, monkeypatch):
    _, auth = a_caller(monkeypatch)
    monkeypatch.setenv("VOICE_TOOLS_RATE_LIMIT", "2/minute")
    assert [client.get("/voice-tools/tools", headers=auth).status_code for _ in range(3)] == [200, 200, 429]


def test_a_share_changed_in_the_settings_applies_at_the_next_request(client, monkeypatch):
    """A process reads a caller's share again as soon as a setting it comes from changes (it keeps the
    share it read while they do not)."""
    name, auth = a_caller(monkeypatch)
    limit(monkeypatch, f"{name}:1/minute:")
    assert [client.get("/voice-tools/tools", headers=auth).status_code for _ in range(2)] == [200, 429]
    limit(monkeypatch, f"{name}:3/minute:")
    assert [client.get("/voice-tools/tools", headers=auth).status_code for _ in range(4)] == [200, 200, 200, 429]
    limit(monkeypatch)
    monkeypatch.setenv("VOICE_TOOLS_RATE_LIMIT", "2/minute")
    assert [client.get("/voice-tools/tools", headers=auth).status_code for _ in range(3)] == [200, 200, 429]


# -- the open share: ?wait and event streams -----------------------------------------------------

def test_past_the_callers_open_share_a_stream_and_a_wait_are_429_and_change_nothing(api_url, monkeypatch):
    """A stream past the share is refused, and so is a ``?wait``: 429 with ``Retry-After`` and the
    JSON error body, the call untouched (the relay asks again after the pause)."""
    name, auth = a_caller(monkeypatch)
    _, other = a_caller(monkeypatch)
    limit(monkeypatch, f"{name}::1")
    created = requests.post(f"{api_url}/voice-tools/pending", headers=auth, timeout=10,
                            json={"session_id": "s1", "function": "send_email", "parameters": GUIDE_EMAIL})
    tool_call_id = created.json()["tool_call_id"]
    stream = requests.get(f"{api_url}/voice-tools/events/s1", headers=auth, stream=True, timeout=(5, 20))
    try:
        assert stream.status_code == 200  # the caller's one long-held request
        second = requests.get(f"{api_url}/voice-tools/events/s2", headers=auth, timeout=10)
        body = assert_429(second, "too_many_open")
        assert body["details"]["limit"] == 1 and body["details"]["kind"] == "stream"
        # refused at once, not after its wait: a 429 given only after the 30 s asked would time out here
        waited = requests.post(f"{api_url}/voice-tools/confirm/{tool_call_id}?wait=30", headers=auth, timeout=15)
        body = assert_429(waited, "too_many_open")
        assert body["details"]["limit"] == 1 and body["details"]["kind"] == "wait"
        status = requests.get(f"{api_url}/voice-tools/status/{tool_call_id}", headers=auth, timeout=10)
        assert status.json()["status"] == "PENDING", status.text  # the refused confirm did nothing
        assert requests.post(f"{api_url}/voice-tools/confirm/{tool_call_id}?wait=soon", headers=auth,
                             timeout=10).status_code == 422  # bad input is named first
        others = requests.get(f"{api_url}/voice-tools/events/s1", headers=other, stream=True, timeout=(5, 20))
        assert others.status_code == 200  # another caller's share is its own
        others.close()
    finally:
        stream.close()
    confirmed = requests.post(f"{api_url}/voice-tools/confirm/{tool_call_id}", headers=auth, timeout=10)
    assert confirmed.status_code in (200, 202), confirmed.text  # the stream closed: the share is free


@pytest.mark.slow
def test_an_open_slot_of_a_killed_process_frees_itself_when_its_lease_lapses(monkeypatch):
    """The open share is counted in Redis across processes; a process killed while holding a slot
    (no release) leaks it only until its lease lapses."""
    from app import shares

    name = f"share-{uuid.uuid4().hex[:10]}"
    held = subprocess.run(
        [sys.executable, "-c", "import os, sys\nfrom app import shares\n"
         f"shares.take_slot({name!r}, 'stream', limit=2, lease_s=2.0)\n"
         f"shares.take_slot({name!r}, 'stream', limit=2, lease_s=2.0)\nos._exit(0)"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=60)
    assert held.returncode == 0, held.stderr
    with pytest.raises(shares.ApiError) as refused:
        shares.take_slot(name, "stream", limit=2)
    assert refused.value.status == 429 and refused.value.error == "too_many_open"
    time.sleep(2.5)
    slot = shares.take_slot(name, "stream", limit=2)  # the killed process's slots have lapsed
    slot.release()


# -- one caller cannot starve the others ---------------------------------------------------------------

@pytest.fixture(scope="module")
def own_broker(tmp_path_factory):
    """A Redis no worker consumes: a confirm's ``?wait`` there holds its request for the whole wait."""
    server = RedisServer(tmp_path_factory.mktemp("shares-redis")).start()
    try:
        yield server.url
    finally:
        server.kill()


@pytest.mark.slow
def test_one_caller_cannot_hold_more_than_its_open_share(own_broker):
    """``voice-tools run``'s web line (one gunicorn worker of 8 threads), every caller's open share set to 4
    (``VOICE_TOOLS_OPEN_PER_CALLER``): caller a opens as many event streams and ``?wait`` requests as it can;
    past its share each is told 429 (the call untouched), and caller b's requests and ``/healthz`` still
    answer at once."""
    a, b = {"Authorization": "Bearer token-a"}, {"Authorization": "Bearer token-b"}
    with gunicorn_web(VOICE_TOOLS_API_TOKENS="a:token-a,b:token-b", WEB_CONCURRENCY="1", GUNICORN_THREADS="8",
                      VOICE_TOOLS_OPEN_PER_CALLER="4", CELERY_BROKER_URL=own_broker, REDIS_URL=own_broker) as url:
        calls = [requests.post(f"{url}/voice-tools/pending", headers=a, timeout=10,
                               json={"session_id": "sa", "function": "send_email", "parameters": GUIDE_EMAIL})
                 .json()["tool_call_id"] for _ in range(8)]

        def stream(i: int):
            try:
                return requests.get(f"{url}/voice-tools/events/sa{i}", headers=a, stream=True, timeout=(3, 3))
            except requests.RequestException as exc:
                return exc

        def wait(tool_call_id: str):
            try:
                return requests.post(f"{url}/voice-tools/confirm/{tool_call_id}?wait=8", headers=a, timeout=(3, 3))
            except requests.RequestException as exc:  # held past the client's patience
                return exc

        pool = ThreadPoolExecutor(16)
        streams = [pool.submit(stream, i) for i in range(8)]
        waits = [pool.submit(wait, c) for c in calls]
        time.sleep(1.5)  # a's requests all arrived: those admitted hold their threads
        started = time.monotonic()
        answered = requests.get(f"{url}/voice-tools/context/sb", headers=b, timeout=5)
        health = requests.get(f"{url}/healthz", timeout=5)
        took = time.monotonic() - started
        assert answered.status_code == 200 and health.status_code == 200
        assert took < 2.0, took
        opened = [f.result() for f in streams]
        waited = [f.result() for f in waits]
        refused = [r for r in opened if isinstance(r, requests.Response) and r.status_code == 429]
        for answer in refused:
            assert answer.json()["error"] == "too_many_open" and int(answer.headers["Retry-After"]) >= 1
        not_held = [r for r in waited if isinstance(r, requests.Response) and r.status_code == 429]
        for answer in not_held:
            assert answer.json()["error"] == "too_many_open" and int(answer.headers["Retry-After"]) >= 1
        held = len(opened) - len(refused) + len(waited) - len(not_held)
        assert refused and not_held and 1 <= held <= 4, (opened, waited)  # 4: its share
        untouched = [requests.get(f"{url}/voice-tools/status/{c}", headers=a, timeout=5).json()["status"]
                     for c in calls]
        assert untouched.count("PENDING") >= len(not_held), untouched  # a refused confirm did nothing
        for r in opened + waited:
            if isinstance(r, requests.Response):
                r.close()
        pool.shutdown(wait=False)


# -- metrics -------------------------------------------------------------------------------------------------

def _method_labels(text: str) -> set[str]:
    return set(re.findall(r'^voice_tools_http_requests_total\{[^}]*method="([^"]*)"', text, re.M))


def test_fifty_made_up_methods_add_no_metric_label(api_url):
    for i in range(50):
        answer = requests.request(f"MADEUP{i}", f"{api_url}/voice-tools/tools", timeout=10)
        assert answer.status_code in (401, 405)
    labels = _method_labels(requests.get(f"{api_url}/metrics", headers=AUTH, timeout=10).text)
    assert "other" in labels
    assert labels <= STANDARD_METHODS | {"other"}, labels


@pytest.mark.slow
def test_callers_together_cannot_take_the_whole_of_an_api_process(own_broker):
    """Each caller within its share, two callers' ``?wait`` requests together would pass the process's
    capacity for long-held requests (``VOICE_TOOLS_OPEN_PER_PROCESS`` 6 here): past it they are told 429
    with ``details.scope`` ``server``, and a third caller's event streams too, while ``/healthz`` and
    short requests are still answered at once on the worker's 2 threads, which the held waits do not take.
    Once the waits end, the third caller's streams open."""
    a, b, c = ({"Authorization": f"Bearer token-{x}"} for x in "abc")
    with gunicorn_web(VOICE_TOOLS_API_TOKENS="a:token-a,b:token-b,c:token-c", WEB_CONCURRENCY="1",
                      GUNICORN_THREADS="2", VOICE_TOOLS_OPEN_PER_PROCESS="6", CELERY_BROKER_URL=own_broker,
                      REDIS_URL=own_broker) as url:
        calls = [(auth, requests.post(f"{url}/voice-tools/pending", headers=auth, timeout=10,
                                      json={"session_id": "sw", "function": "send_email", "parameters": GUIDE_EMAIL})
                  .json()["tool_call_id"]) for auth in (a, b) for _ in range(4)]

        def wait(auth: dict[str, str], tool_call_id: str):
            try:
                return requests.post(f"{url}/voice-tools/confirm/{tool_call_id}?wait=8", headers=auth, timeout=(3, 3))
            except requests.RequestException as exc:  # held past the client's patience
                return exc

        pool = ThreadPoolExecutor(8)
        waits = [pool.submit(wait, auth, c_id) for auth, c_id in calls]
        time.sleep(1.5)  # every wait arrived: those admitted are held
        started = time.monotonic()
        assert requests.get(f"{url}/healthz", timeout=5).status_code == 200
        assert requests.get(f"{url}/voice-tools/context/sc", headers=c, timeout=5).status_code == 200
        assert time.monotonic() - started < 2.0
        streams = [requests.get(f"{url}/voice-tools/events/s{i}", headers=c, stream=True, timeout=(3, 3))
                   for i in range(4)]  # within c's share, past the process's capacity
        assert [r.status_code for r in streams] == [429] * 4
        assert all(r.json()["details"]["scope"] == "server" for r in streams), [r.text for r in streams]
        waited = [f.result() for f in waits]
        refused = [r for r in waited if isinstance(r, requests.Response) and r.status_code == 429]
        assert len(refused) == 2, waited
        assert all(r.json()["details"]["scope"] == "server" for r in refused), [r.text for r in refused]
        assert sum(isinstance(r, requests.RequestException) for r in waited) == 6, waited  # held
        for r in streams + refused:
            r.close()
        pool.shutdown(wait=False)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # the held waits end (8 s) and give their slots back
            opened = requests.get(f"{url}/voice-tools/events/s0", headers=c, stream=True, timeout=(3, 3))
            opened.close()
            if opened.status_code == 200:
                break
            time.sleep(0.5)
        assert opened.status_code == 200, opened.text


@pytest.mark.slow
def test_event_streams_hold_no_gunicorn_thread(own_broker):
    """60 event streams open at once on a gunicorn worker of 2 threads: each is answered and follows its
    session, and a REST call and ``/healthz`` are still answered while they are all open."""
    a = {"Authorization": "Bearer token-a"}
    with gunicorn_web(VOICE_TOOLS_API_TOKENS="a:token-a", VOICE_TOOLS_CALLER_LIMITS="a::100", WEB_CONCURRENCY="1",
                      GUNICORN_THREADS="2", CELERY_BROKER_URL=own_broker, REDIS_URL=own_broker) as url:
        streams = [Stream(f"{url}/voice-tools/events/many{i}", a) for i in range(60)]
        try:
            assert all(s.response.status_code == 200 for s in streams)
            assert requests.get(f"{url}/healthz", timeout=5).status_code == 200
            created = requests.post(f"{url}/voice-tools/pending", headers=a, timeout=5,
                                    json={"session_id": "many7", "function": "send_email", "parameters": GUIDE_EMAIL})
            assert created.status_code == 201, created.text
            cancelled = requests.delete(f"{url}/voice-tools/cancel/{created.json()['tool_call_id']}", headers=a,
                                        timeout=5)
            assert cancelled.status_code == 200, cancelled.text
            _, data = streams[7].next_event()  # the cancel's event, on its session's stream only
            assert data["event"] == "cancelled" and data["tool_call_id"] == created.json()["tool_call_id"]
            assert streams[7].retry == 2000 and streams[7].kinds == ["cancelled"]
        finally:
            for s in streams:
                s.close()
        assert requests.get(f"{url}/voice-tools/context/many7", headers=a, timeout=5).status_code == 200


# -- the defaults fit a relay: hundreds of streams and waits from one token ---------------------------------

@pytest.mark.slow
def test_on_the_defaults_one_token_follows_300_sessions_each_stream_seeing_its_event(own_broker):
    """The Procfile's web line on the defaults (one worker of 8 threads here): one caller opens 300 event
    streams (five per session), every one is answered 200, and each sees the event of its session."""
    from tests.helpers import make_call
    from tests.test_event_stream import record_progress_of

    a = {"Authorization": "Bearer token-a"}
    with gunicorn_web(VOICE_TOOLS_API_TOKENS="a:token-a", WEB_CONCURRENCY="1", CELERY_BROKER_URL=own_broker,
                      REDIS_URL=own_broker) as url:
        sessions = [f"fleet_{uuid.uuid4().hex[:8]}" for _ in range(60)]
        streams = [Stream(f"{url}/voice-tools/events/{sessions[i % 60]}", a) for i in range(300)]
        try:
            assert [s.response.status_code for s in streams] == [200] * 300
            assert requests.get(f"{url}/healthz", timeout=5).status_code == 200
            events = {session: record_progress_of(make_call(session_id=session, caller="a").tool_call_id)
                      for session in sessions}
            for i, stream in enumerate(streams):
                assert stream.next_event()[0] == events[sessions[i % 60]], i
        finally:
            for s in streams:
                s.close()


@pytest.mark.slow
def test_on_the_defaults_one_token_holds_200_waits_and_no_one_else_waits_for_them(own_broker):
    """200 ``?wait`` requests from one token at once, on calls no worker moves (a broker nobody consumes),
    on one gunicorn worker of 8 threads: none is refused, each is held its whole wait and answered 202, and
    meanwhile ``/healthz`` and another caller's requests are answered at once."""
    a, b = {"Authorization": "Bearer token-a"}, {"Authorization": "Bearer token-b"}
    with gunicorn_web(VOICE_TOOLS_API_TOKENS="a:token-a,b:token-b", WEB_CONCURRENCY="1",
                      CELERY_BROKER_URL=own_broker, REDIS_URL=own_broker) as url:
        http = requests.Session()
        calls = [http.post(f"{url}/voice-tools/pending", headers=a, timeout=10,
                           json={"session_id": "waits200", "function": "send_email", "parameters": GUIDE_EMAIL})
                 .json()["tool_call_id"] for _ in range(200)]

        def wait(tool_call_id: str) -> tuple[int, float, str]:
            started = time.monotonic()
            answer = requests.post(f"{url}/voice-tools/confirm/{tool_call_id}?wait=6", headers=a, timeout=30)
            return answer.status_code, time.monotonic() - started, answer.json().get("status", answer.text)

        with ThreadPoolExecutor(200) as pool:
            waits = [pool.submit(wait, c) for c in calls]
            time.sleep(3.0)  # every wait arrived and is held
            assert not any(w.done() for w in waits), [w.result() for w in waits if w.done()][:3]
            started = time.monotonic()
            assert requests.get(f"{url}/healthz", timeout=5).status_code == 200
            other = requests.post(f"{url}/voice-tools/pending", headers=b, timeout=5,
                                  json={"session_id": "waits200b", "function": "send_email",
                                        "parameters": GUIDE_EMAIL})
            assert other.status_code == 201, other.text
            assert time.monotonic() - started < 2.0
            answers = [w.result() for w in waits]
        assert [status for status, _, _ in answers] == [202] * 200, [a for a in answers if a[0] != 202][:3]
        assert all(took >= 6 for _, took, _ in answers)  # each held its whole wait
        assert {status for _, _, status in answers} == {"EXECUTING"}


def test_a_held_slot_is_renewed_by_its_process_and_outlasts_its_lease():
    """A slot is renewed by the process holding it, whatever its request writes or does not write: held
    for several of its leases, it still counts (the caller stays within its share), and once released
    it is free at once."""
    from app import shares

    name = f"share-{uuid.uuid4().hex[:10]}"
    held = shares.take_slot(name, "stream", limit=1, lease_s=2.0, holds_thread=False)
    try:
        time.sleep(5.0)  # two and a half leases, and the slot's request does nothing meanwhile
        with pytest.raises(shares.ApiError) as refused:
            shares.take_slot(name, "stream", limit=1, holds_thread=False)
        assert refused.value.status == 429 and refused.value.error == "too_many_open"
    finally:
        held.release()
    shares.take_slot(name, "stream", limit=1, holds_thread=False).release()


def test_renewing_hundreds_of_slots_sends_redis_one_command_per_caller():
    """The process's renewer renews every slot it holds in one command per caller (and lease), not one per
    slot: a command costs the process's interpreter about 20 µs to send and read, and a thousand of them
    every renewal held off the stream loop's writes for tens of milliseconds (``python -m bench.stream``)."""
    from app import shares

    client = shares.counts().client
    assert client is not None, "the tests' API counts in Redis"
    names = [f"share-{uuid.uuid4().hex[:10]}" for _ in range(2)]
    held = [shares.take_slot(name, "stream", limit=300, lease_s=2.0, holds_thread=False)
            for name in names for _ in range(200)]

    def scripts_run() -> int:
        stats = client.info("commandstats")
        return sum(stats.get(f"cmdstat_{name}", {}).get("calls", 0) for name in ("evalsha", "eval"))

    try:
        before = scripts_run()
        shares.renew_all()
        sent = scripts_run() - before
        assert sent < 20, f"{sent} commands to renew {len(held)} slots of {len(names)} callers"
        time.sleep(1.0)
        shares.renew_all()
        time.sleep(1.5)  # past the lease each slot had before the last renewal
        for name in names:
            with pytest.raises(shares.ApiError) as refused:  # every one of the 200 renewed: still held
                shares.take_slot(name, "stream", limit=200, holds_thread=False)
            assert refused.value.error == "too_many_open" and refused.value.details["open"] == 200, refused.value.details
    finally:
        for slot in held:
            slot.release()
