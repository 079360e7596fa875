"""A hot statement compiled once and run on the driver's cursor.

SQLAlchemy compiles a statement once and caches the result, but every execution still walks the
statement to make its cache key, hashes it, builds the parameters through the compiled form and
wraps the cursor in a result. For a link's data-modifying CTE that is about 0.3 ms of CPU, more than
PostgreSQL spends running it (py-spy of a pool child: the cache lookup 13 % of a link's statement,
building the parameters 20 %). A statement the hot paths build once (:mod:`models.lifecycle`,
``tasks/delivery/attempts.py``) needs none of it again: :class:`Compiled` compiles it for the
connection's dialect at its first run, keeps its SQL, the names and processors of its parameters and
the processed values of its constant ones, and runs it on the DBAPI cursor of the connection
SQLAlchemy checked out, with its pool, transaction and autocommit as ever. A row comes back as a
named tuple with ``_mapping``, as SQLAlchemy's ``Row`` has (the driver has already made each value
what SQLAlchemy would: ``tests/test_compiled.py`` holds them to it).

On a connection in autocommit (``db.statement()``, where each statement is its own transaction)
the statement is also prepared on the server, once per connection (``PREPARE``, its parameters typed
as SQLAlchemy types them), and run with ``EXECUTE``: PostgreSQL then parses, analyses and, after a
few runs, plans it no more (a step record with its event: 0.33 ms of the server's CPU as text, 0.10
prepared; a gate 0.10 and 0.05). A pooler in transaction mode (PgBouncer before 1.21) hands each
transaction a server connection of its own, where the statement may not be prepared: the first
``EXECUTE`` that finds no such statement turns preparing off for the process, with one warning,
and that statement runs again as text (in autocommit the failed one did nothing). A statement is
named by a hash of its text and types, so a statement of its name on any server connection is
this very one.

With tracing on, each run is a span named by what the statement does (``UPDATE tool_calls``), with its
SQL (``voice_tools_tracing/statements.py``), made on the driver's plain cursor: psycopg2's instrumentation
would name it ``EXECUTE`` and show ``EXECUTE voice_tools_<hash>(...)``.

An error goes through SQLAlchemy's own handling (a lost connection invalidates the pool and raises
``sqlalchemy.exc.OperationalError``, as an execution through SQLAlchemy does). A statement whose
compiled form needs work at every execution (an expanding ``IN`` list, a value rendered into the SQL)
runs through SQLAlchemy, as does any statement on a connection with cursor-execution hooks (a
``before_cursor_execute`` listener must see the statement it is about).
"""
from __future__ import annotations

import hashlib
import logging
import re
from collections import namedtuple
from typing import Any

from sqlalchemy import Connection, exc
from sqlalchemy.orm import Session

import voice_tools_tracing as tracing
from models import db
from voice_tools_tracing import statements

log = logging.getLogger(__name__)

_MISSING = object()
_PREPARED = "voice_tools_prepared"  # in a pooled connection's info: the names prepared on it
# the server's answers about a statement's name: not prepared on this connection (a pooler gave another),
# already prepared on it (by another client of a pooler: the same statement, its name says what it is)
_NOT_PREPARED, _ALREADY_PREPARED = "26000", "42P05"  # invalid_sql_statement_name, duplicate_prepared_statement
_preparing = True  # turned off for the process behind a pooler in transaction mode


def _row_class(names: tuple[str, ...]) -> type:
    base = namedtuple("CompiledRow", names, rename=True)  # type: ignore[misc]

    class CompiledRow(base):  # type: ignore[valid-type, misc]
        __slots__ = ()

        @property
        def _mapping(self) -> dict[str, Any]:
            return dict(zip(names, self))

    return CompiledRow


