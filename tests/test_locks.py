"""The lock files hold on every Python that setup.cfg's ``python_requires`` allows, not only on the one
they were compiled on.

pip-compile keeps only what the compiling interpreter needs: a requirement whose marker is false there
(redis-py's ``async-timeout`` below Python 3.11.3, say) is left out, and ``pip install --require-hashes``
then refuses the lock on an interpreter where it is true (Debian 12's own Python is 3.11.2). This test
walks the requirements from setup.cfg (``install_requires`` and the locked extras) down through each pinned distribution's metadata
(the installed one, which is the lock's version), evaluating every marker as each allowed Python would,
and checks that each distribution it then needs is pinned in the lock, at a version its requirement takes,
and that each pin's ``Requires-Python`` takes that Python.
"""

from __future__ import annotations

import configparser
import re
from importlib import metadata
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

ROOT = Path(__file__).resolve().parents[1]

# The oldest and the newest patch releases of the minor lines the README and python_requires allow that
# differ in what they need (3.11.3 is where redis-py stops needing async-timeout), and Debian 12's 3.11.2.
PYTHONS = ("3.11.0", "3.11.2", "3.11.3", "3.11.7", "3.12.0", "3.13.0", "3.14.0")
LOCKS = {"requirements.lock": ("tracing",), "requirements-dev.lock": ("tracing", "dev")}


def _name(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(lock: str) -> dict[str, str]:
    text = (ROOT / lock).read_text()
    return {_name(n): v for n, v in re.findall(r"^([A-Za-z0-9_.\-]+)==(\S+)", text, re.M)}


def declared(extras: tuple[str, ...]) -> list[str]:
    """setup.cfg's requirements of the install and of ``extras``, each with its extra as a marker, as a built
    distribution's metadata would have them (read here from setup.cfg: an editable install's metadata is as old
    as its last install)."""
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")

    def lines(text: str) -> list[str]:
        return [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]

    found = lines(cfg["options"]["install_requires"])
    for extra in extras:
        for line in lines(cfg["options.extras_require"][extra]):
            req = Requirement(line)
            marker = f"({req.marker}) and extra == '{extra}'" if req.marker else f"extra == '{extra}'"
            found.append(f"{str(req).split(';')[0]}; {marker}")
    return found


def environment(python: str) -> dict[str, str]:
    env = default_environment()
    env.update(python_full_version=python, python_version=".".join(python.split(".")[:2]),
               implementation_name="cpython", platform_python_implementation="CPython",
               implementation_version=python)
    return env


def needed(python: str, extras: tuple[str, ...], lock: dict[str, str]) -> tuple[dict[str, set[str]], list[str]]:
    """What ``python`` needs of the lock, installing voice-tools with ``extras``: each distribution's name and
    who asked for it, and every fault found on the way (a name the lock lacks, a pin outside a range, a
    pin whose Requires-Python refuses ``python``)."""
    env, faults = environment(python), []
    wanted: dict[str, set[str]] = {}
    seen: set[tuple[str, frozenset[str]]] = set()
    todo = [("voice-tools", frozenset(extras), "the install")]
    while todo:
        name, asked, by = todo.pop()
        if (name, asked) in seen:
            continue
        seen.add((name, asked))
        dist = None if name == "voice-tools" else metadata.distribution(name)
        if dist is not None:
            if dist.version != lock[name]:
                faults.append(f"{name}: installed {dist.version}, the lock pins {lock[name]} (install from the lock)")
            wants_python = dist.metadata.get("Requires-Python")
            if wants_python and python not in SpecifierSet(wants_python):
                faults.append(f"{name}=={lock[name]} requires Python {wants_python}, not {python}")
        for line in declared(extras) if dist is None else dist.requires or []:
            req = Requirement(line)
            if req.marker and not any(req.marker.evaluate({**env, "extra": extra}) for extra in ("", *asked)):
                continue
            key = _name(req.name)
            wanted.setdefault(key, set()).add(f"{name} ({line})")
            if key not in lock:
                faults.append(f"{key} is needed on Python {python} by {name} ({line}) and is not in the lock")
                continue
            if not req.specifier.contains(lock[key], prereleases=True):
                faults.append(f"{key}=={lock[key]} is outside {name}'s {line}")
            todo.append((key, frozenset(req.extras), name))
    return wanted, faults


def test_the_pythons_checked_are_the_ones_setup_cfg_allows():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    allowed = SpecifierSet(cfg["options"]["python_requires"])
    assert all(p in allowed for p in PYTHONS)
    assert not any(f"3.{minor}.99" in allowed for minor in range(0, 11)), "a Python older than 3.11 is allowed: check it"


@pytest.mark.parametrize("lock", sorted(LOCKS))
@pytest.mark.parametrize("python", PYTHONS)
def test_each_lock_has_what_each_allowed_python_needs(lock, python):
    wanted, faults = needed(python, LOCKS[lock], pins(lock))
    assert not faults, "\n".join(faults)
    assert "redis" in wanted and "celery" in wanted


def test_the_walk_finds_what_a_python_below_3_11_3_alone_needs():
    """The walk is not blind to markers: redis-py asks for async-timeout on 3.11.2 and not on 3.12."""
    lock = pins("requirements.lock")
    old, _ = needed("3.11.2", LOCKS["requirements.lock"], lock)
    new, _ = needed("3.12.0", LOCKS["requirements.lock"], lock)
    assert any(by.startswith("redis (") for by in old.get("async-timeout", ()))
    assert not any(by.startswith("redis (") for by in new.get("async-timeout", ()))
