"""How well the document search answers: top-1, top-5 and the off-topic refusal rate on real text.

    .venv/bin/python -m bench.search

The evaluation set: the long descriptions (their README, Markdown or reStructuredText) of
30 Python packages installed from requirements-dev.lock, read from each package's installed
metadata, so the corpus is real public text with its badges, HTML and code, the same on
every machine that installs the lock. Questions worded the way a user asks ("how do I show a
progress bar while a loop runs?"), not copied from the text, each with the package whose
description should come first, in two splits:

- tuning (``QUESTIONS``, 60: two per package): the ranking was tuned on these;
- held-out (``HELD_OUT_QUESTIONS``, 30: one per package): written before any tuning, never
  tuned on;

and questions about nothing in the corpus, which should be refused: calibration
(``OFF_TOPIC``, 24) and held-out (``HELD_OUT_OFF_TOPIC``, 16).

On an embedded PostgreSQL 18 + pgvector under a temporary folder, with the offline model:
the descriptions are ingested as ``voice-tools ingest`` does, every question is ranked as
the tools rank (``documents.rank_documents``: hybrid, grouped by document) and, for
comparison, without its words. The relevance decision's two floors are derived from the
tuning questions and the calibration off-topic ones (:func:`calibrate`) and compared with
the shipped ones (``documents.DEFAULT_MIN_SCORE`` / ``DEFAULT_MIN_WORDS``); every split is
measured with the shipped floors. Prints a markdown table.
Goals: top-1 >= 90 %, top-5 >= 97 %, off-topic refused >= 95 %. Run by hand.
"""
from __future__ import annotations

import os
import platform
import shutil
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from voice_tools import servers  # noqa: E402

