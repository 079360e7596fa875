"""How fast the document store is: query embedding, vector search, ingest.

    .venv/bin/python bench/documents.py [--chunks 100000] [--queries 200] [--ingest-files 40]

On an embedded PostgreSQL 18 + pgvector started under a temporary folder (removed
afterwards), with the offline model (all-MiniLM-L6-v2, dynamically quantized int8, onnxruntime, CPU;
the model is prepared once before the timings):

1. a query's embedding: ``embeddings.embed_query`` of short questions, one at a time,
   as a worker does (one onnxruntime thread, ``VOICE_TOOLS_EMBEDDING_THREADS``);
2. a vector search over ``--chunks`` chunks through ``documents.search_vector`` (the
   whole backend path: model check, ``SET LOCAL hnsw.ef_search``, the HNSW query,
   rows to dicts), top 5, no floor. The chunks are bulk-loaded with binary COPY: unit
   vectors scattered around 2,000 random centres (a clustered corpus, as real
   embeddings are), then the HNSW index is built; recall@5 against an exact scan is
   reported for the same queries (vectors near stored chunks);
3. ``documents.ingest`` of a folder of generated Markdown files (sections of a few
   paragraphs, ~800-character chunks), embedded on every core, as
   ``voice-tools ingest`` does (one text per run, as many at once as threads).

Goals: embedding p50 <= 10 ms, search p50 <= 20 ms, ingest >= 200 chunks/s.
Prints a markdown table. Run by hand; not part of the test suite.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import platform
import random
import shutil
import statistics
import struct
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from voice_tools import servers

QUESTIONS = [
    "What were our Q3 sales in the Northwest region?", "How do I reset my password?",
    "How many vacation days do I get?", "What is the travel meal allowance?", "How do I connect to the VPN?",
    "What is the warranty on the VoiceHub headset?", "How long is parental leave?",
    "When do I submit expense receipts?", "What does onboarding involve for new sales staff?",
    "Can I return an unused product?",
]
WORDS = ("policy customer report quarter region sales travel expense receipt manager laptop password network "
         "printer leave holiday contract invoice budget training product warranty refund discount shipping "
         "meeting calendar approval office security account access portal team project deadline review").split()


def percentile(samples: list[float], q: float) -> float:
    return statistics.quantiles(samples, n=100, method="inclusive")[int(q) - 1] if len(samples) > 1 else samples[0]


def ms(samples: list[float]) -> tuple[float, float]:
    values = [s * 1000 for s in samples]
    return statistics.median(values), percentile(values, 95)


# -- 1. query embedding --------------------------------------------------------------------

def bench_embedding(n: int) -> tuple[float, float]:
    from voice_tools_backends import embeddings

    rng = random.Random(1)
    embeddings.embed_query("warm up")
    samples = []
    for i in range(n):
        question = QUESTIONS[i % len(QUESTIONS)] + " " + " ".join(rng.sample(WORDS, 2))
        started = time.perf_counter()
        embeddings.embed_query(question)
        samples.append(time.perf_counter() - started)
    return ms(samples)


# -- 2. vector search over many chunks -------------------------------------------------------

def _field(data: bytes) -> bytes:
    return struct.pack("!i", len(data)) + data


def copy_chunks(conn, vectors: np.ndarray, model: str) -> None:
    """Binary COPY of ``vectors`` as chunks (pgvector's binary format: dim, unused, float4s)."""
    out = io.BytesIO()
    out.write(b"PGCOPY\n\xff\r\n\x00" + struct.pack("!ii", 0, 0))
    header = struct.pack("!hh", vectors.shape[1], 0)
    big_endian = vectors.astype(">f4")
    metadata = [b"\x01" + json.dumps({"source": "bench", "shard": shard}).encode() for shard in range(100)]
    model_name = model.encode()
    for i in range(len(vectors)):
        doc = f"bench-{i // 4}".encode()
        out.write(struct.pack("!h", 10))
        out.write(_field(doc + b"#" + str(i % 4).encode()) + _field(doc) + _field(b"bench")
                  + _field(f"Bench document {i // 4}".encode()) + _field(struct.pack("!i", i % 4))
                  + _field(f"Generated chunk {i}.".encode()) + _field(metadata[i % 100])
                  + _field(header + big_endian[i].tobytes()) + _field(model_name) + _field(struct.pack("!i", 384)))
    out.write(struct.pack("!h", -1))
    out.seek(0)
    with conn.cursor() as cur:
        cur.copy_expert("COPY documents (id, document_id, source, title, chunk_index, content, metadata, embedding, "
                        "embedding_model, embedding_dim) FROM STDIN WITH (FORMAT binary)", out)


def clustered(n: int, rng: np.random.Generator, centres: np.ndarray, spread: float = 0.35) -> np.ndarray:
    picks = centres[rng.integers(0, len(centres), n)]
    vectors = picks + rng.normal(0, spread / np.sqrt(centres.shape[1]), (n, centres.shape[1])).astype(np.float32)
    return (vectors / np.linalg.norm(vectors, axis=1, keepdims=True)).astype(np.float32)


def bench_search(n_chunks: int, n_queries: int) -> dict[str, float]:
    import psycopg2

    from models import db
    from voice_tools_backends import documents, embeddings

    model, dim = embeddings.active_model()
    rng = np.random.default_rng(7)
    centres = rng.normal(0, 1, (2000, dim)).astype(np.float32)
    centres /= np.linalg.norm(centres, axis=1, keepdims=True)
    vectors = clustered(n_chunks, rng, centres)
    conn = psycopg2.connect(os.environ["DATABASE_URL"])
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute("DROP INDEX IF EXISTS ix_documents_embedding_hnsw")
    started = time.perf_counter()
    with conn:
        copy_chunks(conn, vectors, model)
    load_s = time.perf_counter() - started
    with conn.cursor() as cur:
        cur.execute("SET maintenance_work_mem = '1GB'")
        started = time.perf_counter()
        cur.execute("CREATE INDEX ix_documents_embedding_hnsw ON documents "
                    "USING hnsw (embedding vector_cosine_ops) WITH (m = 16, ef_construction = 64)")
        index_s = time.perf_counter() - started
        cur.execute("ANALYZE documents")
    queries = clustered(n_queries, rng, vectors[rng.integers(0, n_chunks, n_queries)], spread=0.5)
    for q in queries[:10]:  # warm the pool and the index pages
        documents.search_vector(q, model, 5, floor=-1)
    samples, found = [], []
    for q in queries:
        started = time.perf_counter()
        found.append([d["id"] for d in documents.search_vector(q, model, 5, floor=-1)])
        samples.append(time.perf_counter() - started)
    filtered, filtered_counts = [], []
    for q in queries[:50]:
        started = time.perf_counter()
        hits = documents.search_vector(q, model, 5, filters={"shard": 7}, floor=-1)
        filtered.append(time.perf_counter() - started)
        filtered_counts.append(len(hits))
    # the index's recall: the HNSW scan the search runs (its candidates, its ef_search) against an exact
    # scan; the search's own order fuses more than the nearest chunks, so it is not compared here
    candidates = max(documents.MIN_CANDIDATES, 5 * documents.CANDIDATES_PER_RESULT)
    recall = []
    with conn.cursor() as cur:
        cur.execute(f"SET hnsw.ef_search = {max(40, min(1000, candidates * 2))}")
        by_index = []
        for q in queries[:50]:
            cur.execute("SELECT id FROM documents ORDER BY embedding <=> %s::vector LIMIT %s",
                        ("[" + ",".join(f"{x:.7f}" for x in q) + "]", candidates))
            by_index.append([r[0] for r in cur.fetchall()])
        cur.execute("SET enable_indexscan = off")
        for q, got in zip(queries[:50], by_index):
            cur.execute("SELECT id FROM documents ORDER BY embedding <=> %s::vector LIMIT %s",
                        ("[" + ",".join(f"{x:.7f}" for x in q) + "]", candidates))
            exact = {r[0] for r in cur.fetchall()}
            recall.append(len(exact & set(got)) / len(exact))
        cur.execute("EXPLAIN SELECT embedding_model FROM documents WHERE embedding_model < %(m)s OR "
                    "embedding_model > %(m)s LIMIT 1", {"m": model})
        model_check_plan = " ".join(r[0].strip() for r in cur.fetchall()[:3])
    conn.close()
    db.dispose()
    p50, p95 = ms(samples)
    f50, f95 = ms(filtered)
    return {"load_s": load_s, "index_s": index_s, "p50": p50, "p95": p95, "filtered_p50": f50,
            "filtered_p95": f95, "filtered_found": statistics.mean(filtered_counts), "recall": statistics.mean(recall),
            "model_check_plan": model_check_plan}


# -- 3. ingest -------------------------------------------------------------------------------

def write_corpus(folder: Path, files: int) -> None:
    rng = random.Random(3)

    def sentence() -> str:
        words = rng.sample(WORDS, rng.randint(8, 16))
        return words[0].capitalize() + " " + " ".join(words[1:]) + "."

    for f in range(files):
        parts = [f"# Handbook page {f}\n"]
        for section in range(10):
            parts.append(f"## Section {section}: {rng.choice(WORDS)} {rng.choice(WORDS)}\n")
            for _ in range(2):
                parts.append(" ".join(sentence() for _ in range(4)) + "\n")
        (folder / f"page-{f:03d}.md").write_text("\n".join(parts))


def bench_ingest(folder: Path, files: int) -> dict[str, float]:
    from voice_tools_backends import documents

    from voice_tools_backends import embeddings

    write_corpus(folder, files)
    embeddings.embed(["warm up"], bulk=True)  # the ingest session is made once per process
    report = documents.ingest([str(folder)])
    chunk_chars = statistics.mean(len(c) for f in folder.glob("*.md")
                                  for _, c, _ in documents.chunk_text(f.read_text()))
    return {"files": report["files"], "chunks": report["chunks"], "seconds": report["seconds"],
            "rate": report["chunks"] / report["seconds"], "chunk_chars": chunk_chars}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunks", type=int, default=100_000, help="chunks in the searched table (default 100000)")
    parser.add_argument("--queries", type=int, default=200, help="timed queries (default 200)")
    parser.add_argument("--ingest-files", type=int, default=40, help="generated Markdown files to ingest (default 40)")
    args = parser.parse_args(argv)
    os.environ.pop("OPENAI_API_KEY", None)  # the offline model
    data_dir = Path(tempfile.mkdtemp(prefix="voice-tools-bench-documents-"))
    try:
        os.environ["DATABASE_URL"] = servers.start_postgres(data_dir, "bench")
        servers.migrate()
        print("embedding ...", flush=True)
        e50, e95 = bench_embedding(args.queries)
        print("ingest ...", flush=True)
        (data_dir / "corpus").mkdir()
        ingest = bench_ingest(data_dir / "corpus", args.ingest_files)
        print(f"search over {args.chunks} chunks (load + HNSW build first) ...", flush=True)
        search = bench_search(args.chunks, args.queries)
        from voice_tools_backends import documents, embeddings

        threads = os.environ.get("VOICE_TOOLS_EMBEDDING_THREADS", "1")
        lines = [
            "# voice-tools document store benchmark",
            "",
            f"- machine: {platform.processor() or platform.machine()}, {os.cpu_count()} logical CPUs; "
            f"{platform.platform()}; Python {platform.python_version()}; load average "
            f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}",
            f"- model: {embeddings.LOCAL_MODEL} (onnxruntime, CPU); query embedding on {threads} thread(s), "
            f"ingest on {os.environ.get('VOICE_TOOLS_INGEST_THREADS') or os.cpu_count()}",
            f"- search: {args.chunks:,} chunks, HNSW m=16 ef_construction=64 (COPY {search['load_s']:.1f} s, "
            f"index build {search['index_s']:.1f} s), top 5 documents, the HNSW scan of "
            f"{max(documents.MIN_CANDIDATES, 5 * documents.CANDIDATES_PER_RESULT)} chunks (ef_search "
            f"{max(40, min(1000, 2 * max(documents.MIN_CANDIDATES, 5 * documents.CANDIDATES_PER_RESULT)))}; an "
            "iterative scan with a filter)",
            "",
            "| measurement | p50 | p95 | goal |",
            "|---|---|---|---|",
            f"| query embedding ({args.queries} short questions) | {e50:.2f} ms | {e95:.2f} ms | p50 <= 10 ms |",
            f"| vector search, {args.chunks:,} chunks ({args.queries} queries) | {search['p50']:.2f} ms | "
            f"{search['p95']:.2f} ms | p50 <= 20 ms |",
            f"| vector search with a filter matching 1% of chunks (50 queries; {search['filtered_found']:.1f} of 5 "
            f"found on average) | {search['filtered_p50']:.2f} ms | {search['filtered_p95']:.2f} ms | |",
            f"| ingest: {ingest['files']} files, {ingest['chunks']} chunks of ~{ingest['chunk_chars']:.0f} chars | "
            f"{ingest['rate']:.1f} chunks/s | ({ingest['seconds']:.1f} s) | >= 200 chunks/s |",
            "",
            f"HNSW recall of the search's candidate chunks against an exact scan (50 queries): {search['recall']:.2f}. "
            f"Model check plan: `{search['model_check_plan']}`.",
        ]
        print("\n".join(lines))
        return 0
    finally:
        servers.stop_servers()
        shutil.rmtree(data_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
