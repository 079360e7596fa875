"""The settings follow the environment: read again whenever it changes, not on every ask."""
from __future__ import annotations

import os

from models import settings


def test_the_settings_follow_every_change_of_the_environment(monkeypatch):
    monkeypatch.delenv("VOICE_TOOLS_CALLBACK_TIMEOUT", raising=False)
    first = settings.load()
    assert first.callback_timeout == 2.0
    assert settings.load() is first  # unchanged environment: nothing read again

    monkeypatch.setenv("VOICE_TOOLS_CALLBACK_TIMEOUT", "3.5")
    assert settings.load().callback_timeout == 3.5
    os.environ["VOICE_TOOLS_CALLBACK_TIMEOUT"] = "4"  # set by hand, not through monkeypatch
    assert settings.load().callback_timeout == 4.0
    monkeypatch.setenv("VOICE_TOOLS_PUBLIC_URL", "https://voice.example/")
    assert settings.load().public_url == "https://voice.example"
    monkeypatch.delenv("VOICE_TOOLS_CALLBACK_TIMEOUT")
    again = settings.load()
    assert again.callback_timeout == 2.0 and again.public_url == "https://voice.example"
