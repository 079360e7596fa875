"""Configuration read from the environment, in one place.

Every value has a default so a fresh clone runs; docs/operations.md (Configuration) lists them all.
"""
from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping
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
    callback_secrets: list[str]  # Standard Webhooks secrets (whsec_...), newest first; empty: that scheme unsent
    callback_hosts: list[str]
    callback_proxy: str
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
    trace_url: str  # the console's link to a call's trace: a template with {trace_id}; empty: no link
    # real backends (docs/operations.md, "Real backends"); unset: the local ones
    google_credentials: str
    google_credentials_dir: str  # a folder of <caller>.json files, one caller's credentials each
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
    search_min_words: float | None
    # how often beat sends each sweep task, in seconds (celeryconfig.beat_schedule)
    sweep_every_s: dict[str, float]
    # this installation's name in what it leaves at a service (the Message-ID of its emails),
    # so two deployments sharing a mailbox never take each other's messages for their own
    deployment: str = "default"
    # how long a Google backend keeps looking for what an earlier attempt may have made
    # before it says "unconfirmed" (docs/operations.md, "Real backends")
    google_confirm_s: float = 10.0
    # retention (docs/operations.md, "Retention"): seconds an ended call (with its events) and a
    # settled event are kept; 0 keeps them forever. Rows removed per transaction.
    retain_calls_s: float = 30 * 86400.0
    retain_events_s: float = 30 * 86400.0
    purge_batch: int = 1000
    # after each batch the purge pauses this many times as long as the batch took (3: it takes at
    # most a quarter of the time, leaving the database to the API between batches; 0: no pause)
    purge_pause: float = 3.0

    def uses_google(self, service: str) -> bool:
        """Is ``service`` (gmail, calendar, people, tasks) served by Google rather than the local tables?"""
        return bool(self.google_credentials or self.google_credentials_dir) and service in self.google_services


SWEEPS = {  # beat's sweeps (tasks/sweeps.py): task -> (the variable that sets its period, its default in seconds)
    "maintenance.expire_stale": ("VOICE_TOOLS_EXPIRE_EVERY", 30.0),
    "maintenance.fail_stuck": ("VOICE_TOOLS_STUCK_SWEEP_EVERY", 60.0),
    "maintenance.retry_callbacks": ("VOICE_TOOLS_CALLBACK_SWEEP_EVERY", 15.0),
    "maintenance.purge_context": ("VOICE_TOOLS_CONTEXT_PURGE_EVERY", 300.0),
    "maintenance.purge_old": ("VOICE_TOOLS_RETENTION_SWEEP_EVERY", 300.0),
}

RETAIN_DAYS = 30.0  # the default retention of ended calls and of settled events


def _days(name: str) -> float:
    """A retention in days (``VOICE_TOOLS_RETAIN_*``; fractions allowed) as seconds; 0 (or less): forever."""
    return max(_float(name, RETAIN_DAYS), 0.0) * 86400.0


# The ports this system listens on (docs/operations.md, Configuration): the variable, its default
# (the Procfiles' and ``voice-tools run``'s), and the face. ``VOICE_TOOLS_API_PORT`` is the API's
# port as ``voice-tools run`` passes it to every process: honcho sets each process's own ``PORT``.
OWN_PORTS = (
    ("VOICE_TOOLS_API_PORT", None, "API"),
    ("PORT", 8000, "API"),
    ("MCP_PORT", 8001, "MCP"),
    ("WORKER_METRICS_PORT", 9101, "worker metrics"),
    ("FLOWER_PORT", 5555, "Flower"),
)


def own_ports(environ: Mapping[str, str] | None = None) -> dict[int, str]:
    """Every port this system listens on, by face: the API (``VOICE_TOOLS_API_PORT`` and ``PORT``),
    MCP, the workers' metrics and Flower (each its default when unset), and ``VOICE_TOOLS_OWN_PORTS``
    (any other: an event stream or a proxy on a port of its own)."""
    environ = os.environ if environ is None else environ
    found: dict[int, str] = {}
    for name, default, face in OWN_PORTS:
        raw = environ.get(name, "").strip()
        port = int(raw) if raw.isdigit() else default
        if port is not None:
            found.setdefault(port, face)
    for part in environ.get("VOICE_TOOLS_OWN_PORTS", "").split(","):
        if part.strip().isdigit():
            found.setdefault(int(part.strip()), "")
    return found


