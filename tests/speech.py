"""What a spoken sentence may not hold: markup, URLs, file names, code (shared by the tests of every tool)."""
from __future__ import annotations

import re

MARKUP = {
    "a backtick (code)": re.compile(r"`"),
    "Markdown emphasis": re.compile(r"\*\*|__|(?<!\w)\*\w"),
    "a Markdown heading or anchor": re.compile(r"#"),
    "an HTML tag or comment": re.compile(r"<[a-zA-Z!/][^>]*>|&[a-z]+;"),
    "a Markdown link or image": re.compile(r"\]\(|!\[|\[[^\]]*\]"),
    "a URL": re.compile(r"\b(?:https?|ftp)://|\bwww\.", re.I),
    "a file name": re.compile(r"\b[\w-]+\.(?:md|markdown|html?|pdf|txt|docx?|json|csv|ya?ml|py|rst|onnx)\b", re.I),
    "a table or code fence": re.compile(r"\||~~~"),
    "a template placeholder": re.compile(r"[{}]"),
    "a line break": re.compile(r"\n"),
}


def markup_in(said: str) -> list[str]:
    """What in ``said`` a person would not say aloud ([] when it is plain speech)."""
    return [name for name, pattern in MARKUP.items() if pattern.search(said)]
