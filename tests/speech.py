"""What a spoken sentence may not hold: markup, URLs, file names, code, and numbers or dates as a machine writes
them (ISO dates and times, UTC offsets, raw decimals, percent signs); shared by the tests of every tool."""
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
    "an ISO date": re.compile(r"\b\d{4}-\d{2}-\d{2}(?!\d)"),
    "a 24-hour clock time or seconds": re.compile(r"\b\d{1,2}:\d{2}:\d{2}\b|\b(?:0\d|1[3-9]|2[0-3]):[0-5]\d\b"),
    "a UTC offset or Z": re.compile(r"[+-]\d{2}:\d{2}\b|\d[zZ]\b"),
    "a raw decimal (a ratio, not a percentage)": re.compile(r"(?<![\d.])0\.\d{2,}|\b\d+\.\d{3,}\b"),
    "a percent sign": re.compile(r"%"),
}


def markup_in(said: str) -> list[str]:
    """What in ``said`` a person would not say aloud ([] when it is plain speech)."""
    return [name for name, pattern in MARKUP.items() if pattern.search(said)]


def sentences(said: str) -> int:
    """How many sentences ``said`` holds (ends of sentence followed by a space or the end; "p.m." is none)."""
    return len(re.findall(r"(?<![ap]\.m)(?<!\b[A-Z])[.!?](?=\s|$)", said.strip()))