# Each caller's fair share of the API (docs/operations.md, "Fair shares"; app/shares.py)
RATE_LIMIT = "60000/minute"  # requests per caller, in the notation of the `limits` library
RESERVED_THREADS = 2  # of each API process's threads, never taken by long-held requests that hold a thread
OPEN_PER_CALLER = 1000  # long-held requests (event streams, ?wait) one caller holds at once, over every process
OPEN_PER_PROCESS = 4000  # long-held requests one API process serves at once, whoever holds them
SPARE_DESCRIPTORS = 256  # of a process's descriptors, kept from its long-held requests (pool, files, REST)
SEND_TIMEOUT_S = 30.0  # a client that leaves a stream's or a wait's data untaken this long is closed


def rate_limit() -> str:
    """``VOICE_TOOLS_RATE_LIMIT``: every caller's rate (a caller's own in ``VOICE_TOOLS_CALLER_LIMITS``)."""
    return os.environ.get("VOICE_TOOLS_RATE_LIMIT", "").strip() or RATE_LIMIT


def open_per_caller() -> int:
    """``VOICE_TOOLS_OPEN_PER_CALLER``: how many ``?wait`` requests and event streams one caller may hold
    at once, over every API process (counted in Redis); :data:`OPEN_PER_CALLER` by default. Neither holds
    a web thread (each costs a descriptor and a few KB of the process's stream loop): each process's own
    capacity (:func:`open_per_process`) bounds what it serves."""
    raw = os.environ.get("VOICE_TOOLS_OPEN_PER_CALLER", "").strip()
    return max(int(raw), 1) if raw else OPEN_PER_CALLER


def open_per_process(descriptors: int) -> int:
    """``VOICE_TOOLS_OPEN_PER_PROCESS``: how many ``?wait`` requests and event streams one API process serves
    at once, whoever holds them; :data:`OPEN_PER_PROCESS` by default. Never more than the process's
    ``descriptors`` (its open-files limit) but :data:`SPARE_DESCRIPTORS`: each holds a socket."""
    raw = os.environ.get("VOICE_TOOLS_OPEN_PER_PROCESS", "").strip()
    wanted = max(int(raw), 1) if raw else OPEN_PER_PROCESS
    return max(1, min(wanted, descriptors - SPARE_DESCRIPTORS))


def send_timeout_s() -> float:
    """``VOICE_TOOLS_SEND_TIMEOUT``: seconds a client may leave an event stream's (or a wait's answer's)
    data untaken before the connection is closed, its slot given back (:data:`SEND_TIMEOUT_S`)."""
    return max(_float("VOICE_TOOLS_SEND_TIMEOUT", SEND_TIMEOUT_S), 0.1)


def caller_limits() -> dict[str, tuple[str | None, int | None]]:
    """``VOICE_TOOLS_CALLER_LIMITS``: ``name:rate:open`` per caller, comma-separated; a blank part
    keeps the default (``relay:20000/minute:``, ``batch::2``)."""
    found: dict[str, tuple[str | None, int | None]] = {}
    for entry in _list("VOICE_TOOLS_CALLER_LIMITS"):
        name, _, rest = entry.partition(":")
        rate, _, opened = rest.partition(":")
        found[name.strip()] = (rate.strip() or None, max(int(opened), 1) if opened.strip() else None)
    return found


def redis_url() -> str:
    """The Redis the API processes share (``REDIS_URL``, else a Redis broker's URL); empty: none."""
    for url in (os.environ.get("REDIS_URL", ""), os.environ.get("CELERY_BROKER_URL", "")):
        if url.startswith(("redis://", "rediss://", "redis+socket://", "unix://")):
            return url
    return ""


def data_dir() -> Path:
    """``VOICE_TOOLS_DATA_DIR``, or ``.voice-tools`` in the current directory (absolute): the embedded
    servers' data, the local secrets and the prepared embedding model of every process of one system."""
    return Path(os.environ.get("VOICE_TOOLS_DATA_DIR") or ".voice-tools").resolve()


