"""``voice-tools openapi``: the API's OpenAPI document (what ``GET /openapi.json`` answers), built from the code.

No server and no database: the document is made from the Flask app's routes and the tools' schemas, so a
client's generated types (``clients/typescript``'s build) always come from the code as it is.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def document() -> dict:
    from app import create_app, openapi

    return openapi.build(create_app())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="voice-tools openapi",
                                     description="Print (or write) the API's OpenAPI document, as GET /openapi.json answers it.")
    parser.add_argument("-o", "--output", metavar="FILE", help="write it to FILE instead of printing it")
    args = parser.parse_args(argv)
    text = json.dumps(document(), indent=2, sort_keys=True) + "\n"
    if args.output:
        Path(args.output).write_text(text)
    else:
        sys.stdout.write(text)
    return 0
