"""Which callback URLs may be called (docs/relay-guide.md, Callbacks): the allowlist, checked when a URL
is given (:func:`url_error`) and again before every attempt (:func:`delivery_refusal`).

A URL's host must be listed in ``VOICE_TOOLS_CALLBACK_HOSTS``; this system's own ports on
a local address are never called; a host name is resolved before each attempt and
refused if it points inside unless that address is listed, and the attempt connects to
the address that was checked. Without a signing secret nothing is sent.
"""
from __future__ import annotations

import ipaddress
import os
import socket
from urllib.parse import urlsplit

from models import settings

OWN_PORTS = (("PORT", 8000, "API"), ("MCP_PORT", 8001, "MCP"), ("FLOWER_PORT", 5555, "Flower"))


def own_ports() -> dict[int, str]:
    """This system's own ports (the API, MCP and Flower; ``voice-tools run``'s defaults when unset)."""
    found = {}
    for name, default, face in OWN_PORTS:
        raw = os.environ.get(name, "").strip()
        found[int(raw) if raw.isdigit() else default] = face
    return found


def url_error(url: str, allowed: list[str] | None = None) -> str | None:
    """Why ``url`` may not be a callback_url, or None if it may.

    Its host (and port, when the entry names one; a bare host admits any port) must
    be listed in ``VOICE_TOOLS_CALLBACK_HOSTS``. An IP literal in a private,
    loopback or link-local range is refused unless it is listed itself. This
    system's own API, MCP and Flower ports on a local address are refused whatever
    is listed.
    """
    allowed = settings.load().callback_hosts if allowed is None else allowed
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return "is not a valid URL"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return "must be an http or https URL with a host"
    if parts.username is not None or parts.password is not None:
        return "must not hold credentials (user:password@); callbacks are signed instead"
    host = parts.hostname.lower()
    port = port or (443 if parts.scheme == "https" else 80)
    own = own_ports().get(port)
    if own is not None and _is_local(host):
        return f"port {port} on {host} is this system's own {own} port"
    if _listed(host, port, allowed):
        return None
    try:
        ip = ipaddress.ip_address(host)
        if _inside(ip):
            return f"host {host} is a private address and is not in VOICE_TOOLS_CALLBACK_HOSTS"
    except ValueError:
        pass
    return f"host {host} is not in VOICE_TOOLS_CALLBACK_HOSTS"


def _listed(host: str, port: int, allowed: list[str]) -> bool:
    for entry in allowed:
        name, _, entry_port = entry.lower().rpartition(":") if _has_port(entry) else (entry.lower(), "", "")
        if name.strip("[]") == host and (not entry_port or int(entry_port) == port):
            return True
    return False


def _has_port(entry: str) -> bool:
    head, sep, tail = entry.rpartition(":")
    return bool(sep) and tail.isdigit() and (not head.count(":") or head.endswith("]"))


def _inside(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """Not a public address: private, loopback, link-local (cloud metadata), reserved, unspecified, multicast."""
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return (ip.is_private or ip.is_loopback or ip.is_link_local or ip.is_reserved or ip.is_unspecified
            or ip.is_multicast)


def _is_local(host: str) -> bool:
    """Is ``host`` this machine: a loopback or unspecified address, localhost, or one of its interfaces'?"""
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback or ip.is_unspecified or str(ip) in _own_addresses()


def _own_addresses() -> set[str]:
    try:
        import psutil
    except ImportError:  # pragma: no cover - psutil comes with the run command's dependencies
        return set()
    return {a.address.split("%")[0] for addrs in psutil.net_if_addrs().values() for a in addrs
            if a.family in (socket.AF_INET, socket.AF_INET6)}


def delivery_refusal(url: str, cfg: settings.Settings | None = None) -> tuple[str | None, str | None]:
    """Checked again before every attempt: ``(why not, None)`` or ``(None, address to connect to)``.

    The URL must pass :func:`url_error` with the allowlist of the moment (a host
    removed since the call was recorded is not posted to), and the signing secret
    must be set. A host name is resolved now: if any of its addresses is not public
    (private, loopback, link-local, ...) the address itself must be listed (a listed
    name does not admit an inside address, except ``localhost``, which is loopback by
    definition), and no address may be this system's own port. The attempt then
    connects to the address checked here. A name that does not resolve is left to the
    request (an ordinary failed attempt, retried). ``cfg``: the settings already read by the caller.
    """
    cfg = cfg or settings.load()
    if not cfg.callback_secret.strip():
        return "refused: VOICE_TOOLS_CALLBACK_SECRET is empty; an unsigned callback is not sent", None
    reason = url_error(url, cfg.callback_hosts)
    if reason is not None:
        return f"refused: the callback URL {reason}", None
    parts = urlsplit(url)
    host = parts.hostname.lower()
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        ipaddress.ip_address(host)
        return None, None  # an IP literal: url_error has judged it
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        return None, None
    addresses = list(dict.fromkeys(info[4][0].split("%")[0] for info in infos))
    own = own_ports().get(port)
    loopback_name = host == "localhost" or host.endswith(".localhost")
    for address in addresses:
        ip = ipaddress.ip_address(address)
        if own is not None and _is_local(address):
            return f"refused: {host} resolves to {address}, and port {port} is this system's own {own} port", None
        if _inside(ip) and not _listed(address, port, cfg.callback_hosts) and not (loopback_name and ip.is_loopback):
            return (f"refused: {host} resolves to {address}, a private address that is not itself in "
                    f"VOICE_TOOLS_CALLBACK_HOSTS"), None
    return None, addresses[0] if addresses else None
