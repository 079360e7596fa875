"""The stream loop's gauges (``app/stream_loop.py``): prometheus-client only, no Flask, so the MCP face, which
holds the loop too, loads none. The API's ``/metrics`` (``app/metrics.py``) shows them."""
from __future__ import annotations

from prometheus_client import Gauge

# the event streams the API's processes serve now; summed over the live processes
STREAMS_OPEN = Gauge("voice_tools_event_streams_open", "Event streams served now", multiprocess_mode="livesum")
