"""compose.yaml started as an operator starts it, with podman: the image of the repository's Dockerfile for
every role, stand-ins for the official images it names (``tests/container_images.py``), a TLS front whose
certificate comes from a CA this test makes, and a relay on the compose network's gateway (an address of
podman's own network on this machine). Then a relay's flow through the front (a call over REST and over MCP,
a checkpoint and a resume, every callback verified with ``standardwebhooks``), and faults: a worker container
killed mid-send, the database container restarted, a web replica stopped.

Marked ``slow`` and ``containers``: the README's quick run leaves them out, the full suite and CI run them.
"""

from __future__ import annotations

import base64
import datetime
import ipaddress
import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from tests import container_images as images
from support.procs import free_port
from support.relay import Relay

pytestmark = [pytest.mark.slow, pytest.mark.containers]

ROOT = Path(__file__).resolve().parents[1]
PROJECT_NAME = "vttest"
NETWORK = f"{PROJECT_NAME}_default"
TOKEN = secrets.token_urlsafe(24)
ADMIN = secrets.token_urlsafe(24)
CALLBACK_SECRET = secrets.token_hex(24)
WEBHOOK_SECRET = "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode()


SERVICES = ("web-1", "web-2", "mcp", "writes", "reads", "callbacks", "beat", "flower", "front")


