"""Documents read as a person reads them: a title and sections of plain paragraphs.

What the document store chunks, embeds and reads out (``voice_tools_backends/documents.py``). Every
format ends as a :class:`Parsed`: the title, the front matter's keys, and the
sections in order, each with its heading path (``("Installation", "Linux")``) and its
paragraphs as plain text: no markup, no URLs, no code (a Markdown section's code blocks are
kept apart, for the search only).

- Markdown (``.md``, ``.markdown``): parsed by markdown-it-py (CommonMark, with tables).
  The title is the front matter's ``title``, else the first level-1 heading (``# Title``,
  ``Title`` underlined with ``===``, or an HTML ``<h1>`` block as READMEs write it), else
  the file name (a document whose first heading is ``## Licence`` is not titled so).
  An HTML block that is one heading (``<h2 align="center">Usage</h2>``) starts a section. Images (and so
  badges), HTML comments and tags, link targets (the link's words stay), reference
  definitions and bare URLs are dropped; code blocks are kept out of the paragraphs, in
  their section's ``code`` (searched, never read out);
  inline code keeps its words.
- HTML (``.html``, ``.htm``): the text of ``<main>`` (or ``<article>``, else
  ``<body>``) without scripts, styles, navigation, headers, footers, forms and code;
  ``<h1>``..``<h6>`` make the sections; the title is ``<title>``, else the first heading.
- PDF (``.pdf``): pypdf's text of each page; one section per page (``Page 3``); the
  title is the document's own, else the file name.
- Plain text (``.txt``): paragraphs between blank lines, titled by the file name.

A file that cannot be read raises :class:`Unreadable` saying why.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

MARKDOWN = (".md", ".markdown")
HTML = (".html", ".htm")
PDF = (".pdf",)
TEXT = (".txt",)
EXTENSIONS = MARKDOWN + HTML + PDF + TEXT

_URL = re.compile(r"<?\b(?:https?|ftp)://[^\s<>()]+>?|\bwww\.[^\s<>()]+")
_SPACES = re.compile(r"[ \t\u00a0]+")


class Unreadable(Exception):
    """The file cannot be read as a document; the message says why."""


@dataclass
class Section:
    path: tuple[str, ...]
    paragraphs: list[str] = field(default_factory=list)
    # the section's code blocks, each as (how many of its paragraphs come before it, its text with the
    # whitespace collapsed): searched for their words and meaning, never read out
    code: list[tuple[int, str]] = field(default_factory=list)


@dataclass
class Parsed:
    title: str
    meta: dict[str, Any]
    sections: list[Section]


def title_from_name(path: Path) -> str:
    words = re.sub(r"[-_.]+", " ", path.stem).strip()
    return words[:1].upper() + words[1:] if words else path.name


def plain(text: str) -> str:
    """One line of prose: URLs dropped, spaces collapsed."""
    text = _URL.sub("", text)
    text = re.sub(r"\(\s*\)|\[\s*\]", "", text)  # what a dropped URL leaves behind
    return _SPACES.sub(" ", text).strip()


def read(path: Path) -> Parsed:
    """``path`` as a :class:`Parsed` (see the module's doc); :class:`Unreadable` if it cannot be."""
    suffix = path.suffix.lower()
    if suffix in PDF:
        return _read_pdf(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise Unreadable(exc.strerror or str(exc)) from exc
    if b"\x00" in raw[:4096]:
        raise Unreadable("it is binary, not text")
    text = raw.decode("utf-8", errors="replace").replace("\r\n", "\n").replace("\r", "\n").lstrip("\ufeff")
    if suffix in MARKDOWN:
        return parse_markdown(text, path)
    if suffix in HTML:
        return parse_html(text, path)
    return parse_text(text, path)


# -- plain text ------------------------------------------------------------------------------

def parse_text(text: str, path: Path) -> Parsed:
    paragraphs = [plain(" ".join(block.split())) for block in re.split(r"\n\s*\n", text)]
    return Parsed(title_from_name(path), {}, [Section((), [p for p in paragraphs if p])])


# -- Markdown ----------------------------------------------------------------------------------

def front_matter(raw: str) -> tuple[dict[str, Any], str]:
    """``---``-fenced ``key: value`` lines at the top (a list as ``[a, b]``), and the rest."""
    lines = raw.split("\n")
    if lines and lines[0].strip() == "---":
        for end in range(1, len(lines)):
            if lines[end].strip() in ("---", "..."):
                meta: dict[str, Any] = {}
                for line in lines[1:end]:
                    key, sep, value = line.partition(":")
                    if sep and key.strip() and not key.startswith((" ", "\t", "#")):
                        value = value.strip().strip("'\"")
                        if value.startswith("[") and value.endswith("]"):
                            meta[key.strip()] = [v.strip().strip("'\"") for v in value[1:-1].split(",") if v.strip()]
                        else:
                            meta[key.strip()] = value
                return meta, "\n".join(lines[end + 1:])
    return {}, raw


def _markdown_parser() -> Any:
    from markdown_it import MarkdownIt

    return MarkdownIt("commonmark", {"html": True}).enable(["table", "strikethrough"])


def _inline_text(token: Any) -> str:
    """An inline token's words: link text without its target, no images, no HTML, code as its words."""
    out: list[str] = []
    for child in token.children or []:
        kind = child.type
        if kind in ("text", "code_inline"):
            out.append(child.content)
        elif kind in ("softbreak", "hardbreak"):
            out.append(" ")
        # image, html_inline, link_open/close (the target): nothing
    return plain("".join(out))


def _inline_markdown(text: str) -> str:
    """A line of Markdown (a front matter's title) as its words."""
    tokens = _markdown_parser().parseInline(text)
    return " ".join(_inline_text(t) for t in tokens).strip()


_HTML_HEADING = re.compile(r"\s*<h([1-6])\b[^>]*>(.*?)</h\1>\s*$", re.IGNORECASE | re.DOTALL)  # a README's <h1 align=...>


def parse_markdown(raw: str, path: Path) -> Parsed:
    meta, body = front_matter(raw)
    tokens = _markdown_parser().parse(body)
    headings: list[tuple[int, str]] = []  # the open headings: (level, text)
    sections: list[Section] = [Section(())]
    first_heading = ""  # the first level-1 heading's words

    def heading(level: int, text: str) -> None:
        nonlocal first_heading
        if not text:
            return  # a heading of badges only
        if level == 1:
            first_heading = first_heading or text
        while headings and headings[-1][0] >= level:
            headings.pop()
        headings.append((level, text))
        sections.append(Section(tuple(h for _, h in headings)))

    row: list[str] = []
    in_heading, in_cell = 0, False
    for token in tokens:
        kind = token.type
        if kind == "heading_open":
            in_heading = int(token.tag[1])
        elif kind == "heading_close":
            in_heading = 0
        elif kind in ("th_open", "td_open"):
            in_cell = True
        elif kind in ("th_close", "td_close"):
            in_cell = False
        elif kind == "inline" and in_heading:
            heading(in_heading, _inline_text(token))
        elif kind == "html_block" and _HTML_HEADING.match(token.content):
            match = _HTML_HEADING.match(token.content)
            heading(int(match.group(1)), _html_fragment_text(match.group(2)))
        elif kind == "inline" and in_cell:
            row.append(_inline_text(token))
        elif kind == "tr_close":
            cells = [c for c in row if c]
            if cells:
                sections[-1].paragraphs.append(", ".join(cells) + ".")
            row = []
        elif kind == "inline":
            text = _inline_text(token)
            if text:
                sections[-1].paragraphs.append(text)
        elif kind == "html_block":
            text = _html_fragment_text(token.content)
            if text:
                sections[-1].paragraphs.append(text)
        elif kind in ("fence", "code_block"):
            text = " ".join(token.content.split())
            if text:
                sections[-1].code.append((len(sections[-1].paragraphs), text))
        # hr, list and quote markers: nothing to say
    given = str(meta.pop("title", "") or "")
    title = (_inline_markdown(given) if given else "") or first_heading or title_from_name(path)
    kept = []
    for section in sections:
        trimmed = section.path[1:] if section.path[:1] == (title,) else section.path
        if section.paragraphs or (section.code and trimmed):  # code before any heading, alone: left out
            kept.append(Section(trimmed, section.paragraphs, section.code))
    return Parsed(title, meta, kept)


# -- HTML ---------------------------------------------------------------------------------------

_SKIPPED = {"script", "style", "nav", "header", "footer", "aside", "noscript", "template", "svg", "form",
            "button", "select", "pre", "code", "iframe", "object", "canvas", "head"}
_BLOCKS = {"p", "div", "li", "dt", "dd", "tr", "br", "section", "article", "main", "blockquote", "table",
           "ul", "ol", "dl", "figure", "figcaption", "hr", "body", "caption"}
_HEADINGS = {f"h{n}": n for n in range(1, 7)}
_VOID = {"br", "hr", "img", "input", "meta", "link", "area", "base", "col", "embed", "source", "track", "wbr"}


class _HtmlText(HTMLParser):
    """Sections of a page: headings, and paragraphs of the text between block tags."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.title = ""
        self.in_title = False
        self.skip = 0          # depth inside skipped elements
        self.stack: list[str] = []
        self.heading = 0
        self.heading_text: list[str] = []
        self.text: list[str] = []
        self.headings: list[tuple[int, str]] = []
        self.sections: list[Section] = [Section(())]
        self.main_depth: int | None = None  # inside <main>/<article>: only that counts when present
        self.main_sections: list[Section] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in _VOID:
            if tag == "br":
                self._flush()
            return
        self.stack.append(tag)
        if tag == "title":
            self.in_title = True
        if tag in _SKIPPED or ("hidden", None) in attrs or dict(attrs).get("aria-hidden") == "true":
            self.skip += 1
            return
        if tag in ("main", "article") and self.main_depth is None and not self.skip:
            self._flush()
            self.main_depth = len(self.stack)
            self.main_sections = [Section(self._path())]
        if tag in _HEADINGS and not self.skip:
            self._flush()
            self.heading, self.heading_text = _HEADINGS[tag], []
        elif tag in _BLOCKS:
            self._flush()

    def handle_endtag(self, tag: str) -> None:
        if tag in _VOID or tag not in self.stack:
            return
        while self.stack:
            open_tag = self.stack.pop()
            if open_tag == "title":
                self.in_title = False
            if open_tag in _SKIPPED:
                self.skip = max(0, self.skip - 1)
            if open_tag in _HEADINGS and self.heading:
                self._end_heading()
            elif open_tag in _BLOCKS:
                self._flush()
            if self.main_depth is not None and len(self.stack) < self.main_depth:
                self._flush()
                self.main_depth = -1  # the main part is over: the rest of the page no longer counts
            if open_tag == tag:
                break

    def handle_data(self, data: str) -> None:
        if self.in_title:
            self.title += data
            return
        if self.skip or self.main_depth == -1:
            return
        (self.heading_text if self.heading else self.text).append(data)

    def _path(self) -> tuple[str, ...]:
        return tuple(h for _, h in self.headings)

    def _target(self) -> list[Section]:
        return self.main_sections if self.main_sections is not None and self.main_depth != -1 else self.sections

    def _end_heading(self) -> None:
        text = plain(" ".join("".join(self.heading_text).split()))
        level, self.heading = self.heading, 0
        if not text:
            return
        while self.headings and self.headings[-1][0] >= level:
            self.headings.pop()
        self.headings.append((level, text))
        self._target().append(Section(self._path()))

    def _flush(self) -> None:
        if self.heading:
            return
        text = plain(" ".join("".join(self.text).split()))
        self.text = []
        if text and self.main_depth != -1:
            self._target()[-1].paragraphs.append(text)

    def result(self) -> list[Section]:
        self._flush()
        chosen = self.main_sections if self.main_sections is not None else self.sections
        return [s for s in chosen if s.paragraphs]


def parse_html(raw: str, path: Path) -> Parsed:
    reader = _HtmlText()
    reader.feed(raw)
    reader.close()
    sections = reader.result()
    first = next((h for s in reader.sections + (reader.main_sections or []) for h in s.path[:1]), "")
    title = plain(" ".join(reader.title.split())) or first or title_from_name(path)
    return Parsed(title, {}, [Section(s.path[1:] if s.path[:1] == (title,) else s.path, s.paragraphs)
                              for s in sections])


def _html_fragment_text(fragment: str) -> str:
    """The words of an HTML block inside Markdown (comments, images and tags dropped)."""
    reader = _HtmlText()
    reader.feed(fragment)
    reader.close()
    return " ".join(p for s in reader.result() for p in ([" ".join(s.path)] if s.path else []) + s.paragraphs).strip()


# -- PDF ----------------------------------------------------------------------------------------

def _read_pdf(path: Path) -> Parsed:
    import logging

    from pypdf import PdfReader
    from pypdf.errors import PdfReadError

    logging.getLogger("pypdf").setLevel(logging.ERROR)
    try:
        reader = PdfReader(str(path))
        if reader.is_encrypted:
            try:
                reader.decrypt("")
            except Exception as exc:
                raise Unreadable("it is an encrypted PDF") from exc
        pages = [page.extract_text() or "" for page in reader.pages]
        info = reader.metadata
        own_title = str(info.title or "") if info else ""
    except Unreadable:
        raise
    except (PdfReadError, OSError, ValueError, KeyError, TypeError) as exc:
        raise Unreadable(f"it is not a readable PDF ({exc})") from exc
    sections = []
    for number, text in enumerate(pages, 1):
        text = re.sub(r"(\w)-\n(\w)", r"\1\2", text)  # a word hyphenated at the end of a line
        paragraphs = [plain(" ".join(block.split())) for block in re.split(r"\n\s*\n", text)]
        paragraphs = [p for p in paragraphs if p]
        if paragraphs:
            sections.append(Section((f"Page {number}",), paragraphs))
    if not sections:
        raise Unreadable("the PDF has no text (a scanned document?)")
    return Parsed(plain(own_title) or title_from_name(path), {}, sections)
