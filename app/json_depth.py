"""How deeply a JSON value nests, and how deep a body or a tool's arguments may (both faces hold to it);
no Flask here, so the MCP face does not import it."""
from __future__ import annotations

from typing import Any

MAX_DEPTH = 32


def depth(value: Any) -> int:
    """How deeply ``value`` nests objects and arrays (iterative: no recursion limit to hit)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict):
            item = list(item.values())
        if isinstance(item, list):
            deepest = max(deepest, level)
            stack.extend((child, level + 1) for child in item)
    return deepest
