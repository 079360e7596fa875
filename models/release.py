"""This release's version (semantic: MAJOR.MINOR.PATCH): ``voice-tools --version``, ``/healthz``, every
JSON log line's ``version`` and the traces' ``service.version``.

A release is the commit that sets its version in ``setup.cfg`` (CHANGELOG.md has a section per
release). Read from the checkout's ``setup.cfg`` when the code runs from one (an editable install's
metadata is as old as its install), else from the installed package's metadata.
"""
from __future__ import annotations

import configparser
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

PACKAGE = "voice-tools"


def _version() -> str:
    setup_cfg = Path(__file__).resolve().parent.parent / "setup.cfg"
    if setup_cfg.is_file():
        parser = configparser.ConfigParser()
        parser.read(setup_cfg)
        if parser.get("metadata", "name", fallback=None) == PACKAGE:
            return parser.get("metadata", "version")
    try:
        return version(PACKAGE)
    except PackageNotFoundError:  # a source tree without its setup.cfg, never installed
        return "0+unknown"


VERSION = _version()
