"""``voice-tools run`` with one of its ports taken: it says which, whose, and the variable that moves it, before
it starts anything (README, Run it; docs/operations.md, Running it locally)."""
from __future__ import annotations

import os
import socket
import subprocess

import pytest

from support.procs import free_port, voice_tools

WHO = {"PORT": "the API", "MCP_PORT": "the MCP server", "WORKER_METRICS_PORT": "the workers' metrics",
       "FLOWER_PORT": "Flower"}


@pytest.mark.parametrize("variable", list(WHO))
def test_a_taken_port_is_said_in_words_before_anything_starts(variable, tmp_path, monkeypatch):
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    taken = holder.getsockname()[1]
    ports = {name: str(taken if name == variable else free_port()) for name in WHO}
    for name, value in ports.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("HOST", raising=False)
    data_dir = tmp_path / "data"
    try:
        proc = voice_tools(data_dir, "run", stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out, err = proc.communicate(timeout=120)  # a bound for a hang only: it ends before starting anything
    finally:
        holder.close()
    assert proc.returncode == 1, out + err
    lines = out.splitlines()
    assert lines == [
        f"voice-tools: port {taken} on 127.0.0.1 is taken (by process {os.getpid()}, {_name()}): "
        f"{WHO[variable]} listens there; stop that program or set {variable} to a free port "
        f"(e.g. {variable}={lines[0].rsplit(f'{variable}=', 1)[1].split()[0]} voice-tools run)",
        "voice-tools: nothing was started"], out + err
    suggested = int(lines[0].rsplit(f"{variable}=", 1)[1].split()[0])
    assert suggested > taken and str(suggested) not in ports.values()
    assert not (data_dir / "postgres").exists() and "database" not in out  # no server was started
    assert not data_dir.exists(), sorted(data_dir.rglob("*"))  # nothing left behind: no run.lock, no data dir
    assert err == "", err  # nothing else on the terminal: no traceback, no library's warning


def _name() -> str:
    import psutil

    return psutil.Process().name()


def test_the_readmes_run_section_names_each_port_with_its_variable():
    from pathlib import Path

    from voice_tools import ports

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    section = readme.split("\n## Run it\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ")]
    for name, default, _who in ports.RUN_PORTS:
        assert any(f"127.0.0.1:{default}" in row and row.rstrip().endswith(f"| `{name}` |") for row in rows), name


def two_ports_in_a_row() -> list[socket.socket]:
    """Two listening sockets on consecutive ports of 127.0.0.1 (as 8000 and 8001 both taken)."""
    for _ in range(50):
        first = socket.socket()
        first.bind(("127.0.0.1", 0))
        second = socket.socket()
        try:
            second.bind(("127.0.0.1", first.getsockname()[1] + 1))
        except OSError:
            first.close()
            second.close()
            continue
        first.listen()
        second.listen()
        return [first, second]
    raise AssertionError("no two free ports in a row")


def test_the_ports_it_suggests_are_free_and_distinct(monkeypatch):
    """PORT and MCP_PORT on two taken ports in a row (8000 and 8001 taken): each sentence suggests a port of its
    own, free, and none of the run's other ports."""
    from voice_tools import ports

    held = two_ports_in_a_row()
    try:
        api, mcp = (s.getsockname()[1] for s in held)
        env = {"PORT": str(api), "MCP_PORT": str(mcp), "WORKER_METRICS_PORT": str(free_port()),
               "FLOWER_PORT": str(free_port())}
        said = ports.problems(env)
        suggested = {name: int(line.rsplit(f"{name}=", 1)[1].split()[0])
                     for line, name in zip(said, ("PORT", "MCP_PORT"))}
        assert len(said) == 2, said
        assert len(set(suggested.values())) == 2, said  # not PORT=8002 and MCP_PORT=8002
        assert not set(suggested.values()) & {int(v) for v in env.values()}, said
        assert not any(ports.is_taken("127.0.0.1", port) for port in suggested.values()), said
    finally:
        for s in held:
            s.close()
