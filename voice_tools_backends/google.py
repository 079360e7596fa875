"""Google API clients (google-api-python-client + google-auth), one per thread.

Credentials come from ``VOICE_TOOLS_GOOGLE_CREDENTIALS`` (or
``GOOGLE_APPLICATION_CREDENTIALS``): a service-account key file, optionally acting
for a user through domain-wide delegation (``VOICE_TOOLS_GOOGLE_SUBJECT``), or an
authorized-user token file (``{"type": "authorized_user", "client_id", "client_secret",
"refresh_token", ...}``, as ``gcloud auth application-default login`` or an OAuth
consent flow writes it). Each caller may have its own: with ``VOICE_TOOLS_GOOGLE_CREDENTIALS_DIR``
set, the file ``<caller>.json`` in that folder is the credentials of the caller (a token's
name) and a caller without one uses the shared file (docs/operations.md, "Real backends").
A backend asks for the client of its call's caller (``service(..., caller=)``); code that
does not pass one gets the caller set by :func:`acting_for` (e.g. around a step), else the
shared credentials. Services are built from the discovery documents the library
ships (no discovery request). ``VOICE_TOOLS_GOOGLE_API_ENDPOINT`` replaces the API's
root URL (a proxy, a private endpoint, or the tests' local HTTP double).

Errors: ``googleapiclient.errors.HttpError`` carries ``resp.status``; the engine
retries 429 and 5xx by itself (``tasks.tools.is_transient``). A backend turns the
answers it understands (404, 409, 400) into what they mean.
"""
from __future__ import annotations

import contextlib
import contextvars
import json
import os
import threading
import time
from typing import Any, Callable, Iterator, Sequence, TypeVar

from google.auth.exceptions import TransportError
from googleapiclient.errors import HttpError

from models import settings

# Scopes per API, the narrowest each tool needs (docs/operations.md, "Real backends").
SCOPES: dict[str, tuple[str, ...]] = {
    "gmail": ("https://www.googleapis.com/auth/gmail.compose", "https://www.googleapis.com/auth/gmail.readonly"),
    "calendar": ("https://www.googleapis.com/auth/calendar.events",
                 "https://www.googleapis.com/auth/calendar.freebusy"),
    "people": ("https://www.googleapis.com/auth/contacts.readonly",),
    "tasks": ("https://www.googleapis.com/auth/tasks",),
}

T = TypeVar("T")
_local = threading.local()  # httplib2.Http is not thread-safe: one client per thread
_acting_for: contextvars.ContextVar[str] = contextvars.ContextVar("google_acting_for", default="")


class CredentialsError(RuntimeError):
    """The credentials file is missing or not one Google's libraries can use."""


@contextlib.contextmanager
def acting_for(caller: str | None) -> Iterator[None]:
    """Within the block, :func:`service` called without a caller builds ``caller``'s client."""
    token = _acting_for.set(caller or "")
    try:
        yield
    finally:
        _acting_for.reset(token)


def credentials_file(caller: str | None = None, conf: settings.Settings | None = None) -> str:
    """The credentials file of ``caller``: ``<caller>.json`` in ``VOICE_TOOLS_GOOGLE_CREDENTIALS_DIR`` when
    that file exists, else the shared ``VOICE_TOOLS_GOOGLE_CREDENTIALS``. A name that is not a plain
    file name (a path separator, a leading dot, empty) never picks a file of the folder."""
    conf = conf or settings.load()
    folder = conf.google_credentials_dir
    name = caller or ""
    plain = name and not name.startswith(".") and "/" not in name and "\\" not in name and "\0" not in name
    if folder and plain:
        own = os.path.join(folder, f"{name}.json")
        if os.path.isfile(own):
            return own
    return conf.google_credentials


