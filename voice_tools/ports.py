"""The ports ``voice-tools run`` listens on, checked before it starts anything: a taken one is said in plain words,
with the variable that moves it."""
from __future__ import annotations

import socket
from typing import Mapping

# (variable, default, who listens there): every port a local run's processes bind on HOST
RUN_PORTS = (("PORT", 8000, "the API"), ("MCP_PORT", 8001, "the MCP server"),
             ("WORKER_METRICS_PORT", 9101, "the workers' metrics"), ("FLOWER_PORT", 5555, "Flower"))
DEFAULT_HOST = "127.0.0.1"  # a local run's HOST unless set


def wanted(env: Mapping[str, str]) -> list[tuple[str, str, str]]:
    """``(variable, value, who)`` for each port of the run, its variable's value or its default."""
    return [(name, (env.get(name) or "").strip() or str(default), who) for name, default, who in RUN_PORTS]


def is_taken(host: str, port: int) -> bool:
    """Whether binding ``host:port`` fails as the servers' own bind would (with SO_REUSEADDR, as they set it)."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError:
            return True
    return False


def holder(port: int) -> str | None:
    """Which process listens on ``port`` (``process 1234, nginx``), when this user may see it."""
    import psutil

    try:
        for conn in psutil.net_connections(kind="inet"):
            if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port and conn.pid:
                return f"process {conn.pid}, {psutil.Process(conn.pid).name()}"
    except (psutil.Error, OSError):
        pass
    return None


def free_after(host: str, port: int, avoid: set[int]) -> int:
    """The first port above ``port`` that is free on ``host`` and not in ``avoid``: a suggestion (added to
    ``avoid``, so the next suggestion is another port)."""
    candidate = port + 1
    while candidate < 65535 and (candidate in avoid or is_taken(host, candidate)):
        candidate += 1
    avoid.add(candidate)
    return candidate


def problems(env: Mapping[str, str]) -> list[str]:
    """A sentence for each port of the run that it could not listen on (none: every port is free)."""
    host = (env.get("HOST") or "").strip() or DEFAULT_HOST
    said: list[str] = []
    seen: dict[int, str] = {}
    ports = wanted(env)
    numbers = {int(value) for _, value, _ in ports if value.isdigit()}  # and each suggestion made, as it is made
    for name, value, who in ports:
        if not value.isdigit() or not 0 < int(value) < 65536:
            said.append(f"{name}={value!r} is not a port number ({who} listens on {name})")
            continue
        port = int(value)
        if port in seen:
            said.append(f"{name} and {seen[port]} are both {port}: {who} needs a port of its own; set {name} to another")
            continue
        seen[port] = name
        if is_taken(host, port):
            by = holder(port)
            suggestion = free_after(host, port, numbers)
            said.append(f"port {port} on {host} is taken{f' (by {by})' if by else ' by another program'}: "
                        f"{who} listens there; stop that program or set {name} to a free port "
                        f"(e.g. {name}={suggestion} voice-tools run)")
    return said