class _Plan:
    """The statement compiled for one dialect: its SQL, how to make its parameters, and its prepared form."""

    __slots__ = ("sql", "summary", "binds", "rows", "name", "prepare", "execute")

    def __init__(self, sql: str, summary: str, binds: list[tuple[str, str, Any, Any]], types: dict[str, str] | None):
        self.sql = sql
        self.summary = summary  # what it does, its span's name with tracing on: "UPDATE tool_calls"
        self.binds = binds  # (name in the SQL, key given by the caller, processed constant or _MISSING, processor)
        self.rows: dict[tuple[str, ...], type] = {}
        self.name = self.prepare = self.execute = None
        if types is not None:  # every parameter has a type the server can be told
            order: list[str] = []

            def numbered(found: re.Match[str]) -> str:
                if found.group(0) == "%%":
                    return "%"
                if found.group(1) not in order:
                    order.append(found.group(1))
                return f"${order.index(found.group(1)) + 1}"

            body = re.sub(r"%\((\w+)\)s|%%", numbered, sql)
            typed = f" ({', '.join(types[name] for name in order)})" if order else ""
            # named by what it is: a statement of that name on any server connection (another process's,
            # behind a pooler) is this very statement
            self.name = "voice_tools_" + hashlib.sha256(f"{typed} AS {body}".encode()).hexdigest()[:24]
            self.prepare = f"PREPARE {self.name}{typed} AS {body}"
            args = f" ({', '.join(f'%({name})s' for name in order)})" if order else ""
            self.execute = f"EXECUTE {self.name}{args}"

    def parameters(self, params: dict[str, Any]) -> dict[str, Any]:
        values = {}
        for name, key, constant, process in self.binds:
            if key in params:  # a processor takes None too (JSON's makes it the JSON null, as SQLAlchemy does)
                values[name] = params[key] if process is None else process(params[key])
            elif constant is _MISSING:
                raise KeyError(f"a value is required for bind parameter {key!r}")
            else:
                values[name] = constant
        return values


def _plan(stmt: Any, dialect: Any) -> _Plan | None:
    compiled = stmt.compile(dialect=dialect)
    if (compiled.positional or compiled.literal_execute_params or compiled.post_compile_params
            or compiled.escaped_bind_names):
        return None  # its SQL is finished at each execution: SQLAlchemy's own path
    processors = compiled._bind_processors
    binds = []
    types: dict[str, str] | None = {}
    for bindparam, name in compiled.bind_names.items():
        if bindparam.callable is not None:
            return None
        try:
            if types is not None:
                types[name] = bindparam.type.compile(dialect=dialect)
        except exc.CompileError:  # a parameter of no type the server can be told: not prepared
            types = None
        process = processors.get(name)
        if bindparam.required:
            constant = _MISSING  # the caller gives it
        else:
            constant = bindparam.value if process is None else process(bindparam.value)
        binds.append((name, bindparam.key, constant, process))
    return _Plan(compiled.string, _summary(stmt, compiled.string), binds, types)


_CHANGES = re.compile(r"\b(INSERT\s+INTO|UPDATE|DELETE\s+FROM)\s+\"?(\w+)", re.IGNORECASE)
_READS = re.compile(r"\bFROM\s+\"?(\w+)", re.IGNORECASE)
_LOCKS = re.compile(r"\bFOR\s+(NO\s+KEY\s+)?(UPDATE|SHARE)\b", re.IGNORECASE)  # a read's row locks


def _summary(stmt: Any, sql: str) -> str:
    """The operation and its table (``UPDATE tool_calls``, ``SELECT tool_calls``): a data-modifying CTE's
    is its first change; else the SQL's first word."""
    verb = ("INSERT" if stmt.is_insert else "UPDATE" if stmt.is_update else "DELETE" if stmt.is_delete
            else None)
    name = getattr(getattr(stmt, "table", None), "name", None)
    if verb and isinstance(name, str):
        return f"{verb} {name}"
    changes = _CHANGES.search(_LOCKS.sub("", sql))
    if changes:
        return f"{changes.group(1).split()[0].upper()} {changes.group(2)}"
    reads = _READS.search(sql)
    if reads and sql.lstrip().upper().startswith(("SELECT", "WITH")):
        return f"SELECT {reads.group(1)}"
    return (sql.split(None, 1) or ["statement"])[0]


