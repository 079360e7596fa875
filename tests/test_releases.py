"""The releases found from the history (``support/releases.py``): each is the commit that released it."""
from __future__ import annotations

import subprocess

from support.procs import ROOT
from support.releases import SECTION, _key, sections, setting_commit


def _show(commit: str, path: str) -> str:
    return subprocess.run(["git", "show", f"{commit}:{path}"], cwd=ROOT, check=True, capture_output=True,
                          text=True).stdout


def test_each_release_found_from_the_history_is_the_commit_that_released_it():
    """A version set on a branch, taken back and set again by its release commit is the release commit's:
    the commit found has the version in its setup.cfg and the release's own section in its CHANGELOG, and
    no later commit takes the version back (only a newer release's commit changes that line again)."""
    found = [version for version, commit in sections() if commit is None]
    assert found, "every release names its commit: nothing here to find"
    for version in found:
        commit = setting_commit(version)
        assert f"\nversion = {version}\n" in _show(commit, "setup.cfg"), (version, commit)
        released = [v for v, _date, _commit in SECTION.findall(_show(commit, "CHANGELOG.md"))]
        assert version in released, (version, commit, released)
        later = subprocess.run(["git", "log", "--format=%H", "-G", rf"^version = {version}$", f"{commit}..HEAD",
                                "--", "setup.cfg"], cwd=ROOT, check=True, capture_output=True, text=True).stdout.split()
        for after in later:
            now = next(line.split("=", 1)[1].strip() for line in _show(after, "setup.cfg").splitlines()
                       if line.startswith("version ="))
            assert _key(now) > _key(version), f"{after[:7]} leaves version {now} after {version} was found at {commit[:7]}"