# (question, the package whose description answers it)
QUESTIONS = [
    ("How can I print a list of rows as a neatly aligned plain-text table?", "tabulate"),
    ("Turn a file size in bytes into something readable like 3.2 MB", "humanize"),
    ("Convert a web address with accented or non-Latin letters to its ASCII form", "idna"),
    ("Guess which character encoding an unknown text file uses", "charset-normalizer"),
    ("Store embeddings in Postgres and find the nearest neighbours", "pgvector"),
    ("Talk to a Redis key-value server from Python", "redis"),
    ("Colourful text, tables and progress bars in the terminal", "rich"),
    ("Split, merge or crop the pages of a PDF file", "pypdf"),
    ("Call GPT models from a Python program", "openai"),
    ("Parse CommonMark text into tokens and render HTML", "markdown-it-py"),
    ("Fast multi-dimensional arrays for numerical computing", "numpy"),
    ("Exchange machine learning models between frameworks in an open format", "onnx"),
    ("Which server runs an ASGI application?", "uvicorn"),
    ("Where should my app keep its config and cache folders on each operating system?", "platformdirs"),
    ("Use the operating system's own certificate store to verify TLS connections", "truststore"),
    ("One interface for local files, S3 and other remote storage", "fsspec"),
    ("Write classes without the boilerplate of dunder methods", "attrs"),
    ("Push server-sent events to a browser from an async web app", "sse-starlette"),
    ("Validate data against Python type hints", "pydantic"),
    ("Generate many random test inputs automatically to find edge cases", "hypothesis"),
    ("How do I show a progress bar while a loop runs?", "tqdm"),
    ("Find out how much CPU and memory each running process uses", "psutil"),
    ("Work with world time zones and daylight saving in Python", "pytz"),
    ("Parse dates written in many formats and add relative month offsets", "python-dateutil"),
    ("Change the database schema step by step as the models evolve", "alembic"),
    ("Run background jobs on a distributed task queue", "celery"),
    ("Turn objects into JSON-friendly dicts and back, with validation", "marshmallow"),
    ("Limit how many requests a client may make per minute", "limits"),
    ("Check a JSON document against a schema", "jsonschema"),
    ("How wide does a Unicode string appear in a terminal?", "wcwidth"),
    # a second question per package, on another of its uses (added with the second round of tuning)
    ("Format my data as a LaTeX or HTML table", "tabulate"),
    ("Write big numbers with thousands separators or as words like 1.2 million", "humanize"),
    ("Encode a hostname with umlauts before a DNS lookup", "idna"),
    ("My text file shows garbled characters: find out its real encoding", "charset-normalizer"),
    ("Add an approximate nearest neighbour index to a Postgres column", "pgvector"),
    ("Send several commands to the key-value server in one round trip", "redis"),
    ("Show Markdown and syntax-highlighted code in the console", "rich"),
    ("Protect a PDF document with a password", "pypdf"),
    ("Stream a chat completion back token by token", "openai"),
    ("Which Markdown parser is fast, follows the spec and takes syntax extensions?", "markdown-it-py"),
    ("Call C or Fortran code on large arrays of numbers", "numpy"),
    ("An open standard for representing deep learning models", "onnx"),
    ("Run a FastAPI app with auto-reload while developing", "uvicorn"),
    ("Which folder should my application write its log files to on each OS?", "platformdirs"),
    ("Stop using a bundled list of CA certificates and trust what the OS trusts", "truststore"),
    ("Treat a zip archive or an HTTP server like a filesystem", "fsspec"),
    ("Make a class immutable and comparable with a decorator", "attrs"),
    ("Implement the EventSource protocol on the server side", "sse-starlette"),
    ("Get a JSON Schema from a data model defined with type annotations", "pydantic"),
    ("A library for property-based testing in Python", "hypothesis"),
    ("Wrap any iterable to display a smart progress meter", "tqdm"),
    ("Read disk usage, sensor temperatures and battery status", "psutil"),
    ("Attach a region's time zone to a naive datetime", "pytz"),
    ("The difference between two dates in years, months and days", "python-dateutil"),
    ("Roll the database back to an earlier schema version", "alembic"),
    ("Retry a task later on workers, with RabbitMQ or Redis in between", "celery"),
    ("Validate nested objects and serialize them to JSON with schemas", "marshmallow"),
    ("Allow 10 requests per second per user, counted in memcached", "limits"),
    ("Validate a configuration file against a draft 2020-12 schema", "jsonschema"),
    ("Line up text that contains emoji in a fixed-width terminal", "wcwidth"),
]
# written before the search was tuned, never looked at while tuning it: the held-out split
HELD_OUT_QUESTIONS = [
    ("Render a grid of data with column headers as text for a report", "tabulate"),
    ("Say how long ago something happened, like three minutes ago", "humanize"),
    ("Handle domain names written in Arabic or Chinese characters", "idna"),
    ("Work out how the raw bytes of a document are encoded", "charset-normalizer"),
    ("Similarity search over vectors inside my SQL database", "pgvector"),
    ("Cache values in an in-memory data store with an expiry", "redis"),
    ("Pretty-print Python objects and tracebacks with syntax colours", "rich"),
    ("Extract the text from each page of a PDF", "pypdf"),
    ("Generate text with a large language model through an API", "openai"),
    ("Render Markdown as HTML with plugins", "markdown-it-py"),
    ("Linear algebra and random numbers for scientific Python", "numpy"),
    ("Save a trained neural network so another framework can run it", "onnx"),
    ("Serve my async Python web application in production", "uvicorn"),
    ("Where should a program store its user data files on Windows, macOS and Linux?", "platformdirs"),
    ("Verify HTTPS certificates with the system trust store instead of a bundled one", "truststore"),
    ("Read files from cloud buckets as if they were on my disk", "fsspec"),
    ("Declare data classes with validators and converters on their fields", "attrs"),
    ("Stream live updates from a Starlette endpoint to the browser", "sse-starlette"),
    ("Parse settings and request bodies into typed models with errors for bad fields", "pydantic"),
    ("Write tests that check a property holds for all inputs and shrink the failing example", "hypothesis"),
    ("Estimate the time left in a long-running loop", "tqdm"),
    ("List the running processes and their network connections", "psutil"),
    ("Convert a timestamp between Olson time zones correctly", "pytz"),
    ("Compute recurring dates like every second Tuesday of the month", "python-dateutil"),
    ("Generate database migration scripts from SQLAlchemy models", "alembic"),
    ("Run periodic jobs on workers fed by a message broker", "celery"),
    ("Deserialize request payloads into application objects", "marshmallow"),
    ("Rate limiting with fixed or moving windows kept in Redis or in memory", "limits"),
    ("Report every validation error in a JSON instance", "jsonschema"),
    ("How many columns does a character take when printed, for East Asian wide characters?", "wcwidth"),
]
OFF_TOPIC = [
    "How do I get a refund for my hotel booking?",
    "What is a good recipe for banana bread?",
    "Who won the football world cup in 2018?",
    "How many weeks of parental leave do I get?",
    "When should I plant tomatoes in the garden?",
    "How do I fix a flat bicycle tyre?",
    "What are the symptoms of the flu?",
    "How much is a train ticket from London to Paris?",
    "How long should I boil an egg for a soft yolk?",
    "What is the capital of Australia?",
    "How do I renew my passport?",
    "Which vaccines does a puppy need?",
    "What time does the pharmacy close on Sundays?",
    "How do I remove a red wine stain from a carpet?",
    "What is the best way to learn to swim as an adult?",
    "How much tax do I pay on a second home?",
    # added with the second round of tuning
    "How do I descale a coffee machine?",
    "What is the visa fee for a trip to India?",
    "Which houseplants are safe for cats?",
    "How do I cancel my gym membership?",
    "What are the opening hours of the town hall?",
    "How long does it take to walk a marathon?",
    "How do I make sourdough starter?",
    "When do the school summer holidays start?",
]
HELD_OUT_OFF_TOPIC = [
    "When is the next full moon?",
    "How do I apply for a mortgage?",
    "What should I pack for a hiking trip in the Alps?",
    "How do I change the oil in my car?",
    "Who painted the Mona Lisa?",
    "How can I improve my sleep?",
    "What is the dress code for the company party?",
    "How many calories are in an avocado?",
    "How do I book a table at an Italian restaurant nearby?",
    "What are the rules of cricket?",
    "How do I care for an orchid?",
    "Can I bring my dog to the office?",
    "How do I claim travel insurance after a cancelled flight?",
    "What is the speed limit on motorways in France?",
    "How do I knit a scarf?",
    "What causes thunderstorms?",
]


