"""What the benchmark's calls share: the API token it sends, and how many links a confirm runs."""
from __future__ import annotations

from typing import Any

API_TOKEN = "bench-token"
AUTH = {"Authorization": f"Bearer {API_TOKEN}"}


def links_to_checkpoint(tool: Any) -> int:
    """How many links a confirm of ``tool`` runs: up to and with its checkpoint."""
    return [step.checkpoint for step in tool.steps].index(True) + 1
