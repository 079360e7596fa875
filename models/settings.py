"""Configuration read from the environment, in one place.

Every value has a default so a fresh clone runs; the README lists them all.
"""
from __future__ import annotations

import os
from dataclasses import dataclass


def _int(name: str, default: int) -> int:
    raw = os.environ.get(name, "").strip()
    return int(raw) if raw else default


def _float(name: str, default: float) -> float:
    raw = os.environ.get(name, "").strip()
    return float(raw) if raw else default


def _list(name: str) -> list[str]:
    return [part.strip() for part in os.environ.get(name, "").split(",") if part.strip()]


@dataclass(frozen=True)
class Settings:
    database_url: str
    broker_url: str
    api_tokens: list[str]
    callback_secret: str
    callback_hosts: list[str]
    callback_timeout: float
    callback_max_attempts: int
    callback_retry_timeout: float
    pending_ttl_s: int
    prepared_ttl_s: int
    session_context_ttl_s: int
    stuck_executing_s: int
    max_redrives: int
    max_wait_s: int
    public_url: str


def load() -> Settings:
    """Read the settings now (tests change the environment between runs)."""
    return Settings(
        database_url=os.environ.get("DATABASE_URL", ""),
        broker_url=os.environ.get("CELERY_BROKER_URL") or os.environ.get("REDIS_URL", ""),
        api_tokens=_list("VOICE_TOOLS_API_TOKENS"),
        callback_secret=os.environ.get("VOICE_TOOLS_CALLBACK_SECRET", ""),
        callback_hosts=_list("VOICE_TOOLS_CALLBACK_HOSTS"),
        callback_timeout=_float("VOICE_TOOLS_CALLBACK_TIMEOUT", 2.0),
        callback_max_attempts=_int("VOICE_TOOLS_CALLBACK_MAX_ATTEMPTS", 8),
        callback_retry_timeout=_float("VOICE_TOOLS_CALLBACK_RETRY_TIMEOUT", 10.0),
        pending_ttl_s=_int("VOICE_TOOLS_PENDING_TTL", 600),
        prepared_ttl_s=_int("VOICE_TOOLS_PREPARED_TTL", 300),
        session_context_ttl_s=_int("VOICE_TOOLS_SESSION_CONTEXT_TTL", 3600),
        stuck_executing_s=_int("VOICE_TOOLS_STUCK_EXECUTING_AFTER", 900),
        max_redrives=_int("VOICE_TOOLS_MAX_REDRIVES", 3),
        max_wait_s=30,
        public_url=os.environ.get("VOICE_TOOLS_PUBLIC_URL", "http://127.0.0.1:8000").rstrip("/"),
    )
