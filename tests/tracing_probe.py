"""A task a worker loads for tests/test_tracing.py (``--include``): what this worker process has loaded."""
from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

from tasks.celery_app import app


@app.task(name="tests.tracing_probe.loaded")
def loaded(path: str) -> None:
    """Write the modules and threads of this process to ``path`` (JSON; written whole, then renamed)."""
    seen = {"modules": sorted(sys.modules), "threads": [t.name for t in threading.enumerate()]}
    Path(path + ".part").write_text(json.dumps(seen))
    Path(path + ".part").rename(path)
