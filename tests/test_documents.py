"""The document store (voice_tools_backends/documents.py) on the real PostgreSQL + pgvector, with
the real offline embedding model; query_vector_db and search_documentation end to end
through a real worker; OpenAI through the real client against a local HTTP double."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import psycopg2
import pytest
from sqlalchemy import func, select, text

from models import db
from models.calls import SessionContext
from models.documents import DocumentChunk
from tasks.calls import actions
from voice_tools_backends import documents
from tests.helpers import deliveries, make_call, wait_status
from tests.test_embeddings import chat_answer, embeddings_answer, fake_vector, openai_api  # noqa: F401 (fixture)

ROOT = Path(__file__).resolve().parent.parent
LOCAL = "all-MiniLM-L6-v2-int8-dyn"

HR_GUIDE = """---
team: hr
audience: staff
---
# People handbook

Welcome to the company. This handbook explains how we work together.

## Sick leave

If you are ill, tell your manager before 10am. From the fourth day of sickness you need a doctor's note.

## Bicycle scheme

Employees can lease an e-bike through the salary sacrifice scheme; the lease runs for 36 months.
"""

IT_NOTES = """Printers

The office printers on every floor print double-sided by default. To print in colour, choose the
colour queue and enter your badge number at the printer.
"""


def chunks() -> list[DocumentChunk]:
    with db.session() as s:
        return list(s.scalars(select(DocumentChunk).order_by(DocumentChunk.id)))


@pytest.fixture
def folder(tmp_path):
    docs = tmp_path / "docs"
    (docs / "it").mkdir(parents=True)
    (docs / "handbook.md").write_text(HR_GUIDE)
    (docs / "it" / "printers.txt").write_text(IT_NOTES)
    (docs / "it" / "ignored.pdf").write_text("not a text file")
    (docs / ".drafts").mkdir()
    (docs / ".drafts" / "secret.md").write_text("# Draft\n\nNot for the store.")
    return docs


@pytest.fixture
def demo():
    assert documents.load_demo() == len(documents.DEMO_DOCUMENTS)


# -- chunking ---------------------------------------------------------------------------------

def test_chunks_follow_headings_and_stay_near_800_characters():
    paragraph = "This sentence is about the expense policy and is a little long. " * 6  # ~390 characters
    body = f"# Title\n\nIntro.\n\n## Part one\n\n{paragraph}\n\n{paragraph}\n\n{paragraph}\n\n## Part two\n\n" \
           f"```\n# not a heading, code\n```\n\n{'word ' * 400}"
    cut = documents.chunk_text(body)
    # the title's own heading is not part of a section's path; "#" in code is no heading
    assert [chunk.section for chunk in cut] == [""] + ["Part one"] * 2 + ["Part two"] * 3
    assert cut[0].content == "Intro."
    assert cut[1].content.count("expense policy") == 12 and cut[2].content.count("expense policy") == 6  # two fit
    assert not any("not a heading" in c.content or "```" in c.content for c in cut)  # code is not read out
    # but kept with the chunk it comes in (before any paragraph of its section: the section's first), for the search
    assert [c.code for c in cut] == ["", "", "", "# not a heading, code", "", ""]
    assert all(len(c.content) <= 800 for c in cut)
    assert "".join(c.content for c in cut[3:]).count("word") == 400  # nothing lost when a paragraph is cut
    assert documents.chunk_text("# Not a heading in a .txt\n\nText.", markdown=False) == [
        ("", "# Not a heading in a .txt\n\nText.", "")]


def test_code_goes_with_the_paragraph_before_it_and_a_section_of_code_alone_says_its_heading():
    long = "A paragraph about the installation that takes some room. " * 10  # ~580 characters
    body = (f"# Tool\n\n## Install\n\n{long}\n\n```sh\npip install tool\n```\n\n{long}\n\n"
            f"```sh\ntool --version\n```\n\n## File size humanization\n\n```pycon\n>>> naturalsize(3000000)\n"
            f"'3.0 MB'\n```\n\n```\nsecond   block\n```\n")
    cut = documents.chunk_text(body)
    assert [(c.section, c.code) for c in cut] == [
        ("Install", "pip install tool"), ("Install", "tool --version"),
        ("File size humanization", ">>> naturalsize(3000000) '3.0 MB'\nsecond block")]
    assert cut[2].content == "File size humanization"  # what is read out: the heading, never the code
    assert documents.chunk_text("```\ncode before any heading\n```\n\n# Title\n\nText.") == [("", "Text.", "")]
    listing = " ".join(f"line_{n} = {n}" for n in range(2000))  # a long listing: what is kept is cut at a word
    (kept,) = documents.chunk_text(f"# T\n\n## Listing\n\nThe listing.\n\n```\n{listing}\n```\n")
    assert len(kept.code) <= documents.CODE_CHARS and listing.startswith(kept.code + " ")


README = """<!-- YAML added: v9.0.0 -->
[![Build status](https://img.shields.io/badge/build-passing-green.svg)](https://ci.example.com/job)
[![crates.io](https://img.shields.io/crates/v/rustfmt.svg)](https://crates.io/crates/rustfmt)

Mosquitto broker
================

Mosquitto is a message broker that speaks the MQTT protocol; see [the website](https://mosquitto.org/)
or https://mosquitto.org/documentation/ for more, and `mosquitto.conf` for the settings.

![architecture](docs/architecture.png)

Installation
------------

### Linux

Install the package from your distribution, then start the service:

```sh
sudo apt install mosquitto   # not read out
```

| Distribution | Package |
|---|---|
| Debian | mosquitto |

See [the timeouts][primitive] for the limits.

[primitive]: #timeoutsymboltoprimitive
"""


def test_markdown_is_parsed_title_sections_and_plain_text_only(tmp_path):
    path = tmp_path / "README.md"
    path.write_text(README)
    rows = documents.read_document(path)
    assert {r["title"] for r in rows} == {"Mosquitto broker"}  # the setext heading, not the badges or the comment
    assert [r["doc_metadata"].get("section") for r in rows] == [None, "Installation › Linux"]
    intro, linux = (r["content"] for r in rows)
    assert intro == ("Mosquitto is a message broker that speaks the MQTT protocol; see the website or for more, "
                     "and mosquitto.conf for the settings.")
    assert linux == ("Install the package from your distribution, then start the service:\n\n"
                     "Distribution, Package.\n\nDebian, mosquitto.\n\nSee the timeouts for the limits.")
    # the code block is kept apart: searched (embedded after the text), never read out
    assert [r["code"] for r in rows] == ["", "sudo apt install mosquitto # not read out"]
    for row in rows:
        text = row["content"] + documents.embedding_text({**row, "code": ""})
        for markup in ("http", "<!--", "![", "](", "`", "|", "#", "apt install", "YAML", "shields"):
            assert markup not in text, (markup, text)
    assert documents.embedding_text(rows[1]) == (f"Mosquitto broker\nInstallation › Linux\n{linux}\n"
                                                 "sudo apt install mosquitto # not read out")

    (tmp_path / "front.md").write_text("---\ntitle: The *real* title\nteam: ops\n---\n# Heading\n\nText.\n")
    (front,) = documents.read_document(tmp_path / "front.md")
    assert front["title"] == "The real title" and front["doc_metadata"]["team"] == "ops"
    assert front["doc_metadata"]["section"] == "Heading"
    (tmp_path / "no-heading_here.md").write_text("Just text.\n")
    assert documents.read_document(tmp_path / "no-heading_here.md")[0]["title"] == "No heading here"
    # READMEs write their title as an HTML <h1>; a first heading of level 2 is a section, not the title
    (tmp_path / "charset.md").write_text('<h1 align="center">Charset <b>Detection</b> 👋</h1>\n\n'
                                          '<h2 align="center">Why</h2>\n\nTo read text.\n\n## Usage\n\nCall it.\n')
    assert [(r["title"], r["doc_metadata"].get("section")) for r in documents.read_document(tmp_path / "charset.md")] \
        == [("Charset Detection 👋", "Why"), ("Charset Detection 👋", "Usage")]
    (tmp_path / "arrays_lib.md").write_text('<h1><img src="logo.svg"></h1>\n\nArrays.\n\n## Code of Conduct\n\nBe kind.\n')
    assert {r["title"] for r in documents.read_document(tmp_path / "arrays_lib.md")} == {"Arrays lib"}


def test_the_search_tools_say_plain_sentences_about_documents_not_chunks(tmp_path):
    from tasks.tools import query_vector_db, search_documentation
    from tests.speech import markup_in

    (tmp_path / "README.md").write_text(README + "\n## Configuration\n\nThe broker reads its settings from a "
                                        "configuration file at start; send it a hang-up signal to reload them.\n")
    (tmp_path / "guide.md").write_text("# Operations guide\n\nRestart the MQTT broker after an upgrade.\n")
    documents.ingest([str(tmp_path)])
    found = documents.search("MQTT message broker settings and installation", top_k=5)
    assert len({f["id"].split("#")[0] for f in found}) == len(found) == 2  # one result per document: its best chunk
    for tool, params in ((query_vector_db, {"user_query": "MQTT message broker settings"}),
                         (search_documentation, {"query": "MQTT message broker settings"})):
        result = {"summary": documents.plain_summary(found), "documents": found, "context_key": "k"}
        said = tool.voice_response(params, result)
        assert markup_in(said) == [] and said.rstrip()[-1] in ".!?", said
    assert query_vector_db.voice_response({}, {"summary": documents.plain_summary(found), "documents": found}) \
        .startswith("I found 2 documents; the best match is ")
    # a passage's numbers and dates are read as a person says them
    sales = {"id": "s#0", "title": "Sales", "score": 0.5, "metadata": {},
             "snippet": "Sales rose 8% in the quarter to 2026-09-30, against 0.5% a year before."}
    said = search_documentation.voice_response({"query": "sales"}, {"summary": documents.plain_summary([sales]),
                                                                      "documents": [sales]})
    assert said == ("The documentation on Sales says: Sales rose 8 percent in the quarter to September 30, 2026, "
                    "against 0.5 percent a year before.")
    assert markup_in(said) == [], said

    question = "How do I get a refund for the hotel I booked for the offsite last month?"
    assert search_documentation.voice_response({"query": question}, {"summary": "", "documents": []}) == (
        "I couldn't find an answer to that in the documentation.")
    assert query_vector_db.voice_response({"user_query": question}, {"documents": []}) == (
        "I couldn't find any documents about that.")
    assert query_vector_db.voice_response({"user_query": "hotel refunds"}, {"documents": []}) == (
        "I couldn't find any documents about hotel refunds.")


def test_hybrid_search_finds_a_rare_word_the_vectors_miss_and_keeps_filters_and_top_k(tmp_path):
    from voice_tools_backends import embeddings

    for name, text_ in {
        "printer.md": "# Office printers\n\nThe printers on each floor print double-sided. When the display shows "
                      "E4471 the paper tray is empty; refill it from the cupboard.\n",
        "errors.md": "# What an error message means\n\nWhen an application shows an error, note the error code and "
                     "the message, then call the help desk, who will explain what the error means.\n",
        "api.md": "# API errors\n\nEvery API error has a code and a message; retry a 503 error later.\n",
        "log.md": "# Reading the logs\n\nAn error in the log names the component; warnings are not errors.\n",
        "kestrel.md": "# Project notes\n\nThe Kestrel migration moves the old billing database to the new cluster.\n",
    }.items():
        (tmp_path / name).write_text(text_)
    documents.ingest([str(tmp_path)])
    model, _ = embeddings.active_model()
    question = "error E4471"
    vector = embeddings.embed_query(question)
    by_vector = [f["title"] for f in documents.search_vector(vector, model, 3, floor=-1)]
    assert "Office printers" not in by_vector  # the code means nothing to the model
    fused = documents.search_vector(vector, model, 3, floor=-1, text=question)
    assert "Office printers" in [f["title"] for f in fused] and len(fused) == 3  # its words find it
    assert [f["title"] for f in documents.search_vector(vector, model, 5, floor=-1, text=question,
                                                         filters={"file": "api.md"})] == ["API errors"]
    assert [f["title"] for f in documents.search_vector(vector, model, 5, floor=-1, text=question,
                                                         filters={"file": "printer.md"})] == ["Office printers"]
    assert len(documents.search_vector(vector, model, 2, floor=-1, text=question)) == 2
    floor = documents.search_vector(vector, model, 5, floor=0.25, text=question, words_floor=2)
    assert floor and all(f["score"] >= 0.25 for f in floor)  # the words floor out of reach: the cosine decides
    assert "Office printers" not in [f["title"] for f in floor]  # its cosine is under it
    # by default a document holding most of the question's word weight is relevant: E4471 is in no other
    relevant = documents.search_vector(vector, model, 5, floor=0.25, text=question)
    printers = next(f for f in relevant if f["title"] == "Office printers")
    assert printers["score"] < 0.25  # relevant by its words alone
    assert documents.search_vector(vector, model, 5, floor=0.25, text="error E9999") == floor  # no such code


def test_a_word_only_in_code_finds_its_document_and_the_snippet_says_no_code(tmp_path):
    (tmp_path / "sizes.md").write_text("# Sizes\n\n## File sizes\n\nCall it with a number of bytes.\n\n"
                                       "```pycon\n>>> naturalsize(3000000)\n'3.0 MB'\n```\n")
    (tmp_path / "other.md").write_text("# Dates\n\n## Days\n\nCall it with a date to say the day.\n")
    documents.ingest([str(tmp_path)])
    with db.session() as s:
        stored = {r.title: (r.content, r.code) for r in s.scalars(select(DocumentChunk))}
    assert stored == {"Sizes": ("Call it with a number of bytes.", ">>> naturalsize(3000000) '3.0 MB'"),
                      "Dates": ("Call it with a date to say the day.", "")}
    found = documents.search("naturalsize", top_k=5)
    assert [f["title"] for f in found][:1] == ["Sizes"]  # by its code's word: relevant by its words alone
    assert found[0]["snippet"] == "Call it with a number of bytes."  # what is read out holds no code


PAGE = """<!doctype html><html><head><title>Backup guide</title><style>p {color: red}</style>
<script>var tracking = "https://t.example.com";</script></head>
<body><nav><a href="/">Home</a> <a href="/docs">Docs</a></nav>
<main><h1>Backup guide</h1><p>Backups run every night at <b>two</b> o'clock.</p><!-- hidden note -->
<h2>Restoring</h2><p>Open the <a href="https://example.com/restore">restore page</a> and pick a date.</p>
<pre><code>restore --date 2024-01-01</code></pre><ul><li>Files come back as they were.</li></ul></main>
<footer>Copyright and cookie notice</footer></body></html>"""


def _pdf(pages: list[list[str]], title: str = "") -> bytes:
    """A small PDF with one text line per entry (Helvetica), for pypdf to read."""
    objects = ["<< /Type /Catalog /Pages 2 0 R >>", None, "<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>"]
    kids = []
    for lines in pages:
        ops = "BT /F1 12 Tf 72 720 Td 14 TL " + " ".join(f"({line}) Tj T*" for line in lines) + " ET"
        objects.append(f"<< /Length {len(ops)} >>\nstream\n{ops}\nendstream")
        objects.append(f"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Resources << /Font << /F1 3 0 R >> >> "
                       f"/Contents {len(objects)} 0 R >>")
        kids.append(f"{len(objects)} 0 R")
    objects[1] = f"<< /Type /Pages /Kids [{' '.join(kids)}] /Count {len(kids)} >>"
    if title:
        objects.append(f"<< /Title ({title}) >>")
    out, offsets = b"%PDF-1.4\n", []
    for number, body in enumerate(objects, 1):
        offsets.append(len(out))
        out += f"{number} 0 obj\n{body}\nendobj\n".encode()
    xref = len(out)
    out += f"xref\n0 {len(objects) + 1}\n0000000000 65535 f \n".encode()
    out += "".join(f"{o:010d} 00000 n \n" for o in offsets).encode()
    info = f" /Info {len(objects)} 0 R" if title else ""
    out += f"trailer\n<< /Size {len(objects) + 1} /Root 1 0 R{info} >>\nstartxref\n{xref}\n%%EOF\n".encode()
    return out


def test_html_and_pdf_are_read_and_an_unreadable_file_is_skipped_saying_why(tmp_path, capsys):
    library = tmp_path / "library"
    library.mkdir()
    (library / "backup.html").write_text(PAGE)
    (library / "leave.pdf").write_bytes(_pdf([["Annual leave policy", "Staff get 25 days of leave a year."],
                                              ["Unused days carry over until March."]], title="Leave policy"))
    (library / "broken.pdf").write_text("not a PDF at all")
    (library / "notes.md").write_text("# Notes\n\nThe canteen opens at noon.\n")
    backup = documents.read_document(library / "backup.html")
    assert [(r["title"], r["doc_metadata"].get("section"), r["content"]) for r in backup] == [
        ("Backup guide", None, "Backups run every night at two o'clock."),
        ("Backup guide", "Restoring", "Open the restore page and pick a date.\n\nFiles come back as they were.")]
    leave = documents.read_document(library / "leave.pdf")
    assert [(r["title"], r["doc_metadata"]["section"]) for r in leave] == [("Leave policy", "Page 1"),
                                                                          ("Leave policy", "Page 2")]
    assert "25 days of leave" in leave[0]["content"] and "carry over" in leave[1]["content"]

    said: list[tuple[int, int, int]] = []
    report = documents.ingest([str(library)], progress=lambda *how_far: said.append(how_far))
    assert (report["files"], report["chunks"]) == (3, 5)
    assert said == [(4, 4, 5)]  # files done (the unreadable one too), files, chunks stored
    from voice_tools import launcher

    assert launcher.ingest([str(library)]) == 0  # the command says which file it skipped, and why
    assert f"voice-tools ingest: skipped {(library / 'broken.pdf').resolve()}: it is not a readable PDF" \
        in capsys.readouterr().err
    assert [s["file"] for s in report["skipped"]] == [str((library / "broken.pdf").resolve())]
    assert report["skipped"][0]["reason"].startswith("it is not a readable PDF")
    assert documents.search("how many vacation days do employees get", top_k=1)[0]["title"] == "Leave policy"
    assert documents.search("getting files back from a backup", top_k=1)[0]["metadata"]["section"] == "Restoring"


# -- ingest and search ---------------------------------------------------------------------------

def test_ingest_a_folder_then_search_finds_the_right_chunk_with_filters(folder):
    report = documents.ingest([str(folder)])
    assert report["files"] == 2 and report["chunks"] == 4 and report["model"] == LOCAL
    with db.session() as s:  # the statistics a search weighs its words by are fresh
        assert s.execute(text("SELECT reltuples FROM pg_class WHERE oid = 'documents'::regclass")).scalar() == 4
    assert report["seconds"] >= 0 and report["reembedded"] == 0
    handbook = str((folder / "handbook.md").resolve())
    stored = chunks()
    assert [c.id for c in stored] == [f"{handbook}#0", f"{handbook}#1", f"{handbook}#2",
                                      f"{(folder / 'it' / 'printers.txt').resolve()}#0"]
    sick = stored[1]
    assert (sick.title, sick.chunk_index, sick.document_id, sick.source) == ("People handbook", 1, handbook, handbook)
    assert sick.doc_metadata == {"team": "hr", "audience": "staff", "source": handbook, "file": "handbook.md",
                                 "section": "Sick leave"}
    assert (sick.embedding_model, sick.embedding_dim, len(sick.embedding)) == (LOCAL, 384, 384)
    assert stored[3].title == "Printers" and stored[3].doc_metadata["file"] == "printers.txt"

    found = documents.search("I feel ill and can't come to work, what should I do?", top_k=2)
    assert found[0]["id"] == f"{handbook}#1"
    assert found[0]["title"] == "People handbook" and found[0]["snippet"].startswith("If you are ill")
    assert set(found[0]) == {"id", "title", "snippet", "score", "metadata"}
    assert 0.3 <= found[0]["score"] <= 1 and found[0]["score"] == round(found[0]["score"], 4)
    assert [f["score"] for f in found] == sorted((f["score"] for f in found), reverse=True)

    printing = documents.search("how do I print in colour", top_k=3)
    assert printing[0]["id"].endswith("printers.txt#0")
    assert documents.search("how do I print in colour", filters={"team": "hr"}) == []  # its best match is IT's
    only_hr = documents.search("leasing an e-bike through the company", top_k=3, filters={"team": "hr"})
    assert only_hr[0]["metadata"]["section"] == "Bicycle scheme"
    assert all(f["metadata"]["team"] == "hr" for f in only_hr)
    assert documents.search("how do I print in colour", filters={"file": "printers.txt"})[0]["id"] == printing[0]["id"]
    assert documents.search("how do I print in colour", filters={"team": "finance"}) == []


def test_ingest_writes_one_batch_while_it_embeds_the_next(folder, monkeypatch):
    monkeypatch.setattr(documents, "WRITE_BATCH", 1)  # a batch per file
    said: list[tuple[int, int, int]] = []
    report = documents.ingest([str(folder)], progress=lambda *how_far: said.append(how_far))
    assert (report["files"], report["chunks"], len(report["skipped"])) == (2, 4, 1)
    assert said == [(1, 3, 3), (3, 3, 4)]  # files done (the unreadable PDF between them), files, chunks written
    assert len(chunks()) == 4 and {c.embedding_model for c in chunks()} == {LOCAL}


def test_reingesting_a_file_replaces_its_chunks(folder):
    documents.ingest([str(folder)])
    handbook = folder / "handbook.md"
    handbook.write_text("# People handbook\n\n## Sick leave\n\nCall the HR hotline on the first day of illness.\n")
    report = documents.ingest([str(handbook)])
    assert (report["files"], report["chunks"]) == (1, 1)
    mine = [c for c in chunks() if c.document_id == str(handbook.resolve())]
    assert [(c.id, c.content) for c in mine] == [(f"{handbook.resolve()}#0",
                                                   "Call the HR hotline on the first day of illness.")]
    assert len(chunks()) == 2  # the printers file was left alone
    found = documents.search("what do I do when I'm sick", top_k=1)
    assert found[0]["snippet"] == "Call the HR hotline on the first day of illness."
    assert "bicycle" not in json.dumps(documents.search("leasing an e-bike", top_k=5)).lower()


def test_ingest_refuses_what_it_cannot_read(folder):
    with pytest.raises(documents.DocumentStoreError, match="no such file or folder: /no/such/place"):
        documents.ingest(["/no/such/place"])
    (folder / "slides.docx").write_text("not a format we read")
    with pytest.raises(documents.DocumentStoreError, match=r"slides.docx is not a .md, .markdown, .html, .htm, "
                                                           r".pdf or .txt file"):
        documents.ingest([str(folder / "slides.docx")])
    assert chunks() == []


def test_relevance_floor(demo, monkeypatch):
    assert documents.search("recipe for a chocolate cake") == []  # nothing scores 0.3
    monkeypatch.setenv("VOICE_TOOLS_SEARCH_MIN_SCORE", "-1")
    assert len(documents.search("recipe for a chocolate cake", top_k=3)) == 3
    monkeypatch.setenv("VOICE_TOOLS_SEARCH_MIN_SCORE", "0.99")
    assert [f["id"] for f in documents.search("Q3 sales Northwest region")] == [
        "q3-sales-northwest#0", "q3-sales-southwest#0"]  # every word of it is in their text: relevant by words
    monkeypatch.setenv("VOICE_TOOLS_SEARCH_MIN_WORDS", "1.01")
    assert documents.search("Q3 sales Northwest region") == []


def test_load_demo_is_idempotent_and_records_the_model(demo):
    assert documents.load_demo() == 0
    stored = chunks()
    assert len(stored) == len(documents.DEMO_DOCUMENTS) == 10
    assert {(c.embedding_model, c.embedding_dim, c.chunk_index, c.source) for c in stored} == {(LOCAL, 384, 0, "demo")}
    assert {c.id for c in stored} >= {"q3-sales-northwest#0", "q3-sales-southwest#0", "onboarding-guide#0",
                                      "travel-policy#0"}
    assert documents.search("Q3 sales Northwest region", top_k=1)[0]["id"] == "q3-sales-northwest#0"


# -- never mix models -----------------------------------------------------------------------------

def test_a_new_model_refuses_until_reembedded(folder, openai_api):
    openai_api.answer("POST", r"/v1/embeddings$", embeddings_answer, times=None)
    with pytest.MonkeyPatch.context() as local:  # ingest with the offline model first
        local.delenv("OPENAI_API_KEY")
        documents.ingest([str(folder / "handbook.md")])
    assert {c.embedding_model for c in chunks()} == {LOCAL}

    expected = (f"the documents were embedded with {LOCAL}, this system now uses text-embedding-3-small: "
                "run `voice-tools ingest --reembed`")
    with pytest.raises(documents.ModelMismatch) as refused:
        documents.search("sick leave")
    assert str(refused.value) == expected
    with pytest.raises(documents.ModelMismatch):
        documents.ingest([str(folder / "it")])  # would mix two models in one store
    assert len(chunks()) == 3

    report = documents.ingest([str(folder / "it")], reembed=True)
    assert (report["reembedded"], report["files"], report["chunks"]) == (3, 1, 1)
    assert report["model"] == "text-embedding-3-small"
    stored = chunks()
    assert {(c.embedding_model, c.embedding_dim) for c in stored} == {("text-embedding-3-small", 384)}
    sick = next(c for c in stored if c.doc_metadata.get("section") == "Sick leave")
    assert sick.embedding == pytest.approx(fake_vector(documents.embedding_text(
        {"title": sick.title, "content": sick.content, "doc_metadata": sick.doc_metadata})), abs=1e-6)
    inputs = [i for r in openai_api.requests_to("POST", r"/v1/embeddings$") for i in r.json["input"]]
    assert inputs[0] == "sick leave"  # the refused search's question
    assert len(inputs[1:]) == 4 and any("If you are ill" in i for i in inputs[1:])
    assert documents.search("doctor's note sickness", top_k=1)[0]["metadata"]["section"] == "Sick leave"


def test_reingest_embeds_only_what_changed_and_the_command_says_how_far_it_is(folder, openai_api, capsys):
    openai_api.answer("POST", r"/v1/embeddings$", embeddings_answer, times=None)

    def sent() -> list[str]:
        return [i for r in openai_api.requests_to("POST", r"/v1/embeddings$") for i in r.json["input"]]

    assert documents.ingest([str(folder)])["chunks"] == 4 and len(sent()) == 4
    handbook = folder / "handbook.md"
    handbook.write_text(handbook.read_text().replace("If you are ill", "If you are sick"))
    assert documents.ingest([str(folder)])["chunks"] == 4
    assert len(sent()) == 5 and "If you are sick" in sent()[-1]  # the one changed chunk, not the other three
    sick = next(c for c in chunks() if c.doc_metadata.get("section") == "Sick leave")
    assert "If you are sick" in sick.content and sick.embedding == pytest.approx(fake_vector(documents.embedding_text(
        {"title": sick.title, "content": sick.content, "doc_metadata": sick.doc_metadata})), abs=1e-6)

    from voice_tools import launcher

    capsys.readouterr()
    assert launcher.ingest([str(folder)], reembed=True) == 0  # not a terminal: plain lines
    err = capsys.readouterr().err
    assert "voice-tools ingest: re-embedded 4/4 chunks\n" in err
    assert re.search(r"^voice-tools ingest: 3/3 files, 4 chunks \(\d+ chunks/s\)$", err, re.MULTILINE), err
    assert len(sent()) == 5 + 4  # --reembed embeds every chunk again; the ingest after it, none


def test_chunks_of_the_package_model_before_int8_dyn_are_refused_until_reembedded(folder):
    documents.ingest([str(folder / "handbook.md")])
    with db.session() as s:  # what an upgraded system finds: chunks embedded by the float run of the package
        s.execute(text("UPDATE documents SET embedding_model = 'all-MiniLM-L6-v2-int8'"))
    with pytest.raises(documents.ModelMismatch) as refused:
        documents.search("sick leave")
    assert str(refused.value) == (f"the documents were embedded with all-MiniLM-L6-v2-int8, this system now uses "
                                  f"{LOCAL}: run `voice-tools ingest --reembed`")
    with pytest.raises(documents.ModelMismatch):
        documents.ingest([str(folder / "it")])
    report = documents.ingest([str(folder / "it")], reembed=True)
    assert (report["reembedded"], report["chunks"], report["model"]) == (3, 1, LOCAL)
    assert {c.embedding_model for c in chunks()} == {LOCAL}
    assert documents.search("doctor's note sickness", top_k=1)[0]["metadata"]["section"] == "Sick leave"


# -- a PostgreSQL without pgvector ------------------------------------------------------------------

NO_PGVECTOR_DB = "voice_tools_nopgvector"

PROBE = textwrap.dedent("""
    import json, sys
    from voice_tools import servers
    servers.migrate()  # alembic upgrade head, as `voice-tools migrate` does
    from sqlalchemy import text
    from models import db
    from voice_tools_backends import documents
    out = {}
    with db.engine().connect() as conn:
        out["columns"] = sorted(r[0] for r in conn.execute(text(
            "SELECT column_name FROM information_schema.columns WHERE table_name = 'documents'")))
        out["head"] = conn.execute(text("SELECT version_num FROM alembic_version")).scalar()
    for name, run in (("search", lambda: documents.search("travel policy")),
                      ("ingest", lambda: documents.ingest([sys.argv[1]]))):
        try:
            run()
            out[name] = None
        except documents.VectorSupportMissing as exc:
            out[name] = str(exc)
    out["load_demo"] = documents.load_demo()
    print(json.dumps(out))
""")


@pytest.fixture
def no_pgvector_url():
    """A database of the embedded server (which HAS pgvector) made to look as if it had not: its
    ``search_path`` puts a view hiding ``vector`` from ``pg_available_extensions`` before ``pg_catalog``,
    so the migration and the store see a server without it (what the check reads is the only thing faked;
    no CREATE EXTENSION is ever run there)."""
    parts = urlsplit(os.environ["DATABASE_URL"])
    admin = psycopg2.connect(urlunsplit(parts._replace(path="/postgres")))
    admin.autocommit = True
    with admin.cursor() as cur:
        cur.execute(f'DROP DATABASE IF EXISTS "{NO_PGVECTOR_DB}" WITH (FORCE)')
        cur.execute(f'CREATE DATABASE "{NO_PGVECTOR_DB}"')
        cur.execute(f'ALTER DATABASE "{NO_PGVECTOR_DB}" SET search_path = public, shadow, pg_catalog')
    url = urlunsplit(parts._replace(path=f"/{NO_PGVECTOR_DB}"))
    target = psycopg2.connect(url)
    target.autocommit = True
    with target.cursor() as cur:
        cur.execute("CREATE SCHEMA shadow")
        cur.execute("CREATE VIEW shadow.pg_available_extensions AS "
                    "SELECT * FROM pg_catalog.pg_available_extensions WHERE name <> 'vector'")
    target.close()
    try:
        yield url
    finally:
        with admin.cursor() as cur:
            cur.execute(f'DROP DATABASE IF EXISTS "{NO_PGVECTOR_DB}" WITH (FORCE)')
        admin.close()


@pytest.mark.slow
def test_without_pgvector_migrations_pass_and_search_names_the_fix(folder, no_pgvector_url):
    probe = subprocess.run([sys.executable, "-c", PROBE, str(folder)], cwd=ROOT, capture_output=True, text=True,
                           env={**os.environ, "DATABASE_URL": no_pgvector_url}, timeout=120)
    assert probe.returncode == 0, probe.stderr
    out = json.loads(probe.stdout.strip().splitlines()[-1])
    assert out["head"] is not None and "embedding" not in out["columns"] and "embedding_model" in out["columns"]
    assert out["search"] == out["ingest"] == documents.NO_PGVECTOR
    assert out["load_demo"] == 0


@pytest.mark.slow
def test_without_pgvector_migrate_and_run_say_at_once_that_document_search_will_not_work(no_pgvector_url):
    """``voice-tools migrate``, and what ``voice-tools run`` does before its banner (``launcher.prepare``, in a
    child process), each say it in a line of their own, with the reason and the fix; nothing else
    is said that is not the run's own line."""
    said = (f"voice-tools: document search will not work: {documents.NO_PGVECTOR} (query_vector_db and "
            f"search_documentation will fail; every other tool works)")
    env = {**os.environ, "DATABASE_URL": no_pgvector_url}
    migrated = subprocess.run([sys.executable, "-m", "voice_tools", "migrate"], cwd=ROOT, capture_output=True,
                              text=True, env=env, timeout=300)
    assert migrated.returncode == 0, migrated.stderr
    assert said in migrated.stdout.splitlines(), migrated.stdout
    prepared = subprocess.run([sys.executable, "-c", "from voice_tools import launcher; import sys; "
                               "sys.exit(launcher.prepare())"], cwd=ROOT, capture_output=True, text=True, env=env,
                              timeout=300)
    assert prepared.returncode == 0, prepared.stderr
    lines = prepared.stdout.splitlines()
    assert lines[0] == said, lines
    assert all(line.startswith("voice-tools: ") for line in lines + prepared.stderr.splitlines()), prepared.stderr


@pytest.fixture
def embedding_column_dropped():
    """The documents table as a migration without pgvector leaves it (restored afterwards)."""
    with db.engine().begin() as conn:
        conn.execute(text("ALTER TABLE documents DROP COLUMN embedding"))
    yield
    with db.engine().begin() as conn:
        conn.execute(text("TRUNCATE documents"))
        conn.execute(text("ALTER TABLE documents ADD COLUMN embedding vector(384) NOT NULL"))
        conn.execute(text("CREATE INDEX ix_documents_embedding_hnsw ON documents "
                          "USING hnsw (embedding vector_cosine_ops) WITH (m = 16, ef_construction = 64)"))


def test_a_table_without_the_vector_column_fails_the_call_with_the_fix(worker, relay, embedding_column_dropped):
    call = make_call("search_documentation", {"query": "travel policy"}, callback_url=relay.url)
    actions.confirm(call.tool_call_id)
    done = wait_status(call.tool_call_id)
    assert done.status == "FAILED" and done.error_message == documents.NO_EMBEDDING_COLUMN
    assert done.voice_response == f"The documentation search for travel policy did not run: " \
                                  f"{documents.NO_EMBEDDING_COLUMN}."
    failed = relay.wait_for(call.tool_call_id, "failed")
    assert failed["step"] == "SEARCHING" and failed["voice_response"] == done.voice_response


# -- the tools end to end through a worker ------------------------------------------------------------

def test_search_documentation_end_to_end(worker, relay, demo):
    call = make_call("search_documentation", {"query": "How do I reset my password?", "top_k": 3},
                     callback_url=relay.url)
    actions.confirm(call.tool_call_id)
    completed = relay.wait_for(call.tool_call_id, "completed")
    done = wait_status(call.tool_call_id)
    assert done.status == "COMPLETED" and set(done.result) == {"summary", "documents"}
    found = done.result["documents"]
    assert found[0]["id"] == "it-password-reset#0" and len(found) <= 3
    assert done.result["summary"].startswith(f"{len(found)} document")
    assert done.voice_response.startswith("The documentation on IT help: resetting your password says: "
                                          "Reset a forgotten password at the self-service page")
    assert completed["result"] == done.result and completed["voice_response"] == done.voice_response
    assert [(d.event, d.payload["step"]) for d in deliveries(call.tool_call_id)] == [
        ("progress", "QUERYING"), ("progress", "SEARCHING"), ("completed", "COMPLETED")]
    assert done.context_key is None
    with db.session() as s:
        assert s.scalar(select(func.count()).select_from(SessionContext)) == 0


def test_search_documentation_that_finds_nothing_completes_saying_so(worker, relay, demo):
    call = make_call("search_documentation", {"query": "the weather in Paris"}, callback_url=relay.url)
    actions.confirm(call.tool_call_id)
    done = wait_status(call.tool_call_id)
    assert done.status == "COMPLETED" and done.result == {"summary": "No matching documents.", "documents": []}
    assert done.voice_response == "I couldn't find anything about the weather in Paris in the documentation."


def test_query_vector_db_with_filters_end_to_end(worker, relay, demo):
    call = make_call("query_vector_db", {"user_query": "How did sales go last quarter?", "structured_query": {
        "semantic_query": "Q3 sales report", "filters": {"region": "southwest"}, "top_k": 2}}, callback_url=relay.url)
    actions.confirm(call.tool_call_id)
    done = wait_status(call.tool_call_id)
    assert done.status == "COMPLETED"
    assert [d["id"] for d in done.result["documents"]] == ["q3-sales-southwest#0"]
    assert done.voice_response == ("I found 1 document; the best match is Q3 sales report: Southwest region. "
                                   "It is available if you want to use it in an email.")
    with db.session() as s:
        stored = s.scalars(select(SessionContext)).one()
    assert stored.context_value["documents"] == done.result["documents"]

    nothing = make_call("query_vector_db", {"user_query": "chocolate cake recipes"}, callback_url=relay.url)
    actions.confirm(nothing.tool_call_id)
    empty = wait_status(nothing.tool_call_id)
    assert empty.status == "COMPLETED" and empty.result["documents"] == []
    assert empty.voice_response == "I couldn't find any documents about chocolate cake recipes."


@pytest.mark.slow
def test_openai_429_is_retried_by_the_engine_and_the_summary_is_spoken(worker, relay, openai_api, monkeypatch):
    monkeypatch.setenv("VOICE_TOOLS_SUMMARY_MODEL", "gpt-test")
    monkeypatch.setenv("VOICE_TOOLS_SEARCH_MIN_SCORE", "0.2")  # the double's bag-of-words vectors score lower
    openai_api.answer("POST", r"/v1/embeddings$", embeddings_answer)  # the demo documents
    openai_api.answer("POST", r"/v1/embeddings$", {"error": {"message": "Rate limit reached"}}, status=429)
    openai_api.answer("POST", r"/v1/embeddings$", embeddings_answer, times=None)
    openai_api.answer("POST", r"/v1/chat/completions$", chat_answer("Northwest sales were 4.2 million dollars."))
    assert documents.load_demo() == 10
    call = make_call("query_vector_db", {"user_query": "Q3 sales in the Northwest region"}, callback_url=relay.url)
    actions.confirm(call.tool_call_id)
    done = wait_status(call.tool_call_id, timeout=30)
    assert done.status == "COMPLETED", done.error_message
    assert done.result["documents"][0]["id"] == "q3-sales-northwest#0"
    assert done.result["summary"] == "Northwest sales were 4.2 million dollars."
    assert done.voice_response == ("Northwest sales were 4.2 million dollars. "
                                   "It is available if you want to use it in an email.")
    asked = openai_api.requests_to("POST", r"/v1/embeddings$")
    assert [r.json["input"] for r in asked[1:]] == [["Q3 sales in the Northwest region"]] * 2  # 429, then again
    assert all(r.json["model"] == "text-embedding-3-small" and r.json["dimensions"] == 384 for r in asked)
    assert [e["status"] for e in done.status_history] == ["PENDING", "EXECUTING", "COMPLETED"]
    assert {c.embedding_model for c in chunks()} == {"text-embedding-3-small"}


def test_openai_401_fails_the_call_saying_the_search_did_not_run(worker, relay, openai_api):
    openai_api.answer("POST", r"/v1/embeddings$", {"error": {"message": "Incorrect API key provided"}}, status=401)
    call = make_call("query_vector_db", {"user_query": "Q3 sales"}, callback_url=relay.url)
    actions.confirm(call.tool_call_id)
    done = wait_status(call.tool_call_id)
    assert done.status == "FAILED"
    assert done.voice_response == "The search for Q3 sales did not run: the OpenAI API key was refused (HTTP 401)."
    assert relay.wait_for(call.tool_call_id, "failed")["step"] == "QUERYING"
    assert len(openai_api.requests_to("POST", r"/v1/embeddings$")) == 1  # not retried
    with db.session() as s:
        assert s.scalar(select(func.count()).select_from(SessionContext)) == 0


def test_a_search_with_another_model_fails_the_call_naming_reembed(worker, relay, demo, openai_api):
    openai_api.answer("POST", r"/v1/embeddings$", embeddings_answer, times=None)
    call = make_call("search_documentation", {"query": "travel policy"}, callback_url=relay.url)
    actions.confirm(call.tool_call_id)
    done = wait_status(call.tool_call_id)
    assert done.status == "FAILED"
    assert done.voice_response == (f"The documentation search for travel policy did not run: the documents were "
                                   f"embedded with {LOCAL}, this system now uses text-embedding-3-small: run "
                                   "`voice-tools ingest --reembed`.")