def _certificates(folder: Path) -> Path:
    """A CA of this test's own and the front's certificate for localhost and 127.0.0.1, signed by it."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "voice-tools test CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                                       key_encipherment=False, data_encipherment=False, key_agreement=False,
                                       encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    tls = folder / "deploy" / "compose" / "tls"
    tls.mkdir(parents=True, exist_ok=True)
    (tls / "tls.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (tls / "tls.key").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                    serialization.NoEncryption()))
    os.chmod(tls / "tls.key", 0o644)  # read by nginx's workers in the container
    (folder / "ca.pem").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    return folder / "ca.pem"


def compose_command() -> list[str]:
    found = shutil.which("podman-compose") or str(Path(sys.executable).with_name("podman-compose"))
    if not Path(found).exists():
        pytest.skip("podman-compose is not installed (the dev extra has it)")
    return [found]


class Stack:
    """The compose project in ``folder``: its TLS front at ``url`` (the test's CA verifies it)."""

    def __init__(self, folder: Path, env: dict[str, str], url: str, ca: Path, relay: Relay):
        self.folder, self.env, self.url, self.ca, self.relay = folder, env, url, ca, relay
        self.http = requests.Session()
        self.http.verify = str(ca)
        self.http.headers["Authorization"] = f"Bearer {TOKEN}"
        self.http.trust_env = False  # no proxy or CA bundle of the environment: the front, verified by the test's CA
        self.last_problem = ""

    def compose(self, *args: str, timeout: float = 900, check: bool = True) -> subprocess.CompletedProcess:
        done = subprocess.run([*compose_command(), "-p", PROJECT_NAME, "-f", "compose.yaml", *args], cwd=self.folder,
                              env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and done.returncode != 0:
            raise AssertionError(f"podman-compose {' '.join(args)}: {done.returncode}\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}")
        return done

    def container(self, service: str) -> str:
        return f"{PROJECT_NAME}_{service}_1"

    def logs(self, service: str) -> str:
        done = images.podman("logs", self.container(service), check=False)
        return done.stdout[-6000:] + done.stderr[-6000:]

    def ready(self) -> bool:
        try:
            answer = self.http.get(f"{self.url}/readyz", timeout=5)
            self.last_problem = f"{answer.status_code} {answer.text[:300]}"
            return answer.status_code == 200
        except requests.RequestException as exc:
            self.last_problem = repr(exc)[:500]
            return False

    def wait_ready(self, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while not self.ready():
            if time.monotonic() > deadline:
                raise AssertionError(f"the stack never answered /readyz through the front ({self.last_problem}):\n"
                                     + "\n".join(f"--- {s}\n{self.logs(s)[-1500:]}" for s in ("migrate", "web-1", "front")))
            time.sleep(1)

    def call(self, method: str, path: str, expect: tuple[int, ...] = (200,), **kw) -> dict:
        answer = self.http.request(method, f"{self.url}{path}", timeout=60, **kw)
        assert answer.status_code in expect, (method, path, answer.status_code, answer.text[:2000])
        return answer.json()

    def mcp(self, name: str, arguments: dict) -> dict:
        asked = {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": name, "arguments": arguments}}
        answer = self.http.post(f"{self.url}/mcp", json=asked, timeout=60,
                                headers={"Accept": "application/json, text/event-stream"})
        assert answer.status_code == 200, answer.text[:2000]
        result = answer.json()["result"]
        assert not result.get("isError"), result
        return result.get("structuredContent") or json.loads(result["content"][0]["text"])

    def psql(self, sql: str) -> str:
        done = images.podman("exec", self.container("postgres"), "psql", "-U", "voice_tools", "-d", "voice_tools",
                             "-At", "-c", sql)
        return done.stdout.strip()


def _gateway() -> str:
    images.podman("network", "rm", "-f", NETWORK, check=False)
    images.podman("network", "create", NETWORK)
    found = json.loads(images.podman("network", "inspect", NETWORK).stdout)[0]
    ranges = [r for plugin in found.get("plugins", []) for rs in plugin.get("ipam", {}).get("ranges", []) for r in rs]
    gateway = found.get("subnets", [{}])[0].get("gateway") if found.get("subnets") else ranges[0]["gateway"]
    assert ipaddress.ip_address(gateway).is_private, gateway
    return gateway


@pytest.fixture(scope="module")
def built():
    why = images.usable()
    if why:
        pytest.skip(why)
    return images.everything()


@pytest.fixture(scope="module")
def stack(built, tmp_path_factory):
    folder = tmp_path_factory.mktemp("compose")
    shutil.copy(ROOT / "compose.yaml", folder / "compose.yaml")
    shutil.copytree(ROOT / "deploy" / "compose", folder / "deploy" / "compose")
    ca = _certificates(folder)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VOICE_TOOLS_", "DATABASE_", "REDIS_", "CELERY_"))}
    subprocess.run([*compose_command(), "-p", PROJECT_NAME, "-f", "compose.yaml", "down", "-v", "-t", "5"], cwd=folder,
                   env=env, capture_output=True, timeout=300)
    gateway = _gateway()
    port, flower = free_port(), free_port()
    password = secrets.token_hex(16)
    (folder / "deploy" / "compose" / "postgres.env").write_text(f"POSTGRES_PASSWORD={password}\n")
    (folder / "deploy" / "compose" / "app.env").write_text("\n".join([
        f"DATABASE_URL=postgresql://voice_tools:{password}@postgres:5432/voice_tools",
        f"VOICE_TOOLS_API_TOKENS=relay:{TOKEN},ops:{ADMIN}:admin",
        f"VOICE_TOOLS_CALLBACK_SECRET={CALLBACK_SECRET}",
        f"VOICE_TOOLS_CALLBACK_SECRETS={WEBHOOK_SECRET}",
        f"VOICE_TOOLS_CALLBACK_HOSTS={gateway}",
        f"FLOWER_BASIC_AUTH=admin:{secrets.token_hex(8)}",
        # a killed worker's links come back this soon (above the longest link's hard limit, 70 s)
        "VOICE_TOOLS_VISIBILITY_TIMEOUT=75", ""]))
    url = f"https://127.0.0.1:{port}"  # the certificate names 127.0.0.1 and localhost
    env.update(VOICE_TOOLS_IMAGE=images.PROJECT, VOICE_TOOLS_HTTPS_PORT=str(port), FLOWER_PORT=str(flower),
               VOICE_TOOLS_PUBLIC_URL=url)
    s = Stack(folder, env, url, ca, None)
    started = time.monotonic()
    try:
        # podman before 4.6 cannot wait for a service's health or completion (podman-compose then waits forever
        # for a "stopped" state that an exited container never has): the servers, the migration to its end, the rest
        s.compose("up", "-d", "postgres", "redis")
        s.compose("up", "-d", "--no-deps", "migrate")
        exited = images.podman("wait", s.container("migrate"), timeout=300).stdout.strip()
        assert exited == "0", s.logs("migrate")
        s.compose("up", "-d", "--no-deps", *SERVICES)
        # the network's bridge has its gateway address once a container is on it: the relay listens there
        with Relay(CALLBACK_SECRET, webhook_secrets=[WEBHOOK_SECRET], host=gateway) as relay:
            s.relay = relay
            s.wait_ready()
            images.timings["stack ready"] = time.monotonic() - started
            yield s
    finally:
        print("container test timings (s):", {k: round(v, 1) for k, v in images.timings.items()})
        s.compose("down", "-v", "-t", "10", check=False, timeout=600)
        images.podman("network", "rm", "-f", NETWORK, check=False)


def _verified(relay: Relay, tool_call_id: str) -> list[str]:
    """Every event of the call verified with the standardwebhooks library itself; their names in order."""
    from standardwebhooks import Webhook

    hook = Webhook(WEBHOOK_SECRET)
    with relay._lock:
        pairs = [(e, h, b) for e, h, b in zip(relay.events, relay.headers, relay.bodies) if e["tool_call_id"] == tool_call_id]
    for event, headers, body in pairs:
        lowered = {k.lower(): v for k, v in headers.items()}
        assert hook.verify(body, lowered) == event
    assert relay.bad_signatures == 0
    return [e["event"] for e, _, _ in pairs]


def _email_through_checkpoint(stack: Stack, session: str) -> str:
    created = stack.call("POST", "/voice-tools/pending", (201,), json={
        "session_id": session, "function": "send_email", "callback_url": stack.relay.url,
        "parameters": {"to": "john.smith@example.com", "subject": "Containers", "body": "Sent from a pod."}})
    call_id = created["tool_call_id"]
    stack.call("POST", f"/voice-tools/confirm/{call_id}", (202,), json={"callback_url": stack.relay.url})
    checkpoint = stack.relay.wait_for(call_id, "checkpoint", timeout=60)
    assert checkpoint["preview"], checkpoint
    return call_id


def test_a_relays_flow_through_the_tls_front_rest_and_mcp(stack):
    call_id = _email_through_checkpoint(stack, "sess_containers_flow")
    resumed = stack.call("POST", f"/voice-tools/resume/{call_id}?wait=30", (200,), json={"action": "proceed"})
    assert resumed["status"] == "COMPLETED", resumed
    stack.relay.wait_for(call_id, "completed", timeout=60)
    events = _verified(stack.relay, call_id)
    assert "checkpoint" in events and events[-1] == "completed" and events.count("completed") == 1, events
    assert stack.mcp("get_status", {"tool_call_id": call_id})["status"] == "COMPLETED"
    assert stack.psql(f"SELECT count(*) FROM email_outbox WHERE tool_call_id = '{call_id}'") == "1"
    # the certificate is the test CA's: without it, the front is refused
    with pytest.raises(requests.exceptions.SSLError):
        requests.get(f"{stack.url}/healthz", timeout=10)


def test_a_web_replica_stopped_the_other_answers(stack):
    images.podman("stop", "-t", "10", stack.container("web-1"))
    try:
        answers = [stack.http.get(f"{stack.url}/readyz", timeout=10).status_code for _ in range(20)]
        assert answers == [200] * 20, answers
        done = stack.call("POST", "/voice-tools/execute?wait=30", (200,), json={
            "session_id": "sess_containers_web", "function": "search_contacts", "parameters": {"query": "john"}})
        assert done["status"] == "COMPLETED", done
    finally:
        images.podman("start", stack.container("web-1"))
    stack.wait_ready()


def test_the_database_restarted_calls_finish(stack):
    call_id = _email_through_checkpoint(stack, "sess_containers_db")
    images.podman("restart", "-t", "10", stack.container("postgres"))
    deadline = time.monotonic() + 120
    while True:  # the API answers 503 while the database is down; the relay tries again
        answer = stack.http.post(f"{stack.url}/voice-tools/resume/{call_id}?wait=30", json={"action": "proceed"},
                                 timeout=60)
        if answer.status_code == 200 and answer.json()["status"] == "COMPLETED":
            break
        assert answer.status_code in (200, 409, 502, 503, 504), answer.text[:1000]
        if answer.status_code == 409:  # resumed already: wait for its end
            status = stack.call("GET", f"/voice-tools/status/{call_id}")
            if status["status"] == "COMPLETED":
                break
        assert time.monotonic() < deadline, answer.text[:1000]
        time.sleep(2)
    stack.relay.wait_for(call_id, "completed", timeout=120)
    assert _verified(stack.relay, call_id).count("completed") == 1
    assert stack.psql(f"SELECT count(*) FROM email_outbox WHERE tool_call_id = '{call_id}'") == "1"


def test_a_worker_container_killed_mid_send_sends_the_email_once(stack):
    call_id = _email_through_checkpoint(stack, "sess_containers_kill")
    answer = stack.http.post(f"{stack.url}/voice-tools/resume/{call_id}", json={"action": "proceed"}, timeout=60)
    assert answer.status_code in (200, 202), answer.text
    images.podman("kill", "-s", "KILL", stack.container("writes"))  # the send's link: taken, maybe done
    time.sleep(2)
    images.podman("start", stack.container("writes"))
    deadline = time.monotonic() + 240  # a link taken by the killed worker comes back after the visibility timeout
    while stack.call("GET", f"/voice-tools/status/{call_id}")["status"] not in ("COMPLETED", "FAILED"):
        assert time.monotonic() < deadline, stack.logs("writes")[-3000:]
        time.sleep(2)
    assert stack.call("GET", f"/voice-tools/status/{call_id}")["status"] == "COMPLETED"
    stack.relay.wait_for(call_id, "completed", timeout=60)
    assert _verified(stack.relay, call_id).count("completed") == 1
    assert stack.psql(f"SELECT count(*) FROM email_outbox WHERE tool_call_id = '{call_id}'") == "1"
