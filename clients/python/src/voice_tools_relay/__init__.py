"""voice-tools' relay client: :func:`verify` a signed callback (:func:`trace_context`: the trace it
continues), :class:`Client` for the REST calls
and :meth:`Client.follow` for the event stream.

Nothing here imports voice-tools itself: the client speaks HTTP (``requests``) and checks
signatures with ``standardwebhooks``.
"""
from voice_tools_relay.client import Client, Event, RelayError
from voice_tools_relay.signatures import SignatureError, trace_context, verify

__all__ = ["Client", "Event", "RelayError", "SignatureError", "trace_context", "verify"]
__version__ = "0.1.0"