def write_corpus(folder: Path) -> dict[str, Path]:
    """Each package's long description as ``<name>.md`` (Markdown) or ``<name>.txt`` (reStructuredText)."""
    files = {}
    for name in sorted({package for _, package in QUESTIONS}):
        meta = metadata.metadata(name)
        body = meta.get_payload() or meta.get("Description") or ""
        markdown = "markdown" in (meta.get("Description-Content-Type") or "")
        path = folder / f"{name}.{'md' if markdown else 'txt'}"
        path.write_text(body if markdown else f"{name}\n\n{body}")
        files[name] = path.resolve()
    return files


def evidence(question: str, hybrid: bool = True) -> list[dict]:
    """The ranked candidate documents for ``question`` with their evidence, as the tools' search ranks them."""
    from voice_tools_backends import documents, embeddings

    model, _ = embeddings.active_model()
    return documents.rank_documents(embeddings.embed_query(question), model, 5,
                                    text=question if hybrid else None)


def collect(files: dict[str, Path], hybrid: bool) -> dict[str, list]:
    """Per split: for an on-topic question (the ranked sources, the wanted document's evidence or None),
    for an off-topic one its candidates' evidence."""
    out: dict[str, list] = {}
    for split, questions in (("tuning", QUESTIONS), ("held-out", HELD_OUT_QUESTIONS)):
        rows = []
        for question, package in questions:
            ranked = evidence(question, hybrid)
            wanted = next((d for d in ranked if d["document_id"] == str(files[package])), None)
            rows.append((question, package, [d["document_id"] for d in ranked], ranked, wanted))
        out[split] = rows
    for split, questions in (("calibration", OFF_TOPIC), ("held-out off-topic", HELD_OUT_OFF_TOPIC)):
        out[split] = [(question, evidence(question, hybrid)) for question in questions]
    return out


