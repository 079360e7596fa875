"""Helpers for sentences a voice assistant says aloud (the tools' ``voice_response``)."""
from __future__ import annotations

import re
from typing import Any, Callable, Mapping

TOPIC_WORDS = 6  # a question longer than this is not said back: "that"
_QUESTION_WORDS = frozenset(
    "how what when where why who whom whose which can could do does did is are was were should would will may "
    "shall have has had i i'm my we our tell find show give please search look get".split())
_SENTENCE_END = re.compile(r"[.!?](?=\s)")


def topic(question: str) -> str | None:
    """``question`` as a short topic to say back ("the weather in Paris"), or None when saying it back would
    repeat a whole question ("How do I ...?", more than six words): the sentence then says "that"."""
    words = question.strip().rstrip(".!").split()
    if not words or len(words) > TOPIC_WORDS or question.strip().endswith("?"):
        return None
    if words[0].lower().strip(",") in _QUESTION_WORDS:
        return None
    return " ".join(words)


_ISO_DATE = re.compile(r"\b(\d{4})-(\d{2})-(\d{2})\b(?!:)")
_PERCENT = re.compile(r"(\d)\s?%")


def spoken_numbers(text: str) -> str:
    """A document's numbers as a person says them: "8%" as "8 percent", "2026-09-30" as "September 30, 2026"."""
    import calendar

    def date(match: re.Match[str]) -> str:
        year, month, day = (int(g) for g in match.groups())
        if not (1 <= month <= 12 and 1 <= day <= 31):
            return match.group(0)
        return f"{calendar.month_name[month]} {day}, {year}"

    return _PERCENT.sub(r"\1 percent", _ISO_DATE.sub(date, text))


def passage(snippet: str) -> str:
    """A snippet cut short ("...") said to its last whole sentence when it has one, else as it is, its numbers
    and dates as they are said (:func:`spoken_numbers`); ends with a full stop."""
    text = spoken_numbers(snippet.strip())
    if text.endswith("..."):
        ends = [m.end() for m in _SENTENCE_END.finditer(text)]
        if ends:
            text = text[:ends[-1]]
    return text if text[-1:] in (".", "?", "!") else text + "."


def said_back(words: str) -> str:
    """What the caller asked, said back inside a sentence: "How do I reset my password?" becomes "how do
    I reset my password" (no closing mark, a capital kept only where it is a name or an acronym)."""
    text = " ".join(str(words).split()).rstrip("?!. ")
    if len(text) > 1 and text[0].isupper() and text[1].islower():
        text = text[0].lower() + text[1:]
    return text


class _Blank(dict):
    def __missing__(self, key: str) -> str:
        return ""


def saying_back(template: str, key: str) -> Callable[..., str]:
    """A tool's sentence that says the parameter ``key`` back as :func:`said_back` does."""
    def render(parameters: Mapping[str, Any], **extra: Any) -> str:
        return template.format_map(_Blank({**parameters, **extra, key: said_back(parameters.get(key) or "")}))

    return render
