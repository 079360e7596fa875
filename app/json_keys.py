"""A JSON object read with every key kept: a key given twice is refused on both faces (REST and MCP), so no
proxy or signer that reads the first of the two can see another request than the one run. No Flask here,
so the MCP face may import it."""
from __future__ import annotations

from typing import Any

from tasks.calls.errors import ApiError


class DuplicateKey(ValueError):
    """A JSON object names ``key`` twice."""

    def __init__(self, key: str):
        super().__init__(f"the key {key!r} is given twice")
        self.key = key


def unique_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads``' ``object_pairs_hook``: the object as a dict, unless it names a key twice."""
    made = dict(pairs)
    if len(made) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise DuplicateKey(key)
            seen.add(key)
    return made


def refused(exc: DuplicateKey, what: str = "body") -> ApiError:
    """The 400 of a JSON ``what`` that names a key twice."""
    return ApiError(400, "bad_json", f"The {what} gives the key {exc.key!r} twice.", {"key": exc.key})
