"""A full table: ``calls`` tool calls over ``sessions`` sessions, in one INSERT ... SELECT generate_series.

Call ``i`` (1..calls) is ``tc_s`` + 9 hex digits of ``i``, in session ``seed_<i % sessions>``,
of the bench's caller; one in 20 is still open (PENDING), the others COMPLETED with a
result, a sentence and a created time spread over the last ``calls`` seconds; then ANALYZE.
Seeding a database seeded before (``DATABASE_URL`` given) adds nothing.
"""
from __future__ import annotations

from sqlalchemy import text

from bench.bare import CALLER

SEED = text("""
INSERT INTO tool_calls (tool_call_id, session_id, function_name, action_level, parameters, status,
                        status_history, caller, created_at, confirmed_at, completed_at, result, voice_response)
SELECT 'tc_s' || lpad(to_hex(i), 9, '0'), 'seed_' || (i % :sessions), 'search_contacts', 'read',
       jsonb_build_object('query', 'name ' || i),
       CASE WHEN i % 20 = 0 THEN 'PENDING' ELSE 'COMPLETED' END, '[]'::jsonb, :caller,
       now() - make_interval(secs => i), now() - make_interval(secs => i),
       CASE WHEN i % 20 = 0 THEN NULL ELSE now() - make_interval(secs => i) END,
       CASE WHEN i % 20 = 0 THEN NULL ELSE jsonb_build_object('contacts', jsonb_build_array()) END,
       CASE WHEN i % 20 = 0 THEN NULL ELSE 'No contact found.' END
FROM generate_series(:first, :last) AS i
ON CONFLICT (tool_call_id) DO NOTHING
""")


def seed(calls: int, sessions: int, first: int = 1) -> float:
    """Insert calls ``first`` .. ``calls`` (one transaction); the seconds it took."""
    import time

    from models import db

    started = time.perf_counter()
    with db.engine().begin() as conn:
        conn.execute(SEED, {"first": first, "last": calls, "sessions": sessions, "caller": CALLER})
    with db.engine().connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.exec_driver_sql("ANALYZE tool_calls")
    return time.perf_counter() - started


def call_id(i: int) -> str:
    return f"tc_s{i:09x}"


def session_id(i: int, sessions: int) -> str:
    return f"seed_{i % sessions}"
