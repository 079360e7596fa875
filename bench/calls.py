"""What the benchmark's calls share: the API token it sends, and how many links a confirm runs."""
from __future__ import annotations

from typing import Any

API_TOKEN = "bench-token"
AUTH = {"Authorization": f"Bearer {API_TOKEN}"}


def links_to_checkpoint(tool: Any) -> int:
    """How many steps a confirm of ``tool`` runs, up to and with its checkpoint: the bare chain it is
    measured against has a link for each (the engine may run fewer links: a step with no work of
    its own is done by the link before it, ``tasks/chains.py``)."""
    return [step.checkpoint for step in tool.steps].index(True) + 1
