"""The Celery app Flower watches: the tasks app's name, settings and queues, without a task or a tool module.

Flower needs the broker, the queues (so operators see each tool's ``tools.<name>`` queue and its
length with no worker online) and the workers' events; it never runs a task. ``tasks.app`` imports
every task module, and through them SQLAlchemy, the tool registry with marshmallow and the backends,
the worker's plug-ins: about 30 MB that Flower would hold for nothing. This app reads the tools'
names from the registry's folder (a tool is the module of its name, ``tasks/tools/<name>.py``,
which the registry checks), so it imports none of them.
"""
from __future__ import annotations

from pathlib import Path

import click
from celery import Celery

from celeryconfig import queue

TOOLS_FOLDER = Path(__file__).with_name("tools")  # the registry's package: one module per tool


def data_dir_option() -> click.Option:
    """The ``--data-dir`` preload option every command of an app of ours takes (``voice_tools/celery_commands.py``
    joins that data dir's embedded servers when no server variable is set)."""
    return click.Option(
        ["--data-dir"], default=None, metavar="PATH",
        help="voice-tools: the data dir whose embedded servers to join when DATABASE_URL, REDIS_URL and "
             "CELERY_BROKER_URL are unset (default: VOICE_TOOLS_DATA_DIR, else ./.voice-tools).")


def tool_names() -> list[str]:
    """The tools' names, from the registry's module files (``_``-prefixed ones are its helpers), sorted."""
    return sorted(path.stem for path in TOOLS_FOLDER.glob("*.py") if not path.stem.startswith("_"))


def queue_names() -> list[str]:
    """Every queue the tasks app declares: ``tools.<name>`` per tool, then ``callbacks`` and ``maintenance``."""
    return [f"tools.{name}" for name in tool_names()] + ["callbacks", "maintenance"]


app = Celery("tasks")
app.config_from_object("celeryconfig")
app.conf.task_queues = tuple(queue(name) for name in queue_names())
app.user_options["preload"].add(data_dir_option())
