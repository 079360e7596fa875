"""Where a callback may go (docs/relay-guide.md, Callbacks, "Delivery: what is refused and why"):
a name is resolved once and the request connects to the address checked, or is refused; no
proxy from the environment; every port this system listens on is refused on a local address
however the system is started; no address of the IANA special-purpose registries is a relay's.

Real receivers on 127.0.0.x and the real requests/urllib3 stack; names are answered by a fake
name table put in front of ``socket.getaddrinfo`` (the one resolver both our check and urllib3 call).
"""
from __future__ import annotations

import ipaddress
import socket
import threading
from pathlib import Path
from typing import Any

import pytest

from tasks.delivery import attempts
from tasks.delivery import url_policy
from tests.helpers import delivery, progress_event

ROOT = Path(__file__).resolve().parent.parent


class Receiver:
    """An HTTP/1.1 relay on ``address`` (keeps connections alive) that records each request's Host and target."""

    def __init__(self, address: str = "127.0.0.1", port: int = 0):
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.seen: list[tuple[str, str]] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                receiver.seen.append((self.headers.get("Host", ""), self.path))
                body = b'{"received": true}'
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.httpd = ThreadingHTTPServer((address, port), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.url = f"http://{address}:{self.port}/cb"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def receivers():
    made: list[Receiver] = []

    def _make(*args: Any) -> Receiver:
        made.append(Receiver(*args))
        return made[-1]

    yield _make
    for receiver in made:
        receiver.close()


@pytest.fixture
def names(monkeypatch):
    """A fake name table for ``*.test`` names: ``table[name]`` is a list of answers, one per lookup
    (the last one repeats); an answer is an address or None (the name does not resolve).
    Every other lookup goes to the real resolver. Returns (table, lookups made)."""
    table: dict[str, list[str | None]] = {}
    asked: list[str] = []
    real = socket.getaddrinfo

    def getaddrinfo(host: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
        name = host.decode() if isinstance(host, bytes) else host
        if not (isinstance(name, str) and name.endswith(".test")):
            return real(host, port, *args, **kwargs)
        asked.append(name)
        answers = table.get(name) or [None]
        answer = answers.pop(0) if len(answers) > 1 else answers[0]
        if answer is None:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return real(answer, port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    return table, asked


def make_due(event_id: str) -> None:
    from models import db
    from models.calls import CallbackDelivery

    with db.session() as s:
        s.execute(CallbackDelivery.__table__.update().where(CallbackDelivery.event_id == event_id)
                  .values(next_attempt_at=None))


# -- a name is resolved once; the request goes to the address checked, or nowhere --------------

def test_a_name_that_does_not_resolve_is_not_handed_to_the_request(receivers, names, monkeypatch):
    """DNS rebinding: no answer at the check, 127.0.0.1 for whoever asks next."""
    table, asked = names
    receiver = receivers()
    table["rebind.test"] = [None, "127.0.0.1"]
    monkeypatch.setenv("VOICE_TOOLS_CALLBACK_HOSTS", "rebind.test")
    _, event_id = progress_event(f"http://rebind.test:{receiver.port}/cb")
    answer = attempts.attempt(event_id)
    assert (answer.attempted, answer.delivered) == (True, False)
    assert receiver.seen == []  # the request never resolved the name itself
    assert asked == ["rebind.test"]
    found = delivery(event_id)
    assert (found.state, found.attempts, found.response_code) == ("pending", 1, None)  # retried, as any failure
    assert found.last_error.startswith("rebind.test does not resolve")
    # The retry resolves it (now to 127.0.0.1, not listed): refused for good, still nothing sent.
    make_due(event_id)
    assert not attempts.attempt(event_id).delivered
    found = delivery(event_id)
    assert (found.state, found.attempts) == ("failed", 2)
    assert found.last_error.startswith("refused: rebind.test resolves to 127.0.0.1")
    assert receiver.seen == []


def test_the_request_goes_to_the_address_checked_not_a_pooled_one(receivers, names, monkeypatch):
    """Two attempts, the name's address changed between them: each connects to its own checked address
    (a kept-alive connection to the first address is not reused), with the name as Host."""
    table, _ = names
    first = receivers("127.0.0.1")
    try:
        second = receivers("127.0.0.2", first.port)
    except OSError as exc:
        pytest.skip(f"cannot listen on 127.0.0.2:{first.port}: {exc}")
    monkeypatch.setenv("VOICE_TOOLS_CALLBACK_HOSTS", "moving.test,127.0.0.1,127.0.0.2")
    url = f"http://moving.test:{first.port}/cb"
    table["moving.test"] = ["127.0.0.1"]
    _, one = progress_event(url)
    assert attempts.attempt(one).delivered
    assert first.seen == [(f"moving.test:{first.port}", "/cb")] and second.seen == []
    table["moving.test"] = ["127.0.0.2", "127.0.0.1"]  # checked: .2; anyone asking again: .1
    _, two = progress_event(url)
    assert attempts.attempt(two).delivered
    assert second.seen == [(f"moving.test:{first.port}", "/cb")]
    assert len(first.seen) == 1


def _certificate(tmp_path: Path, name: str) -> tuple[str, str]:
    """A self-signed certificate for ``name`` (its own CA): (certificate file, key file)."""
    from datetime import datetime, timedelta, timezone

    x509 = pytest.importorskip("cryptography.x509")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.now(timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - timedelta(minutes=5))
            .not_valid_after(now + timedelta(hours=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_file, key_file = tmp_path / f"{name}.pem", tmp_path / f"{name}.key"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_file), str(key_file)


def test_https_to_a_pinned_address_keeps_the_name_for_sni_and_the_certificate(receivers, names, monkeypatch, tmp_path):
    import ssl

    from tasks.delivery import transport

    table, _ = names
    table["secure.test"] = ["127.0.0.1"]
    cert, key = _certificate(tmp_path, "secure.test")
    relay = receivers()
    served_names: list[str | None] = []
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    context.sni_callback = lambda sock, name, ctx: served_names.append(name)
    relay.httpd.socket = context.wrap_socket(relay.httpd.socket, server_side=True)
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", cert)  # trusted by the callback session made next
    monkeypatch.setattr(transport, "_http", None)
    monkeypatch.setenv("VOICE_TOOLS_CALLBACK_HOSTS", "secure.test,127.0.0.1")
    _, event_id = progress_event(f"https://secure.test:{relay.port}/cb")
    assert attempts.attempt(event_id).delivered, delivery(event_id).last_error
    assert relay.seen == [(f"secure.test:{relay.port}", "/cb")]
    assert served_names == ["secure.test"]
    # A certificate for another name fails the check, though the address is the same.
    table["elsewhere.test"] = ["127.0.0.1"]
    monkeypatch.setenv("VOICE_TOOLS_CALLBACK_HOSTS", "secure.test,elsewhere.test,127.0.0.1")
    _, wrong = progress_event(f"https://elsewhere.test:{relay.port}/cb")
    assert not attempts.attempt(wrong).delivered
    assert "SSLError" in delivery(wrong).last_error and len(relay.seen) == 1


# -- no proxy from the environment -----------------------------------------------------------

def _environment_proxy(monkeypatch: pytest.MonkeyPatch, proxy: Receiver) -> None:
    base = proxy.url.rsplit("/", 1)[0]
    for name in ("HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.setenv(name, base)
    for name in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)


def test_an_environment_proxy_is_not_used(receivers, monkeypatch):
    relay, proxy = receivers(), receivers()
    _environment_proxy(monkeypatch, proxy)
    monkeypatch.delenv("VOICE_TOOLS_CALLBACK_PROXY", raising=False)
    _, event_id = progress_event(relay.url)
    assert attempts.attempt(event_id).delivered
    assert proxy.seen == []
    assert relay.seen == [(f"127.0.0.1:{relay.port}", "/cb")]


def test_the_callback_proxy_setting_is_the_one_hop(receivers, monkeypatch):
    relay, proxy, other = receivers(), receivers(), receivers()
    _environment_proxy(monkeypatch, other)
    monkeypatch.setenv("VOICE_TOOLS_CALLBACK_PROXY", proxy.url.rsplit("/", 1)[0])
    _, event_id = progress_event(relay.url)
    assert attempts.attempt(event_id).delivered
    assert proxy.seen == [(f"127.0.0.1:{relay.port}", relay.url)]  # an absolute URI: the proxy forwards it
    assert relay.seen == [] and other.seen == []
    # The target is still checked against the allowlist: the proxy does not widen it.
    monkeypatch.setenv("VOICE_TOOLS_CALLBACK_HOSTS", "relay.example.com")
    _, refused = progress_event(relay.url)
    assert not attempts.attempt(refused).delivered and len(proxy.seen) == 1
    assert delivery(refused).last_error.startswith("refused: the callback URL host 127.0.0.1")


# -- every port this system listens on, however it is started -----------------------------------

FACES = {"PORT": "API", "MCP_PORT": "MCP", "WORKER_METRICS_PORT": "worker metrics", "FLOWER_PORT": "Flower"}


def _run_processes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, procfile: str) -> tuple[dict[str, str], list[Any]]:
    """The environment ``voice-tools run`` gives each of its processes: the launcher's, then honcho's."""
    from honcho.environ import expand_processes, parse_procfile

    from voice_tools import launcher

    for name in (*FACES, "VOICE_TOOLS_API_PORT", "VOICE_TOOLS_OWN_PORTS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("VOICE_TOOLS_WORKER_METRICS_DIR", str(tmp_path / "w"))
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path / "a"))
    env, _ = launcher.run_environment(tmp_path)
    processes = parse_procfile((ROOT / procfile).read_text()).processes
    return env, expand_processes(processes, env=env)


@pytest.mark.parametrize("procfile", ["Procfile.local", "Procfile"])
def test_every_face_port_is_refused_in_every_process_of_the_run(tmp_path, monkeypatch, procfile):
    """honcho gives each process its own PORT (8000, 8100, ...): the API's port is still known to all."""
    from honcho.environ import parse_procfile

    run_env, processes = _run_processes(tmp_path, monkeypatch, procfile)
    ports = {name: run_env[name] for name in FACES}
    lines = set(parse_procfile((ROOT / procfile).read_text()).processes)
    assert {process.name.rsplit(".", 1)[0] for process in processes} == lines and len(lines) >= 2  # each line's own PORT
    for process in processes:
        with monkeypatch.context() as m:
            for name, value in process.env.items():
                m.setenv(name, value)
            for name, face in FACES.items():
                url = f"http://127.0.0.1:{ports[name]}/cb"
                found = url_policy.url_error(url, ["127.0.0.1"])
                assert found is not None and f"this system's own {face} port" in found, (process.name, url, found)


def test_extra_own_ports_and_the_worker_metrics_port(monkeypatch):
    monkeypatch.setenv("WORKER_METRICS_PORT", "9301")
    monkeypatch.setenv("VOICE_TOOLS_OWN_PORTS", "9401, 9402")
    assert "own worker metrics port" in url_policy.url_error("http://127.0.0.1:9301/cb", ["127.0.0.1"])
    assert "own port" in url_policy.url_error("http://localhost:9402/cb", ["localhost"])
    assert url_policy.url_error("http://127.0.0.1:9403/cb", ["127.0.0.1"]) is None


# -- the IANA special-purpose address registries --------------------------------------------------
# https://www.iana.org/assignments/iana-ipv4-special-registry and iana-ipv6-special-registry,
# every entry, plus multicast and the deprecated site-local and IPv4-compatible ranges.

IPV4_SPECIAL = [
    "0.0.0.0/8", "0.0.0.0/32", "10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8", "169.254.0.0/16",
    "172.16.0.0/12", "192.0.0.0/24", "192.0.0.0/29", "192.0.0.8/32", "192.0.0.9/32", "192.0.0.10/32",
    "192.0.0.170/32", "192.0.0.171/32", "192.0.2.0/24", "192.31.196.0/24", "192.52.193.0/24",
    "192.88.99.0/24", "192.168.0.0/16", "192.175.48.0/24", "198.18.0.0/15", "198.51.100.0/24",
    "203.0.113.0/24", "240.0.0.0/4", "255.255.255.255/32", "224.0.0.0/4",
]
IPV6_SPECIAL = [
    "::1/128", "::/128", "64:ff9b:1::/48", "100::/64", "100:0:0:1::/64", "2001::/23", "2001::/32",
    "2001:1::1/128", "2001:1::2/128", "2001:1::3/128", "2001:2::/48", "2001:3::/32", "2001:4:112::/48",
    "2001:10::/28", "2001:20::/28", "2001:30::/28", "2001:db8::/32", "2620:4f:8000::/48", "3fff::/20",
    "5f00::/16", "fc00::/7", "fe80::/10", "fec0::/10", "ff00::/8", "::/96",
]
# Prefixes that carry an IPv4 address: judged by the address they carry.
EMBEDDING = {
    "::ffff:{}": lambda v4: f"::ffff:{v4}",                                        # IPv4-mapped
    "64:ff9b::{}": lambda v4: f"64:ff9b::{v4}",                                    # NAT64 well-known prefix
    "2002:{}::": lambda v4: "2002:{:02x}{:02x}:{:02x}{:02x}::1".format(*map(int, v4.split("."))),  # 6to4
}


def _samples(network: str) -> list[str]:
    net = ipaddress.ip_network(network)
    return sorted({str(net.network_address), str(net.network_address + net.num_addresses // 2),
                   str(net.broadcast_address)})


def _verdict(address: str) -> str | None:
    host = f"[{address}]" if ":" in address else address
    return url_policy.url_error(f"http://{host}:9443/cb", ["relay.example.com"])


@pytest.mark.parametrize("network", IPV4_SPECIAL + IPV6_SPECIAL)
def test_every_special_purpose_address_is_refused(network):
    for address in _samples(network):
        assert _verdict(address) == f"host {ipaddress.ip_address(address)} is a private address and is not in " \
                                    "VOICE_TOOLS_CALLBACK_HOSTS", (network, address)


@pytest.mark.parametrize("prefix", sorted(EMBEDDING))
def test_an_embedded_ipv4_address_is_judged_by_itself(prefix):
    make = EMBEDDING[prefix]
    for inside in ("10.1.2.3", "127.0.0.1", "100.64.0.1", "169.254.169.254", "192.168.1.1"):
        assert "is a private address" in _verdict(make(inside)), (prefix, inside)
    for public in ("8.8.8.8", "93.184.216.34"):
        assert _verdict(make(public)).endswith("is not in VOICE_TOOLS_CALLBACK_HOSTS")
        assert "private" not in _verdict(make(public)), (prefix, public)


@pytest.mark.parametrize("address", ["8.8.8.8", "1.1.1.1", "100.128.0.1", "2606:4700:4700::1111", "2a00:1450::1"])
def test_a_public_address_is_only_refused_for_not_being_listed(address):
    host = ipaddress.ip_address(address)
    assert _verdict(address) == f"host {host} is not in VOICE_TOOLS_CALLBACK_HOSTS"


def test_a_name_resolving_to_shared_address_space_is_refused(receivers, names, monkeypatch):
    table, _ = names
    table["cgnat.test"] = ["100.64.0.1"]
    monkeypatch.setenv("VOICE_TOOLS_CALLBACK_HOSTS", "cgnat.test")
    _, event_id = progress_event("http://cgnat.test:9443/cb")
    assert not attempts.attempt(event_id).delivered
    found = delivery(event_id)
    assert found.state == "failed" and found.last_error.startswith("refused: cgnat.test resolves to 100.64.0.1")
