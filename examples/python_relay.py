"""An example relay written with the Python client (clients/python, ``voice_tools_relay``) alone.

It takes one OpenAI-Realtime-style function call (``response.function_call_arguments.done``),
records it, asks the caller to confirm, confirms on "yes", announces the checkpoint, resumes or
cancels on the caller's answer, and speaks the call's ``voice_response``; it learns of the
checkpoint and the end from the session's event stream (``Client.follow``), so it needs no
callback endpoint. Here "speaking" is a
line on standard output and the caller's answers are lines of standard input; a real relay puts
its speech-to-text and text-to-speech there, and sends ``function_call_output`` back to the model.

    VOICE_TOOLS_API=http://127.0.0.1:8000 VOICE_TOOLS_TOKEN=... \\
        python examples/python_relay.py '{"type": "response.function_call_arguments.done",
        "name": "send_email", "call_id": "call_8f3a1c", "arguments": "{\\"to\\": \\"john@example.com\\",
        \\"subject\\": \\"Hello\\"}"}'

(``voice-tools run`` prints the API's URL and a token; with the client installed, or
``PYTHONPATH=clients/python/src``.) Give each run its own ``call_id``: it is the call's idempotency
key, so the same id again is the call already recorded, which has ended (docs/relay-guide.md, Clients).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Callable

from voice_tools_relay import Client, Event, RelayError

def yes(answer: str) -> bool:
    return answer.strip().lower().rstrip(".!") in ("yes", "y", "yeah", "sure", "ok", "okay", "send it", "go ahead")


def next_stop(client: Client, session_id: str, tool_call_id: str, after: str | None = None) -> Event:
    """The call's next event that is not mere progress (its checkpoint, or how it ended), from the
    session's event stream, after the event ``after`` (from the session's start when None)."""
    for event in client.follow(session_id, last_event_id=after):
        if event["tool_call_id"] == tool_call_id and event.kind != "progress":
            return event
    raise RuntimeError("the event stream ended")  # follow() reconnects by itself: not reached


def handle(client: Client, session_id: str, function_call: dict[str, Any],
           ask: Callable[[str], str], say: Callable[[str], None]) -> dict[str, Any]:
    """Run one function call with the caller; return the ``function_call_output`` item for the model."""
    arguments = json.loads(function_call.get("arguments") or "{}")
    try:
        call = client.pending(session_id, function_call["name"], arguments,
                              idempotency_key=function_call["call_id"])  # the model's retry is the same call
        tool_call_id = call["tool_call_id"]
        if not yes(ask(call["message"])):  # "Ready to send email to …. Confirm to proceed."
            outcome: dict[str, Any] = client.cancel(tool_call_id, reason="The caller said no")
        else:
            client.confirm(tool_call_id)
            outcome = next_stop(client, session_id, tool_call_id)
            if outcome.kind == "checkpoint":  # "The email to … is ready. Send it?"
                action = "proceed" if yes(ask(outcome["message"])) else "cancel"
                client.resume(tool_call_id, action)
                outcome = next_stop(client, session_id, tool_call_id, after=outcome.id)
        say(outcome.get("voice_response") or outcome.get("message") or outcome["status"])
    except RelayError as error:  # the server's sentence is fit to say
        outcome = {"status": "ERROR", "error": error.error, "voice_response": error.message}
        say(error.message)
    return {"type": "conversation.item.create",
            "item": {"type": "function_call_output", "call_id": function_call["call_id"],
                     "output": json.dumps({k: outcome.get(k) for k in ("status", "result", "voice_response", "error")
                                           if outcome.get(k) is not None})}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("function_call", help="the Realtime event, JSON")
    parser.add_argument("--session", default="relay_example", help="the voice session's id")
    parser.add_argument("--api", default=os.environ.get("VOICE_TOOLS_API", "http://127.0.0.1:8000"))
    parser.add_argument("--token", default=os.environ.get("VOICE_TOOLS_TOKEN", ""))
    args = parser.parse_args(argv)
    client = Client(args.api, args.token)

    def ask(question: str) -> str:
        print(f"assistant: {question}", flush=True)
        answer = sys.stdin.readline()
        print(f"caller: {answer.strip()}", flush=True)
        return answer

    def say(sentence: str) -> None:
        print(f"assistant: {sentence}", flush=True)

    output = handle(client, args.session, json.loads(args.function_call), ask, say)
    print(f"to the model: {json.dumps(output)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