def credentials(scopes: Sequence[str], conf: settings.Settings | None = None, path: str | None = None) -> Any:
    """Credentials for ``scopes`` from ``path`` (default: the shared file), a service account or an authorized user."""
    conf = conf or settings.load()
    path = path or conf.google_credentials
    if not path:
        raise CredentialsError("no Google credentials file is configured for this caller "
                               "(VOICE_TOOLS_GOOGLE_CREDENTIALS or VOICE_TOOLS_GOOGLE_CREDENTIALS_DIR)")
    try:
        with open(path, encoding="utf-8") as f:
            info = json.load(f)
    except (OSError, ValueError) as exc:
        raise CredentialsError(f"cannot read the Google credentials file {path!r}: {exc}") from exc
    kind = info.get("type")
    if kind == "service_account":
        from google.oauth2 import service_account

        creds = service_account.Credentials.from_service_account_info(info, scopes=list(scopes))
        # the subject is the shared account's user: a caller's own service-account file acts as itself
        shared = path == conf.google_credentials
        return creds.with_subject(conf.google_subject) if conf.google_subject and shared else creds
    if kind == "authorized_user":
        from google.oauth2.credentials import Credentials

        return Credentials.from_authorized_user_info(info, scopes=list(scopes))
    raise CredentialsError(f"{path!r} is neither a service_account nor an authorized_user file (type {kind!r})")


def build_service(api: str, version: str, http: Any = None, conf: settings.Settings | None = None,
                  credentials_path: str | None = None) -> Any:
    """A client for ``api`` ``version`` with the credentials of ``credentials_path`` (default: the shared
    file); ``http`` (e.g. an ``HttpMockSequence``) replaces the authorised transport."""
    # Imported here, not at the top: every process imports the tools, few build a client
    # (the discovery client and httplib2 with pyparsing are ~25 MB per process).
    import httplib2
    from google_auth_httplib2 import AuthorizedHttp
    from googleapiclient.discovery import build

    conf = conf or settings.load()
    if http is None:
        scopes = SCOPES.get(api if api != "gmail" else "gmail", ())
        http = AuthorizedHttp(credentials(scopes, conf, credentials_path),
                              http=httplib2.Http(timeout=conf.google_timeout_s))
    options = {"api_endpoint": conf.google_api_endpoint} if conf.google_api_endpoint else None
    return build(api, version, http=http, cache_discovery=False, static_discovery=True, client_options=options)


def service(api: str, version: str, caller: str | None = None) -> Any:
    """This thread's client for ``api`` ``version`` with ``caller``'s credentials (None: the caller of
    :func:`acting_for`), made once per credentials file with the current settings."""
    conf = settings.load()
    path = credentials_file(_acting_for.get() if caller is None else caller, conf)
    key = (api, version, path, conf.google_subject, conf.google_api_endpoint)
    cache = getattr(_local, "services", None)
    if cache is None:
        cache = _local.services = {}
    if key not in cache:
        cache[key] = build_service(api, version, conf=conf, credentials_path=path)
    return cache[key]


def reset() -> None:
    """Forget this thread's clients (after a fork, or when the settings change)."""
    _local.services = {}


def transport_errors() -> tuple[type[BaseException], ...]:
    """The errors of a failed exchange with Google, for ``except google.transport_errors():``.

    An ``except`` clause's expression is evaluated only when something was raised, so
    httplib2 is imported only by a process that talked to Google.
    """
    import httplib2

    return (TransportError, httplib2.HttpLib2Error)


def within_bound(look: Callable[[], T | None], bound_s: float | None = None) -> T | None:
    """``look()`` again with backoff (0.25 s doubling, at most 2 s apart) until it finds something or
    ``bound_s`` (``VOICE_TOOLS_GOOGLE_CONFIRM_WAIT``) has passed; a look that fails counts as not found."""
    bound = settings.load().google_confirm_s if bound_s is None else bound_s
    deadline = time.monotonic() + bound
    pause = 0.25
    while True:
        try:
            found = look()
        except (HttpError, *transport_errors()):
            found = None
        if found is not None:
            return found
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        time.sleep(min(pause, left))
        pause = min(pause * 2, 2.0)


def status_of(exc: BaseException) -> int | None:
    """The HTTP status of a Google API error, or None."""
    if isinstance(exc, HttpError):
        return int(exc.resp.status)
    return None


def reason_of(exc: HttpError) -> str:
    """Google's own message for an API error ("Requested entity was not found.")."""
    try:
        return json.loads(exc.content)["error"]["message"]
    except Exception:  # not JSON, or another shape
        return exc.reason or f"HTTP {exc.resp.status}"


__all__ = ["SCOPES", "CredentialsError", "HttpError", "TransportError", "acting_for", "build_service", "credentials",
           "credentials_file", "reason_of", "reset", "service", "status_of", "transport_errors", "within_bound"]
