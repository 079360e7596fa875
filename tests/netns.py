"""Hosts for the multi-host test: Linux network namespaces on a bridge of their own, in a private /24.

:class:`Network` makes one namespace per host (``<prefix>-<host>``), each joined by a veth pair
to a bridge (``<prefix>-br``) that also carries an address of the test's own side (``.1``), so
the test process reaches every host and no host reaches anything else. A host's processes run
through :meth:`Network.popen` (``ip netns exec`` and ``unshare --uts``, so that each host has
its own host name, as Celery's ``%h`` names a worker by it); a host is cut off by its link
(:meth:`Network.link`) and lost by SIGKILL of every process in its namespace
(:meth:`Network.kill_host`). A thread of the test process enters a host with :func:`enter`
(``setns(2)`` moves the calling thread alone; threads it starts afterwards start there too).

Everything is named with the prefix, so :func:`remove_leftovers` clears what a killed run left.
Root only (``ip netns``).
"""
from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Mapping, Sequence

CLONE_NEWNET = 0x40000000
NETNS_DIR = Path("/var/run/netns")


def ip(*args: str, check: bool = True) -> str:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


def unavailable() -> str | None:
    """Why namespaces cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "the multi-host test makes network namespaces: it needs root"
    if shutil.which("ip") is None or shutil.which("unshare") is None:
        return "the multi-host test needs `ip` (iproute2) and `unshare` (util-linux)"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"`ip netns` is unavailable: {probe.stderr.strip()}"
    return None


def pids_in(namespace: str) -> list[int]:
    """The processes in ``namespace`` (never this one: only threads of it enter a namespace)."""
    out = ip("netns", "pids", namespace, check=False)
    return [int(pid) for pid in out.split() if pid.isdigit() and int(pid) != os.getpid()]


def remove_leftovers(prefix: str) -> None:
    """Remove every namespace (killing its processes), bridge and veth whose name starts with ``prefix``."""
    for line in ip("netns", "list", check=False).splitlines():
        name = line.split()[0] if line.strip() else ""
        if name.startswith(f"{prefix}-"):
            for pid in pids_in(name):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            ip("netns", "delete", name, check=False)
    for line in ip("-o", "link", "show", check=False).splitlines():
        name = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
        if name.startswith(f"{prefix}-"):
            ip("link", "delete", name, check=False)


class Network:
    def __init__(self, prefix: str, subnet: str, hosts: Mapping[str, int]):
        """``subnet``: the first three octets of a private /24 (e.g. ``10.213.7``); ``hosts``: name -> last octet."""
        assert 1 not in hosts.values(), ".1 is the test's own side of the bridge"
        self.prefix, self.subnet, self.hosts = prefix, subnet, dict(hosts)
        self.bridge = f"{prefix}-br"
        self.procs: list[subprocess.Popen] = []
        for name in hosts:
            assert len(self.veth(name)) <= 15, f"interface name too long: {self.veth(name)}"

    def address(self, host: str) -> str:
        return f"{self.subnet}.{self.hosts[host]}"

    @property
    def own_address(self) -> str:
        return f"{self.subnet}.1"

    def namespace(self, host: str) -> str:
        return f"{self.prefix}-{host}"

    def veth(self, host: str) -> str:
        """The host side of the host's veth pair (its end inside the namespace is ``eth0``)."""
        return f"{self.prefix}-{host}"

    # -- making and removing -----------------------------------------------------------

    def create(self) -> "Network":
        remove_leftovers(self.prefix)
        ip("link", "add", self.bridge, "type", "bridge")
        ip("addr", "add", f"{self.own_address}/24", "dev", self.bridge)
        ip("link", "set", self.bridge, "up")
        for host in self.hosts:
            ns, veth = self.namespace(host), self.veth(host)
            ip("netns", "add", ns)
            ip("link", "add", veth, "type", "veth", "peer", "name", f"{veth}-n")
            ip("link", "set", f"{veth}-n", "netns", ns)
            ip("-n", ns, "link", "set", f"{veth}-n", "name", "eth0")
            ip("-n", ns, "addr", "add", f"{self.address(host)}/24", "dev", "eth0")
            ip("-n", ns, "link", "set", "eth0", "up")
            ip("-n", ns, "link", "set", "lo", "up")
            ip("link", "set", veth, "master", self.bridge)
            ip("link", "set", veth, "up")
        return self

    def remove(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        remove_leftovers(self.prefix)
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                pass

    # -- processes ---------------------------------------------------------------------

    def argv(self, host: str, argv: Sequence[str]) -> list[str]:
        """``argv`` run on ``host``: in its namespace, with its own host name."""
        return ["ip", "netns", "exec", self.namespace(host), "unshare", "--uts", "sh", "-c",
                f'hostname {host} && exec "$@"', "sh", *argv]

    def popen(self, host: str, argv: Sequence[str], *, env: Mapping[str, str], log: Path,
              cwd: Path | None = None) -> subprocess.Popen:
        """Start ``argv`` on ``host`` in a process group of its own, its output appended to ``log``."""
        with open(log, "ab") as sink:
            proc = subprocess.Popen(self.argv(host, argv), env=dict(env), cwd=cwd, start_new_session=True,
                                    stdin=subprocess.DEVNULL, stdout=sink, stderr=subprocess.STDOUT)
        self.procs.append(proc)
        return proc

    def run(self, host: str, argv: Sequence[str], **kw) -> subprocess.CompletedProcess:
        return subprocess.run(["ip", "netns", "exec", self.namespace(host), *argv], **kw)

    # -- faults ------------------------------------------------------------------------

    def link(self, host: str, up: bool) -> None:
        """Take ``host``'s link down (nothing in or out, no reset sent) or up again."""
        ip("link", "set", self.veth(host), "up" if up else "down")

    def kill_host(self, host: str) -> int:
        """SIGKILL every process in ``host``'s namespace (again until none is left); how many there were."""
        killed: set[int] = set()
        deadline = time.monotonic() + 10
        while (pids := pids_in(self.namespace(host))) and time.monotonic() < deadline:
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed.add(pid)
                except ProcessLookupError:
                    pass
            time.sleep(0.05)
        for proc in self.procs:  # reap our own children among them
            if proc.poll() is None and proc.pid in killed:
                try:
                    proc.wait(5)
                except subprocess.TimeoutExpired:
                    pass
        return len(killed)


_libc = ctypes.CDLL(None, use_errno=True)


@contextmanager
def enter(namespace: str) -> Iterator[None]:
    """Move the calling thread into ``namespace``'s network (and back on leaving): the sockets it
    opens meanwhile, and the threads it starts meanwhile, are that host's."""
    home = os.open(f"/proc/self/task/{threading.get_native_id()}/ns/net", os.O_RDONLY)
    there = os.open(NETNS_DIR / namespace, os.O_RDONLY)
    try:
        if _libc.setns(there, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {namespace}")
        try:
            yield
        finally:
            if _libc.setns(home, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "setns back")
    finally:
        os.close(there)
        os.close(home)
