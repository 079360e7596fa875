"""How fast ``voice-tools ingest`` stores real documents: chunks per second, against the model's own rate.

    .venv/bin/python -m bench.ingest [--folder /usr/share/doc] [--chunks 1500]

The corpus: the ``.md``, ``.html`` and ``.pdf`` files under ``--folder`` (default
``/usr/share/doc``: the Debian packages' own manuals, READMEs and PDFs on this machine;
any folder of real documents will do), taken in path order until they make ``--chunks``
chunks, copied into a temporary folder. On an embedded PostgreSQL 18 + pgvector under a
temporary folder, with the offline model (prepared before the timings):

1. the model alone: ``embeddings.embed(bulk=True)`` of the corpus's chunk texts, no
   database: the most an ingest could do here, now;
2. ``documents.ingest`` of the folder (read, chunk, embed, write): chunks/s;
3. ``documents.ingest`` of the same folder again, unchanged (the stored vectors are kept);
4. ``documents.ingest([], reembed=True)``: every stored chunk embedded again and written.

Each figure is of one run on a machine that may be shared: compare figures of one run (the
load average is printed), or the chunks per CPU second (this process and the bench's
PostgreSQL), which other processes' load does not change. Goal: ingest >= 200 chunks/s. Prints a markdown table; run by hand.
"""
from __future__ import annotations

import argparse
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from voice_tools import servers  # noqa: E402

DOCUMENTS = (".md", ".markdown", ".html", ".htm", ".pdf")


def pick_corpus(folders: list[str], chunks: int, into: Path) -> tuple[int, list[str]]:
    """Copy the first documents under ``folders`` (path order) that make ``chunks`` chunks into ``into``;
    the chunks they make and their embedding texts."""
    from voice_tools_backends import documents, reading

    texts: list[str] = []
    files = 0
    for folder in folders:
        for path in sorted(Path(folder).rglob("*")):
            if len(texts) >= chunks:
                break
            if not path.is_file() or path.suffix.lower() not in DOCUMENTS:
                continue
            try:
                rows = documents.read_document(path)
            except reading.Unreadable:
                continue
            target = into / path.relative_to(folder)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, target)
            texts += [documents.embedding_text(row) for row in rows]
            files += 1
    return files, texts


def cpu_seconds(data_dir: str) -> float:
    """User + system CPU seconds of this process and of the PostgreSQL processes serving ``data_dir``."""
    import psutil

    total = sum(psutil.Process().cpu_times()[:2])
    for process in psutil.process_iter(["name", "cmdline"]):
        try:
            if process.info["name"] == "postgres" and data_dir in " ".join(process.info["cmdline"] or []):
                # its own, its ended backends' (reaped: children_user/system) and its live backends'
                total += sum(process.cpu_times()[:4]) + sum(sum(c.cpu_times()[:2]) for c in process.children(recursive=True))
        except psutil.Error:
            continue
    return total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--folder", action="append", help="a folder of documents (default /usr/share/doc)")
    parser.add_argument("--chunks", type=int, default=1500, help="about how many chunks to ingest (default 1500)")
    args = parser.parse_args(argv)
    os.environ.pop("OPENAI_API_KEY", None)  # the offline model
    data_dir = Path(tempfile.mkdtemp(prefix="voice-tools-bench-ingest-"))
    try:
        os.environ["DATABASE_URL"] = servers.start_postgres(data_dir, "bench")
        servers.migrate()
        from voice_tools_backends import documents, embeddings

        embeddings.prepare()
        corpus = data_dir / "corpus"
        corpus.mkdir()
        files, texts = pick_corpus(args.folder or ["/usr/share/doc"], args.chunks, corpus)
        load_before = os.getloadavg()
        embeddings.embed(["warm up"], bulk=True)
        database = str(data_dir)
        cpu = []  # CPU seconds (this process and the bench's PostgreSQL) of each step: the load does not change them
        started, spent = time.perf_counter(), cpu_seconds(database)
        embeddings.embed(texts, bulk=True)
        model_s = time.perf_counter() - started
        cpu.append(cpu_seconds(database) - spent)
        steps = []
        for paths, reembed in (([str(corpus)], False), ([str(corpus)], False), ([], True)):
            spent = cpu_seconds(database)
            steps.append(documents.ingest(paths, reembed=reembed))
            cpu.append(cpu_seconds(database) - spent)
        first, again, reembedded = steps
        load_after = os.getloadavg()
        rate = lambda chunks, seconds: f"{chunks / seconds:.0f}"  # noqa: E731
        lines = [
            "# voice-tools ingest benchmark",
            "",
            f"- machine: {platform.processor() or platform.machine()}, {os.cpu_count()} logical CPUs; Python "
            f"{platform.python_version()}; model {embeddings.LOCAL_MODEL}; ingest threads "
            f"{os.environ.get('VOICE_TOOLS_INGEST_THREADS') or os.cpu_count()}",
            f"- load average {load_before[0]:.1f} before, {load_after[0]:.1f} after (1 min)",
            f"- corpus: {files} files ({', '.join(DOCUMENTS)}) from {', '.join(args.folder or ['/usr/share/doc'])}: "
            f"{len(texts)} chunks of {sum(map(len, texts)) / max(1, len(texts)):.0f} characters on average",
            "",
            "| what | chunks | seconds | chunks/s | CPU seconds | chunks per CPU second |",
            "|---|---|---|---|---|---|",
            *(f"| {what} | {n} | {seconds:.1f} | {rate(n, seconds)} | {used:.1f} | {rate(n, used)} |"
              for what, n, seconds, used in (
                  ("the model alone (no database)", len(texts), model_s, cpu[0]),
                  ("ingest", first["chunks"], first["seconds"], cpu[1]),
                  ("ingest again, unchanged", again["chunks"], again["seconds"], cpu[2]),
                  ("--reembed", reembedded["reembedded"], reembedded["seconds"], cpu[3]))),
            "",
            "CPU seconds: this process's (every thread) and the bench's PostgreSQL's, user + system. On an",
            f"idle machine the wall rate approaches {os.cpu_count()} x the rate per CPU second.",
            "",
            "Goal: ingest >= 200 chunks/s.",
        ]
        print("\n".join(lines))
        return 0
    finally:
        servers.stop_servers()
        shutil.rmtree(data_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
