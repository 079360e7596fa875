"""Who holds a side effect's claim (docs/promises.md, "Exactly once"): an attempt's token names where
its pid means something (the kernel's boot id and the pid namespace), its host's whole name for people
to read, its process and a nonce, so a copy of the link can tell a holder killed in this very boot and
namespace (its copy need not wait for the lease to end) from one that may still run (it waits)."""
from __future__ import annotations

import os
import socket
import uuid

BOOT_ID_FILE = "/proc/sys/kernel/random/boot_id"  # new at each boot of the kernel


def _boot_id() -> str:
    try:
        with open(BOOT_ID_FILE, encoding="ascii") as f:
            return f.read().strip()
    except (OSError, ValueError):
        return ""


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid").strip("pid:[]")
    except OSError:
        return ""


# Where this process's pids mean something: one boot of one kernel, one pid namespace ('' when
# either cannot be read: then no holder is ever taken for gone, and every claim waits for its lease).
BOOT_ID, PID_NAMESPACE = _boot_id(), _pid_namespace()
# A token's host: ``<boot id>/<pid namespace>/<host name>`` (the name is for people: two hosts
# cloned from one image share it; the boot id tells them apart).
THIS_HOST = f"{BOOT_ID}/{PID_NAMESPACE}/{socket.gethostname()}"


def claim_token() -> str:
    """A new attempt's claim on a side effect: where it runs (boot, namespace, host), its process and a nonce."""
    return f"{THIS_HOST}:{os.getpid()}:{uuid.uuid4().hex[:12]}"


def holder_of(token: str | None) -> tuple[str, str, str, int] | None:
    """``(boot id, pid namespace, host name, pid)`` of a token, or None for one that does not name them
    (a token of an older release named its host by a prefix of its name: it cannot be told, it waits)."""
    where, _, pid_text = (token or "").rpartition(":")[0].rpartition(":")
    parts = where.split("/", 2)
    if len(parts) != 3 or not parts[0] or not parts[1].isdigit() or not pid_text.isdigit():
        return None
    boot, ns, name = parts
    return boot, ns, name, int(pid_text)


def holder_gone(token: str | None) -> bool:
    """Did the claim's holder run in a process of this boot of this kernel and this pid namespace that is
    gone (a pool child or a worker killed mid-link)? Then its copy, handed back by the broker, need not
    wait for the lease to end. False whenever it cannot be told (another machine, another boot, another
    namespace, whatever its host's name: the lease is the bound)."""
    holder = holder_of(token)
    if holder is None or not BOOT_ID or not PID_NAMESPACE:
        return False
    boot, ns, _name, pid = holder
    if (boot, ns) != (BOOT_ID, PID_NAMESPACE) or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    try:  # a killed child not yet reaped by its parent
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False