class Compiled:
    """``stmt`` run on the driver's cursor; built once, at import or once per statement shape."""

    __slots__ = ("stmt", "_plans")

    def __init__(self, stmt: Any):
        self.stmt = stmt
        self._plans: dict[Any, _Plan | None] = {}

    def one_or_none(self, s: Session | Connection, params: dict[str, Any]) -> Any:
        """The statement's one row (None if it returned none)."""
        return self._run(s, params, fetch="one")

    def all(self, s: Session | Connection, params: dict[str, Any]) -> list[Any]:
        """The statement's rows."""
        return self._run(s, params, fetch="all")

    def execute(self, s: Session | Connection, params: dict[str, Any]) -> None:
        """Run a statement that returns no rows."""
        self._run(s, params, fetch=None)

    def _run(self, s: Session | Connection, params: dict[str, Any], fetch: str | None) -> Any:
        conn = s if isinstance(s, Connection) else s.connection()
        dialect = conn.dialect
        plan = self._plans.get(dialect, _MISSING)
        if plan is _MISSING:
            plan = self._plans[dialect] = _plan(self.stmt, dialect)
        if plan is None or conn.dispatch.before_cursor_execute:
            result = conn.execute(self.stmt, params)
            return None if fetch is None else result.one_or_none() if fetch == "one" else list(result)
        values = plan.parameters(params)
        cursor = span = None
        try:
            pooled = conn.connection
            dbapi = pooled.dbapi_connection
            if tracing.statement_spans():  # its span is ours, on the driver's own cursor (voice_tools_tracing/statements.py)
                cursor = dbapi.cursor(cursor_factory=dialect.loaded_dbapi.extensions.cursor)
                span = statements.begun(plan.summary, plan.sql, dbapi, pooled.info)
            else:
                cursor = dbapi.cursor()
            if not (_preparing and plan.name and dbapi.autocommit
                    and _run_prepared(plan, pooled.info, cursor, values, dialect.loaded_dbapi)):
                cursor.execute(plan.sql, values)
            if fetch is None:
                return None
            found = cursor.fetchall()
            if fetch == "one" and len(found) > 1:
                raise exc.MultipleResultsFound("the statement returned more than one row")
            names = tuple(column[0] for column in cursor.description)
        except conn.dialect.loaded_dbapi.Error as error:
            statements.ended(span, error)
            span = None
            conn._handle_dbapi_exception(error, plan.sql, values, cursor, None)
        finally:
            if cursor is not None:
                cursor.close()
            if span is not None:
                statements.ended(span)
        row = plan.rows.get(names)
        if row is None:
            row = plan.rows[names] = _row_class(names)
        if fetch == "all":
            return [row(*each) for each in found]
        return row(*found[0]) if found else None


def _run_prepared(plan: _Plan, info: dict[str, Any], cursor: Any, values: dict[str, Any], dbapi: Any) -> bool:
    """Run ``plan`` prepared on this connection (preparing it first if it is not): False if it could
    not be (it did nothing then; the caller runs it as text)."""
    global _preparing
    prepared = info.setdefault(_PREPARED, set())
    try:
        if plan.name not in prepared:
            try:
                cursor.execute(plan.prepare)
            except dbapi.Error as error:
                if getattr(error, "pgcode", None) != _ALREADY_PREPARED:
                    raise
            prepared.add(plan.name)
        try:
            cursor.execute(plan.execute, values)
        except dbapi.Error as error:
            if not db.plan_refused(error):
                raise
            # a returned column changed type since it was prepared (a migration under this process): the
            # EXECUTE did nothing (autocommit); prepared again, it runs once more, in this same call
            log.info("a statement's plan was refused after a schema change; prepared again (%s)", plan.summary)
            cursor.execute(f"DEALLOCATE {plan.name}")
            cursor.execute(plan.prepare)
            cursor.execute(plan.execute, values)
        return True
    except dbapi.Error as error:
        code = getattr(error, "pgcode", None)
        if code != _NOT_PREPARED and isinstance(error, (dbapi.OperationalError, dbapi.InterfaceError)):
            raise  # the connection, not the statement: SQLAlchemy's handling (it may be invalidated)
        if code == _NOT_PREPARED:
            _preparing = False
            log.warning("the database connection is not the one a statement was prepared on (a pooler in "
                        "transaction mode?): statements are no longer prepared in this process (%s)", code)
            return False
        if plan.name not in prepared:  # the server refused to prepare it: it runs as text from now on
            plan.name = None
            log.warning("a statement could not be prepared (%s); it runs as text", error)
            return False
        raise
