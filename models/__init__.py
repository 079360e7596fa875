"""The ground floor: tables, the database session and the state machine.

Nothing here imports the rest of voice-tools.
"""


def import_all() -> None:
    """Import every table module (``models/<backend>.py``), so ``Base.metadata`` knows them all."""
    import importlib
    import pkgutil

    for module in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{module.name}")
