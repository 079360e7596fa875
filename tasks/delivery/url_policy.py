"""Which callback URLs may be called (docs/relay-guide.md, Callbacks, "Delivery: what is refused and
why"): the allowlist, checked when a URL is given (:func:`url_error`) and again before every attempt
(:func:`delivery_route`).

A URL's host must be listed in ``VOICE_TOOLS_CALLBACK_HOSTS``; no port this system listens on is
called on a local address; no address of the IANA special-purpose registries is called unless it is
listed itself. A host name is resolved once before each attempt, refused if any of its addresses is
not allowed, and the attempt connects to the address checked; a name that does not resolve is not
sent (the attempt fails and is retried). Without a signing secret nothing is sent.
"""
from __future__ import annotations

import ipaddress
import socket
import unicodedata
from dataclasses import dataclass
from urllib.parse import urlsplit

from models import settings
from tasks.delivery.signing import secret_error

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

# The IANA IPv4 and IPv6 special-purpose address registries, every entry (whether or not marked
# globally reachable: no relay sits on an anycast of AS112, AMT, PCP or TURN), with multicast and
# the deprecated site-local and IPv4-compatible ranges. The prefixes that carry an IPv4 address
# (IPv4-mapped, the NAT64 well-known prefix, 6to4) are judged by the address they carry.
SPECIAL_PURPOSE = tuple(ipaddress.ip_network(net) for net in (
    "0.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8", "169.254.0.0/16", "172.16.0.0/12",
    "192.0.0.0/24", "192.0.2.0/24", "192.31.196.0/24", "192.52.193.0/24", "192.88.99.0/24",
    "192.168.0.0/16", "192.175.48.0/24", "198.18.0.0/15", "198.51.100.0/24", "203.0.113.0/24",
    "224.0.0.0/4", "240.0.0.0/4",
    "::/96", "64:ff9b:1::/48", "100::/64", "100:0:0:1::/64", "2001::/23", "2001:2::/48", "2001:3::/32",
    "2001:4:112::/48", "2001:10::/28", "2001:20::/28", "2001:30::/28", "2001:db8::/32",
    "2620:4f:8000::/48", "3fff::/20", "5f00::/16", "fc00::/7", "fe80::/10", "fec0::/10", "ff00::/8",
))
NAT64 = ipaddress.ip_network("64:ff9b::/96")
SIX_TO_FOUR = ipaddress.ip_network("2002::/16")


def _own(port: int) -> str | None:
    """``"API port"`` (MCP, worker metrics, Flower; ``"port"`` for another) if this system listens on ``port``."""
    ports = settings.own_ports()
    if port not in ports:
        return None
    return f"{ports[port]} port".lstrip()


def url_error(url: str, allowed: list[str] | None = None) -> str | None:
    """Why ``url`` may not be a callback_url, or None if it may.

    It holds no whitespace nor control character (percent-encoded, they are data; raw, a CR LF could
    end a header line of a request that carried the URL as given). Its host (and port, when the entry
    names one; a bare host admits any port) must be listed in ``VOICE_TOOLS_CALLBACK_HOSTS``. An IP
    literal of a special-purpose
    range (private, loopback, link-local, shared, documentation, ...) is refused unless it
    is listed itself. The ports this system listens on (``settings.own_ports``) on a
    local address are refused whatever is listed.
    """
    allowed = settings.load().callback_hosts if allowed is None else allowed
    unprintable = _unprintable(url)
    if unprintable is not None:
        return (f"must not hold whitespace or control characters ({unprintable!a} at {url.index(unprintable)}); "
                "percent-encode them")
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
    own = _own(port)
    if own is not None and _is_local(host):
        return f"port {port} on {host} is this system's own {own}"
    if _listed(host, port, allowed):
        return None
    try:
        ip = ipaddress.ip_address(host)
        if _inside(ip):
            return f"host {host} is a private address and is not in VOICE_TOOLS_CALLBACK_HOSTS"
    except ValueError:
        pass
    return f"host {host} is not in VOICE_TOOLS_CALLBACK_HOSTS"


def _unprintable(url: str) -> str | None:
    """The first character of ``url`` that no URI holds: whitespace (a space, a tab, CR, LF, a Unicode
    space or line separator) or a control or format character. A URI carries them percent-encoded."""
    return next((c for c in url if c.isspace() or unicodedata.category(c)[0] in "CZ"), None)


def _listed(host: str, port: int, allowed: list[str]) -> bool:
    for entry in allowed:
        name, _, entry_port = entry.lower().rpartition(":") if _has_port(entry) else (entry.lower(), "", "")
        if name.strip("[]") == host and (not entry_port or int(entry_port) == port):
            return True
    return False


