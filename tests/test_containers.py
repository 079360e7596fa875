"""compose.yaml started as an operator starts it, with podman: the image of the repository's Dockerfile for
every role, stand-ins for the official images it names (``tests/container_images.py``), a TLS front whose
certificate comes from a CA this test makes, and, on the compose network's gateway (an address of podman's
own network on this machine), a relay and Gmail's API as an HTTP double (the stack's send_email sends
through the real Google client). Then a relay's flow through the front (a call over REST and over MCP, a
checkpoint and a resume, every callback verified with ``standardwebhooks``), and faults: a worker container
killed while its send is at Gmail, the database container restarted, a web replica stopped. A second stack,
the ``rabbitmq`` profile, starts in the background meanwhile and carries the same flow over RabbitMQ.

Each run's compose projects have names of their own (``vtc-<pid>-<nonce>-<broker>``): runs side by side do
not meet, and every container, volume, pod and network of a project is removed after it, failed or not (and
those of an earlier run whose process is gone, at the start).

Marked ``slow`` and ``containers``: the README's quick run leaves them out, the full suite and CI run them.
"""

from __future__ import annotations

import base64
import concurrent.futures
import contextlib
import datetime
import ipaddress
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest
import requests

from tests import container_images as images
from tests.google_fixtures import GmailDouble, google_env
from tests.http_double import HttpDouble, Reply
from support.procs import free_port
from support.relay import Relay

pytestmark = [pytest.mark.slow, pytest.mark.containers]

ROOT = Path(__file__).resolve().parents[1]
PREFIX = "vtc"
RUN = f"{PREFIX}-{os.getpid()}-{secrets.token_hex(3)}"  # this run's projects: RUN-redis, RUN-rabbitmq
PROJECT_LABEL = "io.podman.compose.project"
TOKEN = secrets.token_urlsafe(24)
ADMIN = secrets.token_urlsafe(24)
CALLBACK_SECRET = secrets.token_hex(24)
WEBHOOK_SECRET = "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode()
GOOGLE_CREDENTIALS = "/run/secrets/voice-tools-google.json"  # where the override mounts the double's credentials

INFRA = ("postgres", "redis")
SERVICES = ("web-1", "web-2", "mcp", "writes", "reads", "callbacks", "beat", "flower", "front")
# the RabbitMQ stack: what its flow needs (no reads, no beat: the Redis stack has them)
RABBIT_SERVICES = ("web-1", "web-2", "mcp", "writes", "callbacks", "flower", "front")
APP_SERVICES = ("migrate", "web-1", "web-2", "mcp", "writes", "reads", "callbacks", "beat", "flower")


class HeldGmail(GmailDouble):
    """Gmail's drafts and sent mail; once ``hold()`` is called, the next ``drafts.send`` acts (the message is
    sent) and then holds its answer until ``release()``: a send in flight, for as long as the test wants."""

    def __init__(self, api: HttpDouble) -> None:
        self._armed, self.in_flight, self._released = threading.Event(), threading.Event(), threading.Event()
        super().__init__(api)

    def hold(self) -> None:
        self.in_flight.clear()
        self._released.clear()
        self._armed.set()

    def release(self) -> None:
        self._released.set()

    def _send(self, request):
        answer = super()._send(request)
        if self._armed.is_set() and not isinstance(answer, Reply):
            self._armed.clear()
            self.in_flight.set()
            self._released.wait(600)
        return answer

    def sent_for(self, tool_call_id: str) -> list[dict]:
        with self._lock:
            return [m for m in self.sent if m["message_id"].startswith(f"<{tool_call_id}@")]


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


def remove_project(name: str) -> None:
    """Every container, the pod, the volumes and the network of compose project ``name``, whatever state
    they are in (what ``down -v`` removes, without waiting for each container's stop timeout in turn)."""
    label = f"label={PROJECT_LABEL}={name}"
    ids = images.podman("ps", "-a", "-q", "--filter", label, check=False).stdout.split()
    if ids:
        images.podman("rm", "-f", "-t", "0", *ids, check=False, timeout=300)
    images.podman("pod", "rm", "-f", f"pod_{name}", check=False)
    volumes = images.podman("volume", "ls", "-q", "--filter", label, check=False).stdout.split()
    if volumes:
        images.podman("volume", "rm", "-f", *volumes, check=False)
    images.podman("network", "rm", "-f", f"{name}_default", check=False)


