"""The console's answers' headers: a strict Content-Security-Policy (this origin only, no inline
script or style, no frames), ``X-Frame-Options: DENY``, no sniffing, no referrer, nothing cached
but the static files."""
from __future__ import annotations

from flask import Blueprint, Response, request

CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
       "base-uri 'none'; form-action 'self'; frame-ancestors 'none'")
HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cross-Origin-Opener-Policy": "same-origin",
}


def guard(blueprint: Blueprint) -> None:
    @blueprint.after_request
    def _headers(response: Response) -> Response:
        response.headers.update(HEADERS)
        if request.endpoint != "console_pages.static":
            response.headers.setdefault("Cache-Control", "no-store")
        return response
