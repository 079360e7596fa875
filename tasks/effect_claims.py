"""Who holds a side effect's claim (docs/promises.md, "Exactly once"): an attempt's token names its
host, its process and a nonce, so a copy of the link can tell a holder killed on this host (its
copy need not wait for the lease to end) from one that may still run (it waits)."""
from __future__ import annotations

import os
import socket
import uuid


def _this_host() -> str:
    """This host and process namespace, as a claim token names them (``pid`` is only meaningful within one)."""
    try:
        namespace = os.readlink("/proc/self/ns/pid").strip("pid:[]")
    except OSError:
        namespace = ""
    return f"{socket.gethostname()[:24]}/{namespace}"


THIS_HOST = _this_host()


def claim_token() -> str:
    """A new attempt's claim on a side effect: where it runs (host, process) and a nonce."""
    return f"{THIS_HOST}:{os.getpid()}:{uuid.uuid4().hex[:12]}"


def holder_gone(token: str | None) -> bool:
    """Did the claim's holder run in a process of this host that is gone (a pool child or a worker
    killed mid-link)? Then its copy, handed back by the broker, need not wait for the lease to end.
    False whenever it cannot be told (another host: the lease is the bound)."""
    host, _, rest = (token or "").partition(":")
    pid_text = rest.partition(":")[0]
    if host != THIS_HOST or not pid_text.isdigit() or int(pid_text) == os.getpid():
        return False
    pid = int(pid_text)
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
