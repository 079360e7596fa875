"""The releases of this repository, found from its history, and an earlier one installed to run beside it.

A release is the commit that sets its version in ``setup.cfg`` (git tags do not travel with a clone);
CHANGELOG.md has a section per release, ``## X.Y.Z (YYYY-MM-DD)``. The first release, 0.1.0, was the
version from the first commit on, so its section names its commit: ``## 0.1.0 (2026-11-27, commit c14bfd8)``.

:func:`installed` extracts a release's tree (``git archive``) and installs it from its own
``requirements.lock`` into a virtualenv of its own, both cached under ``~/.cache/voice-tools/releases``
by the commit and the lock's hash, so the suite installs a release once per machine.
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from support.procs import ROOT

SECTION = re.compile(r"^## (\d+\.\d+\.\d+) \((\d{4}-\d{2}-\d{2})(?:, commit ([0-9a-f]{7,40}))?\)\s*$", re.M)
CACHE = Path(os.environ.get("VOICE_TOOLS_RELEASES_CACHE", Path.home() / ".cache" / "voice-tools" / "releases"))


@dataclass(frozen=True)
class Release:
    version: str
    commit: str  # the full hash


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True).stdout.strip()


def _key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


def _version_at(commit: str) -> str | None:
    found = re.search(r"^version = (\S+)$", _git("show", f"{commit}:setup.cfg"), re.M)
    return found.group(1) if found else None


def setting_commit(version: str) -> str:
    """The commit that set ``version = <version>`` in setup.cfg, raising it from a lower one: the newest such
    (a version set on a branch, taken back and set again is released by the last of them)."""
    touched = _git("log", "--format=%H %P", "-G", rf"^version = {re.escape(version)}$", "--", "setup.cfg")
    for commit, *parents in (entry.split() for entry in touched.splitlines()):
        before = _version_at(parents[0]) if parents else None
        if _version_at(commit) == version and (before is None or _key(before) < _key(version)):
            return commit
    raise LookupError(f"no commit sets version {version} in setup.cfg")


def sections(changelog: str | None = None) -> list[tuple[str, str | None]]:
    """``(version, commit named in its section or None)`` of every release CHANGELOG.md has, oldest first."""
    text = (ROOT / "CHANGELOG.md").read_text() if changelog is None else changelog
    return sorted(((version, commit or None) for version, _date, commit in SECTION.findall(text)),
                  key=lambda found: _key(found[0]))


def previous_release(current: str) -> Release:
    """The newest release older than version ``current``, with its commit (the one its section names,
    else the one that set its version)."""
    older = [found for found in sections() if _key(found[0]) < _key(current)]
    if not older:
        raise LookupError(f"no release before {current} in CHANGELOG.md")
    version, commit = older[-1]
    return Release(version, _git("rev-parse", "--verify", f"{commit}^{{commit}}") if commit else setting_commit(version))


@dataclass(frozen=True)
class Installed:
    release: Release
    root: Path  # its tree: Procfile, migrations, packages
    bin: Path  # its virtualenv's scripts (gunicorn, celery, voice-tools)


def installed(release: Release, cache: Path = CACHE) -> Installed:
    """``release`` extracted and installed from its own lock, cached by its commit and the lock's hash."""
    lock = _git("show", f"{release.commit}:requirements.lock")
    key = f"{release.version}-{release.commit[:12]}-{hashlib.sha256(lock.encode()).hexdigest()[:12]}"
    home = cache / key
    root, venv = home / "src", home / "venv"
    done = home / "installed"
    if not done.exists():
        shutil.rmtree(home, ignore_errors=True)
        root.mkdir(parents=True)
        archive = subprocess.run(["git", "archive", release.commit], cwd=ROOT, check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(root)], input=archive, check=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        subprocess.run([*pip, "--require-hashes", "-r", str(root / "requirements.lock")], check=True,
                       capture_output=True, timeout=1800)
        subprocess.run([*pip, "--no-deps", "-e", str(root)], check=True, capture_output=True, timeout=600)
        done.write_text(release.commit)
    return Installed(release, root, venv / "bin")
