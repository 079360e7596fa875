"""The caller's contacts, searched by search_contacts.

Local (default): the ``contacts`` table, the caller's own rows and the shared (demo) ones,
searched case-insensitively (ILIKE) on name, email and organization; every word of the
query must match one of them. Ranked: the exact name first, then names starting with the
query, then names with a word starting with it, then the rest; alphabetical within a rank.

Google (``settings.uses_google("people")``): the People API's
``people.searchContacts`` over the user's own contacts (scope ``contacts.readonly``), with the
caller's own credentials where they are configured (``voice_tools_backends/google.py``).
People asks clients to send a warm-up request with an empty query first, to refresh
its search cache: it is sent once per process (per configured endpoint).

Every search answers ``[{name, email, phone, organization}]`` (missing values None).
Errors: :class:`Refused` for what Google will not do however often asked (400, 401,
403, 404); a 429 / 5xx ``HttpError`` or a timeout goes through as it is (retried by
the engine); :class:`Unavailable` for a connection that failed below HTTP.
"""
from __future__ import annotations

import logging
import threading
from typing import Any

from sqlalchemy import String, case, func, or_, select
from sqlalchemy.dialects.postgresql import insert

from models import db, settings
from models.contacts import Contact
from voice_tools_backends import google
from voice_tools_backends import Refused, Unavailable, seen_by

log = logging.getLogger(__name__)

READ_MASK = "names,emailAddresses,phoneNumbers,organizations"
REFUSED_STATUSES = frozenset({400, 401, 403, 404})

# (name, email, phone, organization, notes)
DEMO_CONTACTS = [
    ("John Smith", "john.smith@example.com", "+1 206 555 0142", "Northwind Traders", "Regional sales lead, Northwest."),
    ("Ann Lee", "ann.lee@example.com", "+1 503 555 0117", "Contoso Ltd", "Account manager."),
    ("Ann Park", "ann.park@example.com", "+1 415 555 0163", "Fabrikam Inc", "Procurement."),
    ("Annabel Diaz", "annabel.diaz@example.com", "+1 602 555 0188", "Tailspin Toys", "Marketing director."),
    ("Maria Garcia", "maria.garcia@example.com", "+1 312 555 0109", "Northwind Traders", "Finance, approves travel."),
    ("David Chen", "david.chen@example.com", "+1 646 555 0131", "Adventure Works", "CTO."),
    ("Priya Patel", "priya.patel@example.com", "+1 408 555 0154", "Contoso Ltd", "Sales operations."),
    ("James O'Brien", "james.obrien@example.com", "+1 617 555 0176", "Litware Inc", "Legal counsel."),
    ("Fatima Al-Sayed", "fatima.alsayed@example.com", "+1 713 555 0125", "Wide World Importers", "Logistics."),
    ("Kenji Tanaka", "kenji.tanaka@example.com", "+1 808 555 0199", "Fabrikam Inc", "Product training."),
    ("Sophie Martin", "sophie.martin@example.com", "+33 1 55 55 01 20", "Proseware", "Paris office."),
    ("Print Shop Downtown", "orders@printshop.example.com", "+1 206 555 0100", "Print Shop Downtown",
     "Brochures and business cards."),
]




def search(query: str, limit: int = 5, caller: str = "") -> list[dict[str, Any]]:
    """Up to ``limit`` of ``caller``'s contacts matching ``query``, best first, from the configured backend."""
    if settings.load().uses_google("people"):
        try:
            svc = google.service("people", "v1", caller=caller)
        except google.CredentialsError as exc:
            raise Refused(str(exc)) from exc
        warm_up_once(svc)
        return google_search(svc, query, limit)
    return local_search(query, limit, caller)


# -- local ------------------------------------------------------------------------------

def _like(text: str) -> str:
    """``text`` as a literal inside an ILIKE pattern (``\\`` is PostgreSQL's default escape)."""
    return text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")