# the prepared embedding model's folder in the data dir: not a Python name, so that a process working in
# the data dir (the Procfile's lines, the run's migration: it is first on their path) never imports it in
# place of a package of ours, as a folder named "models" was imported in place of ``models``
MODEL_FOLDER = "embedding-models"
OLD_MODEL_FOLDER = "models"  # where a data dir made before kept it (``voice_tools.launcher`` moves it)


def model_dir() -> Path:
    """``<data dir>/embedding-models``: the prepared embedding model of every process of one system."""
    return data_dir() / MODEL_FOLDER


def api_tokens() -> list[str]:
    """``VOICE_TOOLS_API_TOKENS`` alone (every request reads it: not the whole of :func:`load`)."""
    return _list("VOICE_TOOLS_API_TOKENS")


_environment: tuple[dict[bytes, bytes] | None, int] = (None, 0)  # the environment last seen, and its number


def generation() -> int:
    """A number that changes whenever the process's environment has changed since the last ask (tests
    change it between runs): what is read from the environment is read again only when it changes
    (:func:`load`, a caller's fair share in ``app.shares``). Comparing costs about 1 µs (CPython's
    ``os.environ`` keeps its entries in ``_data``); elsewhere every ask is a new number."""
    global _environment
    now = getattr(os.environ, "_data", None)
    seen, number = _environment
    if isinstance(now, dict) and seen == now:
        return number
    _environment = (dict(now) if isinstance(now, dict) else None, number + 1)
    return number + 1


_loaded: tuple[int, Settings] | None = None  # the settings read at that number


def load() -> Settings:
    """The settings as the environment says now: the same (frozen) settings until it changes. A link
    asks for them a few times; reading them costs about 0.1 ms."""
    global _loaded
    number = generation()
    last = _loaded
    if last is not None and last[0] == number:
        return last[1]
    settings = _from_environment()
    _loaded = (number, settings)
    return settings


def _from_environment() -> Settings:
    return Settings(
        database_url=os.environ.get("DATABASE_URL", ""),
        broker_url=os.environ.get("CELERY_BROKER_URL") or os.environ.get("REDIS_URL", ""),
        api_tokens=api_tokens(),
        callback_secret=os.environ.get("VOICE_TOOLS_CALLBACK_SECRET", ""),
        callback_secrets=_list("VOICE_TOOLS_CALLBACK_SECRETS"),
        callback_hosts=_list("VOICE_TOOLS_CALLBACK_HOSTS"),
        callback_proxy=os.environ.get("VOICE_TOOLS_CALLBACK_PROXY", "").strip(),
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
        trace_url=os.environ.get("VOICE_TOOLS_TRACE_URL", "").strip(),
        google_credentials=(os.environ.get("VOICE_TOOLS_GOOGLE_CREDENTIALS")
                            or os.environ.get("GOOGLE_APPLICATION_CREDENTIALS", "")),
        google_credentials_dir=os.environ.get("VOICE_TOOLS_GOOGLE_CREDENTIALS_DIR", "").strip(),
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
        search_min_words=_float("VOICE_TOOLS_SEARCH_MIN_WORDS", 2.0) if os.environ.get(
            "VOICE_TOOLS_SEARCH_MIN_WORDS", "").strip() else None,
        sweep_every_s={sweep: max(_float(name, default), 1.0) for sweep, (name, default) in SWEEPS.items()},
        deployment=deployment_name(os.environ.get("VOICE_TOOLS_DEPLOYMENT", ""),
                                   os.environ.get("DATABASE_URL", "")),
        google_confirm_s=max(_float("VOICE_TOOLS_GOOGLE_CONFIRM_WAIT", 10.0), 0.0),
        retain_calls_s=_days("VOICE_TOOLS_RETAIN_CALLS_DAYS"),
        retain_events_s=_days("VOICE_TOOLS_RETAIN_EVENTS_DAYS"),
        purge_batch=max(_int("VOICE_TOOLS_PURGE_BATCH", 1000), 1),
        purge_pause=max(_float("VOICE_TOOLS_PURGE_PAUSE", 3.0), 0.0),
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