def _has_port(entry: str) -> bool:
    head, sep, tail = entry.rpartition(":")
    return bool(sep) and tail.isdigit() and (not head.count(":") or head.endswith("]"))


def _inside(ip: IPAddress) -> bool:
    """Not a public address: in a special-purpose registry (private, loopback, link-local = cloud
    metadata, shared, documentation, ...), reserved, unspecified or multicast; an address that
    carries an IPv4 address (IPv4-mapped, NAT64, 6to4) is judged by the one it carries."""
    carried = _carried(ip)
    if carried is not None:
        return _inside(carried)
    return (any(ip in net for net in SPECIAL_PURPOSE if net.version == ip.version)
            or ip.is_private or ip.is_loopback or ip.is_link_local or ip.is_reserved or ip.is_unspecified
            or ip.is_multicast)


def _carried(ip: IPAddress) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 address stands for: IPv4-mapped, the NAT64 well-known prefix, 6to4."""
    if not isinstance(ip, ipaddress.IPv6Address):
        return None
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip in NAT64:
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return ip.sixtofour  # 2002::/16, else None


def _is_local(host: str) -> bool:
    """Is ``host`` this machine: a loopback or unspecified address, localhost, or one of its interfaces'?"""
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    carried = _carried(ip)
    if carried is not None:
        ip = carried
    return ip.is_loopback or ip.is_unspecified or str(ip) in _own_addresses()


def _own_addresses() -> set[str]:
    try:
        import psutil
    except ImportError:  # pragma: no cover - psutil comes with the run command's dependencies
        return set()
    return {a.address.split("%")[0] for addrs in psutil.net_if_addrs().values() for a in addrs
            if a.family in (socket.AF_INET, socket.AF_INET6)}


@dataclass(frozen=True)
class Route:
    """Where an attempt goes, decided just before it: nowhere (``refusal``, ``final`` when retrying
    would be refused the same way), or the URL with the name pinned to ``address`` (None: an IP
    literal, or the name is the callback proxy's to resolve), through ``proxy`` if one is set."""

    refusal: str | None = None
    final: bool = True
    address: str | None = None
    proxy: str | None = None


def delivery_route(url: str, cfg: settings.Settings | None = None) -> Route:
    """Checked again before every attempt (docs/relay-guide.md, Callbacks, "Delivery: what is refused and why").

    The URL must pass :func:`url_error` with the allowlist of the moment (a host
    removed since the call was recorded is not posted to), and the signing secret
    must be set (and each of ``VOICE_TOOLS_CALLBACK_SECRETS`` be a ``whsec_`` secret). A host name is resolved now, once: if any of its addresses is not
    public the address itself must be listed (a listed name does not admit an inside
    address, except ``localhost``, which is loopback by definition), and no address may
    be this system's own port; the attempt then connects to the first address checked
    here, never to a second DNS answer. A name that does not resolve is not sent: the
    attempt fails (not final: retried like any failure). With ``VOICE_TOOLS_CALLBACK_PROXY``
    the proxy is the only hop and resolves the name itself: a name that resolves here is
    still checked, one that does not is left to the proxy. ``cfg``: the settings already read.
    """
    cfg = cfg or settings.load()
    proxy = cfg.callback_proxy or None
    if not cfg.callback_secret.strip():
        return Route("refused: VOICE_TOOLS_CALLBACK_SECRET is empty; an unsigned callback is not sent")
    for position, secret in enumerate(cfg.callback_secrets, 1):
        reason = secret_error(secret)
        if reason is not None:
            return Route(f"refused: secret {position} of VOICE_TOOLS_CALLBACK_SECRETS {reason}")
    reason = url_error(url, cfg.callback_hosts)
    if reason is not None:
        return Route(f"refused: the callback URL {reason}")
    parts = urlsplit(url)
    host = parts.hostname.lower()
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        ipaddress.ip_address(host)
        return Route(proxy=proxy)  # an IP literal: url_error has judged it
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        if proxy:
            return Route(proxy=proxy)
        return Route(f"{host} does not resolve: {exc}"[:500], final=False)
    addresses = list(dict.fromkeys(info[4][0].split("%")[0] for info in infos))
    if not addresses:
        return Route(f"{host} does not resolve: no address", final=False)
    loopback_name = host == "localhost" or host.endswith(".localhost")
    own = _own(port)
    for address in addresses:
        ip = ipaddress.ip_address(address)
        if own is not None and _is_local(address):
            return Route(f"refused: {host} resolves to {address}, and port {port} is this system's own {own}")
        if _inside(ip) and not _listed(address, port, cfg.callback_hosts) and not (loopback_name and ip.is_loopback):
            return Route(f"refused: {host} resolves to {address}, a private address that is not itself in "
                         "VOICE_TOOLS_CALLBACK_HOSTS")
    return Route(address=None if proxy else addresses[0], proxy=proxy)
