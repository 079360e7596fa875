"""Configuration read from the environment, in one place.

Every value has a default so a fresh clone runs; docs/operations.md (Configuration) lists them all.
"""
from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from urllib.parse import parse_qs, urlsplit


def _int(name: str, default: int) -> int:
    raw = os.environ.get(name, "").strip()
    return int(raw) if raw else default


def _float(name: str, default: float) -> float:
    raw = os.environ.get(name, "").strip()
    return float(raw) if raw else default


def _list(name: str) -> list[str]:
    return [part.strip() for part in os.environ.get(name, "").split(",") if part.strip()]


GOOGLE_SERVICES = ("gmail", "calendar", "people", "tasks")


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
    # real backends (docs/operations.md, "Real backends"); unset: the local ones
    google_credentials: str
    google_subject: str
    google_services: list[str]
    google_api_endpoint: str
    google_timeout_s: float
    google_calendar_id: str
    google_tasklist: str
    openai_api_key: str
    openai_base_url: str
    embedding_model: str
    summary_model: str
    openai_timeout_s: float
    embedding_threads: int
    ingest_threads: int
    search_min_score: float | None
    # how often beat sends each sweep task, in seconds (celeryconfig.beat_schedule)
    sweep_every_s: dict[str, float]
    # this installation's name in what it leaves at a service (the Message-ID of its emails),
    # so two deployments sharing a mailbox never take each other's messages for their own
    deployment: str = "default"
    # how long a Google backend keeps looking for what an earlier attempt may have made
    # before it says "unconfirmed" (docs/operations.md, "Real backends")
    google_confirm_s: float = 10.0

    def uses_google(self, service: str) -> bool:
        """Is ``service`` (gmail, calendar, people, tasks) served by Google rather than the local tables?"""
        return bool(self.google_credentials) and service in self.google_services


SWEEPS = {  # beat's sweeps (tasks/sweeps.py): task -> (the variable that sets its period, its default in seconds)
    "maintenance.expire_stale": ("VOICE_TOOLS_EXPIRE_EVERY", 30.0),
    "maintenance.fail_stuck": ("VOICE_TOOLS_STUCK_SWEEP_EVERY", 60.0),
    "maintenance.retry_callbacks": ("VOICE_TOOLS_CALLBACK_SWEEP_EVERY", 15.0),
    "maintenance.purge_context": ("VOICE_TOOLS_CONTEXT_PURGE_EVERY", 300.0),
}


def api_tokens() -> list[str]:
    """``VOICE_TOOLS_API_TOKENS`` alone (every request reads it: not the whole of :func:`load`)."""
    return _list("VOICE_TOOLS_API_TOKENS")


def load() -> Settings:
    """Read the settings now (tests change the environment between runs)."""
    return Settings(
        database_url=os.environ.get("DATABASE_URL", ""),
        broker_url=os.environ.get("CELERY_BROKER_URL") or os.environ.get("REDIS_URL", ""),
        api_tokens=api_tokens(),
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
        google_credentials=(os.environ.get("VOICE_TOOLS_GOOGLE_CREDENTIALS")
                            or os.environ.get("GOOGLE_APPLICATION_CREDENTIALS", "")),
        google_subject=os.environ.get("VOICE_TOOLS_GOOGLE_SUBJECT", ""),
        google_services=_list("VOICE_TOOLS_GOOGLE_SERVICES") or list(GOOGLE_SERVICES),
        google_api_endpoint=os.environ.get("VOICE_TOOLS_GOOGLE_API_ENDPOINT", ""),
        google_timeout_s=_float("VOICE_TOOLS_GOOGLE_TIMEOUT", 10.0),
        google_calendar_id=os.environ.get("VOICE_TOOLS_GOOGLE_CALENDAR_ID", "").strip() or "primary",
        google_tasklist=os.environ.get("VOICE_TOOLS_GOOGLE_TASKLIST", "").strip() or "@default",
        openai_api_key=os.environ.get("OPENAI_API_KEY", ""),
        openai_base_url=os.environ.get("OPENAI_BASE_URL", ""),
        embedding_model=os.environ.get("VOICE_TOOLS_EMBEDDING_MODEL", ""),
        summary_model=os.environ.get("VOICE_TOOLS_SUMMARY_MODEL", ""),
        openai_timeout_s=_float("VOICE_TOOLS_OPENAI_TIMEOUT", 20.0),
        embedding_threads=_int("VOICE_TOOLS_EMBEDDING_THREADS", 1),
        ingest_threads=_int("VOICE_TOOLS_INGEST_THREADS", 0) or os.cpu_count() or 1,
        search_min_score=_float("VOICE_TOOLS_SEARCH_MIN_SCORE", -1.0) if os.environ.get(
            "VOICE_TOOLS_SEARCH_MIN_SCORE", "").strip() else None,
        sweep_every_s={sweep: max(_float(name, default), 1.0) for sweep, (name, default) in SWEEPS.items()},
        deployment=deployment_name(os.environ.get("VOICE_TOOLS_DEPLOYMENT", ""),
                                   os.environ.get("DATABASE_URL", "")),
        google_confirm_s=max(_float("VOICE_TOOLS_GOOGLE_CONFIRM_WAIT", 10.0), 0.0),
    )


def deployment_name(given: str, database_url: str) -> str:
    """``VOICE_TOOLS_DEPLOYMENT`` as one DNS label (lower-case letters, digits, ``-``); unset, ``d`` and
    12 hex characters of the database's address (host, port, database name: not the password), the
    same for every process of one installation and different for two installations' databases."""
    label = re.sub(r"[^a-z0-9-]+", "-", given.strip().lower()).strip("-")[:63]
    if label:
        return label
    parts = urlsplit(database_url)
    socket = parse_qs(parts.query).get("host", [""])[0]  # a Unix-socket folder given as ?host=
    where = f"{parts.hostname or socket}:{parts.port or ''}{parts.path}"
    return "d" + hashlib.sha256(where.encode()).hexdigest()[:12]
