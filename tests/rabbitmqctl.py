"""``rabbitmqctl`` for the RabbitMQ tests: virtual hosts, policies, and what RabbitMQ lists.

The command is ``VOICE_TOOLS_TEST_RABBITMQCTL`` when set (e.g. ``docker exec rabbitmq
rabbitmqctl`` for a RabbitMQ in a container), else ``rabbitmqctl`` on PATH (these
machines have it).
"""
from __future__ import annotations

import os
import shlex
import shutil
import subprocess


def command() -> list[str] | None:
    given = os.environ.get("VOICE_TOOLS_TEST_RABBITMQCTL", "").strip()
    if given:
        return shlex.split(given)
    found = shutil.which("rabbitmqctl")
    return [found] if found else None


def run(*args: str) -> str:
    ctl = command()
    if ctl is None:
        raise RuntimeError("no rabbitmqctl on PATH: set VOICE_TOOLS_TEST_RABBITMQCTL to the command")
    return subprocess.run([*ctl, "-q", *args], check=True, capture_output=True, text=True, timeout=60).stdout


def listed(what: str, vhost: str, *columns: str) -> list[tuple[str, ...]]:
    """``rabbitmqctl list_<what> -p vhost columns...``: one tuple per row."""
    out = run(f"list_{what}", "-p", vhost, "--no-table-headers", *columns)
    return [tuple(line.split("\t")) for line in out.splitlines() if line.count("\t") == len(columns) - 1]