def remove_abandoned_projects() -> None:
    """The projects of an earlier run of this module whose process is gone (killed before its clean-up)."""
    found = images.podman("ps", "-a", "--format", f'{{{{index .Labels "{PROJECT_LABEL}"}}}}', check=False).stdout
    networks = images.podman("network", "ls", "--format", "{{.Name}}", check=False).stdout
    names = set(found.split()) | {n.removesuffix("_default") for n in networks.split()}
    for name in sorted(names):
        match = re.fullmatch(rf"{PREFIX}-(\d+)-[0-9a-f]+-\w+", name)
        if match and not Path(f"/proc/{match.group(1)}").exists():
            remove_project(name)


class Stack:
    """Compose project ``name`` in ``folder``: its TLS front at ``url`` (the test's CA verifies it), its
    relay and its Gmail double on the network's gateway, Flower at ``flower_url``."""

    def __init__(self, name: str, folder: Path, env: dict[str, str], url: str, ca: Path):
        self.name, self.folder, self.env, self.url, self.ca = name, folder, env, url, ca
        self.files = ["-f", "compose.yaml", "-f", "compose.google.yaml"]
        self.profiles: list[str] = []
        self.relay: Relay | None = None
        self.gmail: HeldGmail | None = None
        self.flower_url, self.flower_auth = "", ("", "")
        self.http = requests.Session()
        self.http.verify = str(ca)
        self.http.headers["Authorization"] = f"Bearer {TOKEN}"
        self.http.trust_env = False  # no proxy or CA bundle of the environment: the front, verified by the test's CA
        self.last_problem = ""

    def compose(self, *args: str, timeout: float = 900, check: bool = True) -> subprocess.CompletedProcess:
        done = subprocess.run([*compose_command(), "-p", self.name, *self.files, *self.profiles, *args],
                              cwd=self.folder, env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and done.returncode != 0:
            raise AssertionError(f"podman-compose {' '.join(args)}: {done.returncode}\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}")
        return done

    def container(self, service: str) -> str:
        return f"{self.name}_{service}_1"

    def start(self, *services: str) -> None:
        """``podman start`` of the services' containers, all at once (podman-compose starts them one by one)."""
        with concurrent.futures.ThreadPoolExecutor(len(services)) as pool:
            for done in pool.map(lambda s: images.podman("start", self.container(s), check=False), services):
                assert done.returncode == 0, done.stderr[-2000:]

    def logs(self, service: str) -> str:
        done = images.podman("logs", self.container(service), check=False)
        return done.stdout[-6000:] + done.stderr[-6000:]

    def save_logs(self, folder: Path) -> None:
        folder.mkdir(exist_ok=True)
        names = images.podman("ps", "-a", "--format", "{{.Names}}", "--filter", f"label={PROJECT_LABEL}={self.name}",
                              check=False).stdout.split()
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            for name, done in zip(names, pool.map(lambda n: images.podman("logs", n, check=False), names)):
                (folder / f"{name}.log").write_text(done.stdout + done.stderr)

    def ready(self) -> bool:
        try:
            answer = self.http.get(f"{self.url}/readyz", timeout=5)
            self.last_problem = f"{answer.status_code} {answer.text[:300]}"
            return answer.status_code == 200
        except requests.RequestException as exc:
            self.last_problem = repr(exc)[:500]
            return False

    def wait_ready(self, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while not self.ready():
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.name} never answered /readyz through the front ({self.last_problem}):\n"
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

    def exec(self, service: str, *command: str) -> str:
        return images.podman("exec", self.container(service), *command).stdout.strip()


def _gateway(network: str) -> str:
    images.podman("network", "create", network)
    found = json.loads(images.podman("network", "inspect", network).stdout)[0]
    ranges = [r for plugin in found.get("plugins", []) for rs in plugin.get("ipam", {}).get("ranges", []) for r in rs]
    gateway = found.get("subnets", [{}])[0].get("gateway") if found.get("subnets") else ranges[0]["gateway"]
    assert ipaddress.ip_address(gateway).is_private, gateway
    return gateway


def _google_override(folder: Path, gateway: str, port: int) -> list[str]:
    """The double's credentials file, mounted read-only into every voice-tools service by an override file
    (as an operator adds the real one): the lines app.env gains for it."""
    values = google_env(types.SimpleNamespace(url=f"http://{gateway}:{port}"), folder, services="gmail")
    os.chmod(values["VOICE_TOOLS_GOOGLE_CREDENTIALS"], 0o644)  # read by the image's user
    mount = f"./{Path(values['VOICE_TOOLS_GOOGLE_CREDENTIALS']).name}:{GOOGLE_CREDENTIALS}:ro"
    (folder / "compose.google.yaml").write_text(
        "services:\n" + "".join(f"  {s}:\n    volumes: [\"{mount}\"]\n" for s in APP_SERVICES))
    values["VOICE_TOOLS_GOOGLE_CREDENTIALS"] = GOOGLE_CREDENTIALS
    return [f"{k}={v}" for k, v in values.items()]


@contextlib.contextmanager
def started_stack(folder: Path, broker: str, services: tuple[str, ...]):
    """compose.yaml's project for ``broker`` ("redis", or "rabbitmq": the profile) up in ``folder``, its relay
    and Gmail double listening; everything of it removed on the way out, failed or not."""
    name = f"{RUN}-{broker}"
    shutil.copy(ROOT / "compose.yaml", folder / "compose.yaml")
    shutil.copytree(ROOT / "deploy" / "compose", folder / "deploy" / "compose")
    ca = _certificates(folder)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VOICE_TOOLS_", "DATABASE_", "REDIS_", "CELERY_", "FLOWER_"))}
    port, flower, google_port = free_port(), free_port(), free_port()
    url = f"https://127.0.0.1:{port}"  # the certificate names 127.0.0.1 and localhost
    env.update(VOICE_TOOLS_IMAGE=images.PROJECT, VOICE_TOOLS_HTTPS_PORT=str(port), FLOWER_PORT=str(flower),
               VOICE_TOOLS_PUBLIC_URL=url)
    stack = Stack(name, folder, env, url, ca)
    started = time.monotonic()
    try:
        gateway = _gateway(f"{name}_default")
        password, flower_password = secrets.token_hex(16), secrets.token_hex(8)
        (folder / "deploy" / "compose" / "postgres.env").write_text(f"POSTGRES_PASSWORD={password}\n")
        lines = [
            f"DATABASE_URL=postgresql://voice_tools:{password}@postgres:5432/voice_tools",
            f"VOICE_TOOLS_API_TOKENS=relay:{TOKEN},ops:{ADMIN}:admin",
            f"VOICE_TOOLS_CALLBACK_SECRET={CALLBACK_SECRET}",
            f"VOICE_TOOLS_CALLBACK_SECRETS={WEBHOOK_SECRET}",
            f"VOICE_TOOLS_CALLBACK_HOSTS={gateway}",
            f"FLOWER_BASIC_AUTH=admin:{flower_password}",
            # a killed worker's links come back this soon (above the longest link's hard limit, 70 s)
            "VOICE_TOOLS_VISIBILITY_TIMEOUT=75",
            *_google_override(folder, gateway, google_port)]
        infra = INFRA
        if broker == "rabbitmq":
            rabbit = secrets.token_hex(12)
            (folder / "deploy" / "compose" / "rabbitmq.env").write_text(
                f"RABBITMQ_DEFAULT_USER=voice_tools\nRABBITMQ_DEFAULT_PASS={rabbit}\n")
            lines += [f"CELERY_BROKER_URL=amqp://voice_tools:{rabbit}@rabbitmq:5672/",
                      f"FLOWER_BROKER_API=http://voice_tools:{rabbit}@rabbitmq:15672/api/"]
            stack.profiles = ["--profile", "rabbitmq"]
            infra = (*INFRA, "rabbitmq")
        (folder / "deploy" / "compose" / "app.env").write_text("\n".join([*lines, ""]))
        stack.flower_url, stack.flower_auth = f"http://127.0.0.1:{flower}", ("admin", flower_password)
        # podman before 4.6 cannot wait for a service's health or completion (podman-compose would wait
        # forever for the migration): compose creates every container, then they start at once. The migration
        # waits for the database by itself, and the others for the schema it makes (/readyz, a worker's
        # bootstep, beat): the stack's start is its slowest process's, not the sum of them.
        stack.compose("up", "-d", "--no-start", "--no-deps", *infra, "migrate", *services)
        stack.start(*infra, "migrate")
        # the bridge has the gateway's address once a container is on it: the relay and Gmail listen there
        with Relay(CALLBACK_SECRET, webhook_secrets=[WEBHOOK_SECRET], host=gateway) as relay, \
                HttpDouble(host=gateway, port=google_port) as google:
            stack.relay, stack.gmail = relay, HeldGmail(google)
            stack.start(*(s for s in services if s != "front"))
            stack.start("front")  # nginx resolves the replicas' names as it starts: once they are on the network
            exited = images.podman("wait", stack.container("migrate"), timeout=300).stdout.strip()
            assert exited == "0", stack.logs("migrate")
            stack.wait_ready()
            images.timings[f"{broker} stack ready"] = time.monotonic() - started
            try:
                yield stack
            finally:
                stack.gmail.release()
    finally:
        cleaning = time.monotonic()
        stack.save_logs(folder / "logs")  # kept with pytest's temporary folders, for a failure's reading
        remove_project(name)
        images.timings[f"{broker} stack removed"] = time.monotonic() - cleaning


@pytest.fixture(scope="module")
def built():
    why = images.usable()
    if why:
        pytest.skip(why)
    remove_abandoned_projects()
    made = images.everything()
    made["rabbitmq"] = images.rabbitmq()
    return made


@pytest.fixture(scope="module")
def rabbitmq_stack_starting(built, tmp_path_factory):
    """The rabbitmq profile's stack, started in a thread while the Redis stack's tests run."""
    folder = tmp_path_factory.mktemp("compose-rabbitmq")
    with contextlib.ExitStack() as exits, concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(exits.enter_context, started_stack(folder, "rabbitmq", RABBIT_SERVICES))
        try:
            yield future
        finally:
            with contextlib.suppress(BaseException):
                future.result()  # its start ends (or fails) before it is taken down


@pytest.fixture(scope="module")
def stack(built, rabbitmq_stack_starting, tmp_path_factory):
    try:
        with started_stack(tmp_path_factory.mktemp("compose-redis"), "redis", SERVICES) as s:
            yield s
    finally:
        print("container test timings (s):", {k: round(v, 1) for k, v in images.timings.items()})


@pytest.fixture
def rabbitmq_stack(rabbitmq_stack_starting):
    return rabbitmq_stack_starting.result(timeout=900)


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


def _sent_once(stack: Stack, call_id: str) -> None:
    """One message at Gmail for the call, the one its result names; one completed callback, every one verified."""
    result = stack.call("GET", f"/voice-tools/status/{call_id}")
    assert result["status"] == "COMPLETED", result
    sent = stack.gmail.sent_for(call_id)
    assert [m["id"] for m in sent] == [result["result"]["message_id"]], (sent, result)
    stack.relay.wait_for(call_id, "completed", timeout=120)
    events = _verified(stack.relay, call_id)
    assert "checkpoint" in events and events[-1] == "completed" and events.count("completed") == 1, events


def _relay_flow(stack: Stack, session: str) -> str:
    call_id = _email_through_checkpoint(stack, session)
    resumed = stack.call("POST", f"/voice-tools/resume/{call_id}?wait=30", (200,), json={"action": "proceed"})
    assert resumed["status"] == "COMPLETED", resumed
    _sent_once(stack, call_id)
    assert stack.mcp("get_status", {"tool_call_id": call_id})["status"] == "COMPLETED"
    return call_id


def test_a_relays_flow_through_the_tls_front_rest_and_mcp(stack):
    _relay_flow(stack, "sess_containers_flow")
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
    # back on a new address: the front reloaded (as the docs say) sends it requests again
    stack.exec("front", "nginx", "-s", "reload")
    mark = "probe" + secrets.token_hex(8)  # the request id of these requests alone: web-1's access log shows one
    deadline = time.monotonic() + 60
    while mark not in images.podman("logs", stack.container("web-1")).stdout:
        answer = stack.http.get(f"{stack.url}/readyz", headers={"X-Request-ID": mark}, timeout=10)
        assert answer.status_code == 200, answer.text[:500]
        assert time.monotonic() < deadline, stack.logs("front")[-3000:]
        time.sleep(0.2)


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
    _sent_once(stack, call_id)


def test_a_worker_container_killed_mid_send_sends_the_email_once(stack):
    call_id = _email_through_checkpoint(stack, "sess_containers_kill")
    stack.gmail.hold()  # Gmail takes the send, sends, and does not answer
    answer = stack.http.post(f"{stack.url}/voice-tools/resume/{call_id}", json={"action": "proceed"}, timeout=60)
    assert answer.status_code in (200, 202), answer.text
    assert stack.gmail.in_flight.wait(120), stack.logs("writes")[-3000:]
    sending = stack.call("GET", f"/voice-tools/status/{call_id}")
    assert (sending["status"], sending["current_step"]) == ("EXECUTING", "SENDING"), sending
    images.podman("kill", "-s", "KILL", stack.container("writes"))  # its send at Gmail, unanswered
    assert images.podman("inspect", "--format", "{{.State.Running}}", stack.container("writes")).stdout.strip() == "false"
    stack.gmail.release()  # the answer goes to a connection whose process is gone
    assert len(stack.gmail.sent_for(call_id)) == 1
    images.podman("start", stack.container("writes"))
    # the link the killed worker held comes back after the visibility timeout; its claim's lease has ended by
    # then, so the copy knows an earlier attempt may have acted: it looks in the sent mail before sending
    deadline = time.monotonic() + 300
    while stack.call("GET", f"/voice-tools/status/{call_id}")["status"] not in ("COMPLETED", "FAILED"):
        assert time.monotonic() < deadline, stack.logs("writes")[-3000:]
        time.sleep(2)
    _sent_once(stack, call_id)
    searched = [r for r in stack.gmail.api.requests_to("GET", r"/messages$")
                if r.query.get("q") == [f"rfc822msgid:{stack.gmail.sent_for(call_id)[0]['message_id'].strip('<>')}"]]
    assert searched, "the redelivered send never looked for the message the killed one had sent"


def test_the_rabbitmq_profile_carries_a_relays_flow(rabbitmq_stack):
    stack = rabbitmq_stack
    _relay_flow(stack, "sess_containers_rabbitmq")
    # the chains went through RabbitMQ: its queues are the tools' (quorum), Redis has none of them
    queues = dict(line.split("\t")[:2] for line in stack.exec(
        "rabbitmq", "rabbitmqctl", "-q", "list_queues", "--no-table-headers", "name", "type").splitlines())
    assert queues.get("tools.send_email") == "quorum", queues
    assert stack.exec("redis", "redis-cli", "exists", "tools.send_email") == "0"
    # Flower reads the queues' lengths from RabbitMQ's management API (app.env's FLOWER_BROKER_API). The
    # API's figures are RabbitMQ's statistics, sampled every few seconds: the last link's message (acked
    # once the call was COMPLETED) may still count there for a while, and a queue not yet sampled has no
    # figure at all: the queue is empty within a deadline.
    deadline = time.monotonic() + 60
    while True:
        answer = requests.get(f"{stack.flower_url}/api/queues/length", auth=stack.flower_auth, timeout=30)
        assert answer.status_code == 200, answer.text[:1000]
        lengths = {q["name"]: q.get("messages") for q in answer.json()["active_queues"]}
        if lengths.get("tools.send_email") == 0:
            break
        assert time.monotonic() < deadline, (lengths, answer.text[:1000], stack.logs("flower")[-2000:])
        time.sleep(2)
