"""Google's APIs as a local HTTP double (see ``tests/http_double.py``).

``google_api`` configures the product as an operator would for Google (an
authorized-user credentials file, ``VOICE_TOOLS_GOOGLE_CREDENTIALS``) and points the
real google-api-python-client at the double (``VOICE_TOOLS_GOOGLE_API_ENDPOINT``).
The token in the file is valid for an hour, so no token refresh goes out.
``google_env(double, tmp_path)`` gives the same variables for a worker subprocess.
"""
from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from tests.http_double import HttpDouble


def google_env(double: HttpDouble, folder: Path, services: str = "gmail,calendar,people,tasks") -> dict[str, str]:
    expiry = (datetime.now(timezone.utc) + timedelta(hours=1)).strftime("%Y-%m-%dT%H:%M:%SZ")
    creds = folder / "google-authorized-user.json"
    creds.write_text(json.dumps({
        "type": "authorized_user", "client_id": "test-client.apps.googleusercontent.com",
        "client_secret": "test-secret", "refresh_token": "test-refresh", "token": "test-access-token",
        "expiry": expiry,
    }))
    return {"VOICE_TOOLS_GOOGLE_CREDENTIALS": str(creds), "VOICE_TOOLS_GOOGLE_API_ENDPOINT": double.url + "/",
            "VOICE_TOOLS_GOOGLE_SERVICES": services}


@pytest.fixture
def google_api(tmp_path, monkeypatch):
    """A Google API double the product (API and in-process worker) is configured to use."""
    with HttpDouble() as double:
        for key, value in google_env(double, tmp_path).items():
            monkeypatch.setenv(key, value)
        yield double