def local_search(query: str, limit: int = 5, caller: str = "") -> list[dict[str, Any]]:
    query = " ".join(query.split())
    words = query.split(" ") if query else []
    if not words:
        return []
    name = func.coalesce(Contact.name, "")
    matches = [
        or_(Contact.name.ilike(f"%{_like(w)}%"), Contact.email.ilike(f"%{_like(w)}%"),
            Contact.organization.ilike(f"%{_like(w)}%"))
        for w in words
    ]
    rank = case(
        (func.lower(name) == query.lower(), 0),
        (name.ilike(f"{_like(query)}%"), 1),
        (name.ilike(f"% {_like(query)}%"), 2),
        (Contact.email.ilike(f"{_like(query)}%"), 3),
        else_=4,
    )
    stmt = (select(Contact).where(seen_by(Contact.owner, caller), *matches)
            .order_by(rank, func.lower(name), Contact.id).limit(limit))
    with db.statement() as conn:  # one SELECT, one round trip (no BEGIN/COMMIT), Core rows
        rows = conn.execute(stmt).all()
    return [{"name": c.name, "email": c.email, "phone": c.phone, "organization": c.organization} for c in rows]


def load_demo() -> int:
    """Add the shared demo contacts that are missing (by email); return how many were added."""
    rows = [{"name": n, "email": e, "phone": p, "organization": o, "notes": notes}
            for n, e, p, o, notes in DEMO_CONTACTS]
    with db.session() as s:
        added = s.execute(
            insert(Contact).values(rows).on_conflict_do_nothing(index_elements=["owner", "email"])
            .returning(Contact.id.cast(String))
        ).all()
    return len(added)


# -- Google People API --------------------------------------------------------------------

_warmed: set[str] = set()
_warm_lock = threading.Lock()


def warm_up(svc: Any) -> None:
    """People's recommended warm-up: a search with an empty query (its answer is ignored)."""
    svc.people().searchContacts(query="", readMask=READ_MASK, pageSize=1).execute()


def warm_up_once(svc: Any) -> None:
    """:func:`warm_up` once per process and endpoint; a failed warm-up is retried next time, never fatal."""
    key = settings.load().google_api_endpoint or "google"
    with _warm_lock:
        if key in _warmed:
            return
    try:
        warm_up(svc)
    except Exception as exc:  # advisory only: the search itself reports what matters
        log.info("People API warm-up failed (%s); searching anyway", exc)
        return
    with _warm_lock:
        _warmed.add(key)


def _first(items: list[dict[str, Any]] | None, key: str) -> str | None:
    """The primary entry's ``key`` (or the first one's), as People lists names, emails, ..."""
    if not items:
        return None
    primary = next((i for i in items if (i.get("metadata") or {}).get("primary")), items[0])
    return primary.get(key) or None


def person_to_contact(person: dict[str, Any]) -> dict[str, Any]:
    email = _first(person.get("emailAddresses"), "value")
    return {
        "name": _first(person.get("names"), "displayName") or email or "Unnamed contact",
        "email": email,
        "phone": _first(person.get("phoneNumbers"), "value"),
        "organization": _first(person.get("organizations"), "name"),
    }


def google_search(svc: Any, query: str, limit: int = 5) -> list[dict[str, Any]]:
    """``people.searchContacts`` (readMask names, emails, phones, organizations; pageSize ``limit``)."""
    try:
        answer = svc.people().searchContacts(query=query, readMask=READ_MASK, pageSize=limit).execute()
    except google.HttpError as exc:
        if google.status_of(exc) in REFUSED_STATUSES:
            raise Refused(f"Google Contacts refused the search ({google.reason_of(exc).rstrip('.')})") from exc
        raise
    except google.transport_errors() as exc:
        raise Unavailable(f"Google Contacts could not be reached ({type(exc).__name__})") from exc
    people = [r.get("person") or {} for r in answer.get("results") or []]
    return [person_to_contact(p) for p in people[:limit]]
