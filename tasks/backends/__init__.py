"""Side effects and data sources of the tools. No Celery, no Flask: only ``models``."""