def calibrate(on_topic: list, off_topic: list) -> tuple[float, float]:
    """The two floors of the relevance decision from a calibration split:

    - words: the least multiple of 0.05 at least 0.1 above the largest share of a question's word
      weight that any candidate document of an off-topic question holds (words alone never make an
      off-topic answer);
    - cosine: of the floors 0.000, 0.005, ... 0.600, those that keep the most wanted documents plus
      refuse the most off-topic questions (each as a share of its split), and of them the middle one.
    """
    import math

    from voice_tools_backends import documents

    most_off = max((d["words"] for _, ranked in off_topic for d in ranked), default=0.0)
    words = min(1.0, math.ceil((most_off + 0.1) * 20 - 1e-9) / 20)
    scores = []
    for step in range(121):
        floor = step * 0.005
        kept = sum(w is not None and documents.relevant(w, floor, words) for *_, w in on_topic) / len(on_topic)
        refused = sum(not any(documents.relevant(d, floor, words) for d in ranked)
                      for _, ranked in off_topic) / len(off_topic)
        scores.append((kept + refused, floor))
    best = max(score for score, _ in scores)
    tied = [floor for score, floor in scores if score == best]
    return round(tied[len(tied) // 2], 3), words


def measure(on_topic: list, off_topic: list, floor: float, words: float) -> dict[str, float]:
    """top-1 / top-5 of the ranking (where the wanted document comes, floors aside); the wanted
    document kept by the relevance decision, and said first (the floors applied); off-topic refused."""
    from voice_tools_backends import documents

    top1 = top5 = kept = first = 0
    misses = []
    for question, package, ranking, ranked, wanted in on_topic:
        hit1 = wanted is not None and ranking[:1] == [wanted["document_id"]]
        top1 += hit1
        top5 += wanted is not None and wanted["document_id"] in ranking[:5]
        kept += wanted is not None and documents.relevant(wanted, floor, words)
        said = [d["document_id"] for d in ranked if documents.relevant(d, floor, words)]
        first += wanted is not None and said[:1] == [wanted["document_id"]]
        if not hit1:
            misses.append(f"{question!r} (wanted {package}; ranked {[Path(s).stem for s in ranking[:3]]})")
    refused = sum(not any(documents.relevant(d, floor, words) for d in ranked) for _, ranked in off_topic)
    return {"top1": top1 / len(on_topic), "top5": top5 / len(on_topic), "kept": kept / len(on_topic),
            "first": first / len(on_topic),
            "refused": refused / len(off_topic), "misses": misses,
            "best_off_topic": max(max((d["cosine"] for d in ranked), default=-1.0) for _, ranked in off_topic),
            "worst_on_topic": min(w["cosine"] if w else -1.0 for *_, w in on_topic)}


def main(argv: list[str] | None = None) -> int:
    os.environ.pop("OPENAI_API_KEY", None)  # the offline model
    data_dir = Path(tempfile.mkdtemp(prefix="voice-tools-bench-search-"))
    try:
        os.environ["DATABASE_URL"] = servers.start_postgres(data_dir, "bench")
        servers.migrate()
        from voice_tools_backends import documents, embeddings

        embeddings.prepare()
        (data_dir / "corpus").mkdir()
        files = write_corpus(data_dir / "corpus")
        started = time.perf_counter()
        report = documents.ingest([str(data_dir / "corpus")])
        ingest_s = time.perf_counter() - started
        results = {"hybrid (the tools')": collect(files, hybrid=True), "vector only": collect(files, hybrid=False)}
        hybrid = results["hybrid (the tools')"]
        floor, words = calibrate(hybrid["tuning"], hybrid["calibration"])
        shipped = (documents.DEFAULT_MIN_SCORE, documents.DEFAULT_MIN_WORDS)
        pct = lambda x: f"{100 * x:.0f} %"  # noqa: E731
        lines = [
            "# voice-tools search quality benchmark",
            "",
            f"- machine: {platform.processor() or platform.machine()}, {os.cpu_count()} logical CPUs; "
            f"Python {platform.python_version()}; model {embeddings.LOCAL_MODEL}",
            f"- corpus: the descriptions of {report['files']} installed packages, {report['chunks']} chunks "
            f"(ingested in {ingest_s:.1f} s, {report['chunks'] / ingest_s:.0f} chunks/s)",
            f"- questions: tuning {len(QUESTIONS)}, held-out {len(HELD_OUT_QUESTIONS)}; off-topic: calibration "
            f"{len(OFF_TOPIC)}, held-out {len(HELD_OUT_OFF_TOPIC)}",
            f"- relevance floors derived on the calibration split (tuning questions + calibration off-topic): "
            f"cosine {floor}, words {words}; shipped (voice_tools_backends/documents.py): cosine {shipped[0]}, words {shipped[1]}"
            + ("" if (floor, words) == shipped else "  ** DIFFERENT: update DEFAULT_MIN_SCORE / DEFAULT_MIN_WORDS **"),
            "",
            "With the shipped floors:",
            "",
            "| search | questions | top-1 | top-5 | wanted kept | said first | off-topic | off-topic refused | "
            "best off-topic cosine | worst wanted cosine |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        misses = []
        for name, collected in results.items():
            for split, off in (("tuning", "calibration"), ("held-out", "held-out off-topic")):
                r = measure(collected[split], collected[off], *shipped)
                lines.append(f"| {name} | {split} | {pct(r['top1'])} | {pct(r['top5'])} | {pct(r['kept'])} | "
                             f"{pct(r['first'])} | {off} | "
                             f"{pct(r['refused'])} | {r['best_off_topic']:.3f} | {r['worst_on_topic']:.3f} |")
                if name.startswith("hybrid"):
                    misses += [f"- {split}: {m}" for m in r["misses"]]
        everything = measure(hybrid["tuning"] + hybrid["held-out"], hybrid["calibration"] + hybrid["held-out off-topic"],
                             *shipped)
        lines += [f"| hybrid (the tools') | all {len(QUESTIONS) + len(HELD_OUT_QUESTIONS)} | {pct(everything['top1'])} | "
                  f"{pct(everything['top5'])} | {pct(everything['kept'])} | {pct(everything['first'])} | "
                  f"all {len(OFF_TOPIC) + len(HELD_OUT_OFF_TOPIC)} | "
                  f"{pct(everything['refused'])} | {everything['best_off_topic']:.3f} | "
                  f"{everything['worst_on_topic']:.3f} |", "", "Top-1 misses (hybrid):", "", *misses, "",
                  "Goals: top-1 >= 90 %, top-5 >= 97 %, off-topic refused >= 95 %."]
        print("\n".join(lines))
        return 0
    finally:
        servers.stop_servers()
        shutil.rmtree(data_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
