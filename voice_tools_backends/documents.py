"""The document store searched by query_vector_db and search_documentation.

Documents are read as plain text in sections (``voice_tools_backends/reading.py``: Markdown parsed,
HTML's main text, PDF pages; no markup, URLs or code), then cut into chunks (a new one
at every section, paragraphs packed up to about 800 characters), each carrying its
section path ("Installation › Linux") as metadata and, with the title, as the context
embedded with it by the active embedder (``voice_tools_backends/embeddings.py``). A Markdown code
block goes with its chunk as ``code``: embedded after the text and searched for its
words, never part of a snippet, so it is found but not read out. They are stored in
``documents`` (``models/documents.py``) with the model's name and the vector's size. A
search embeds the question with the same embedder, ranks documents by meaning (pgvector,
HNSW index), by the question's words (PostgreSQL full text, GIN index) and by what each is
about (its opening chunk), fuses the three, and keeps the relevant ones (:func:`relevant`).

- ``ingest(paths, reembed=False, owner="")``: ``.md``, ``.html``, ``.pdf`` and ``.txt``
  files and folders, for one caller (``owner``) or shared by every caller (''); a file
  that cannot be read is skipped with the reason; a file ingested again for the same
  owner replaces its chunks; ``reembed`` re-embeds every stored chunk with the active
  model (after a change of embedder).
- ``search(text, top_k, filters, caller="")``: ``[{id, title, snippet, score, metadata}]``
  of the caller's own and the shared documents, best first, one per document (its best
  chunk); ``filters`` must match metadata keys exactly (JSON containment). A document is
  returned only when its closest chunk's cosine (``score``) reaches
  ``VOICE_TOOLS_SEARCH_MIN_SCORE`` (default 0.37) or its best chunk holds
  ``VOICE_TOOLS_SEARCH_MIN_WORDS`` (default 0.6) of the question's word weight: both
  derived by ``python -m bench.search`` on its calibration split.
- ``load_demo()``: ten short shared demo documents, embedded; safe to run twice.

Models are never mixed: a search or an ingest with an embedder other than the one
the stored chunks were made with is refused (:class:`ModelMismatch`) until
``voice-tools ingest --reembed``. A PostgreSQL without pgvector migrates without the
vector column; searching or ingesting there raises :class:`VectorSupportMissing`
naming the fix. Both are :class:`DocumentStoreError`: retrying will not help.
"""
from __future__ import annotations

import logging
import re
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, NamedTuple, Sequence

from sqlalchemy import column as sql_column, delete, func, or_, select, tuple_, update
from sqlalchemy import text as sql_text
from sqlalchemy.dialects.postgresql import JSONB, insert
from sqlalchemy.exc import DBAPIError, ProgrammingError
from sqlalchemy.orm import Session

from models import db, settings
from models.documents import EMBEDDING_DIM, SEARCH_CONFIG, DocumentChunk
from voice_tools_backends import SHARED, embeddings, reading, seen_by

if TYPE_CHECKING:
    import numpy as np

log = logging.getLogger(__name__)

CHUNK_CHARS = 800
CODE_CHARS = 2000  # of a chunk's code kept (the model reads 256 tokens of text and code, about 1,000 characters)
SNIPPET_CHARS = 240
# the relevance decision's two floors, derived by `python -m bench.search` on its calibration split
# (bench/SEARCH.md): a document is relevant when its closest chunk's cosine reaches DEFAULT_MIN_SCORE or
# its best chunk holds DEFAULT_MIN_WORDS of the question's word weight
DEFAULT_MIN_SCORE = 0.37
DEFAULT_MIN_WORDS = 0.6
EXTENSIONS = reading.EXTENSIONS  # .md, .markdown, .html, .htm, .pdf, .txt
MAX_QUERY_WORDS = 32  # distinct words of a question the full-text half looks for
RRF_K = 20  # reciprocal rank fusion's constant (60 in Cormack et al.; 10 to 45 ranked alike on the bench)
CANDIDATES_PER_RESULT = 20  # chunks each ranking looks at per document a search returns (each document once)
MIN_CANDIDATES = 100  # and at least this many, however few documents are asked for
OPENING_WEIGHT = 0.5  # the weight of the ranking by a document's opening chunk in the fusion
WRITE_BATCH = 256  # chunks embedded and written together during an ingest

NO_PGVECTOR = ("this PostgreSQL has no pgvector: install the pgvector extension or unset DATABASE_URL "
               "to use the embedded PostgreSQL 18")
NO_EMBEDDING_COLUMN = ("the documents table was made without pgvector: migrate it again now that pgvector is "
                       "installed (alembic downgrade 0003, then alembic upgrade head) and ingest the documents again")


class DocumentStoreError(RuntimeError):
    """The store cannot do what was asked; retrying will not help."""


class VectorSupportMissing(DocumentStoreError):
    """The database has no pgvector (or the table was made without it)."""


class ModelMismatch(DocumentStoreError):
    """The stored chunks were embedded by another model than the active one."""


# what a tool turns into PermanentError
PERMANENT_ERRORS: tuple[type[Exception], ...] = (DocumentStoreError, embeddings.EmbeddingError)


def min_score() -> float:
    """The cosine floor of relevance: ``VOICE_TOOLS_SEARCH_MIN_SCORE``, else :data:`DEFAULT_MIN_SCORE`."""
    configured = settings.load().search_min_score
    return DEFAULT_MIN_SCORE if configured is None else configured


def min_words() -> float:
    """The words floor of relevance: ``VOICE_TOOLS_SEARCH_MIN_WORDS``, else :data:`DEFAULT_MIN_WORDS`."""
    configured = settings.load().search_min_words
    return DEFAULT_MIN_WORDS if configured is None else configured


# -- pgvector and model checks ----------------------------------------------------------------

def vector_support_error(conn: Any) -> str | None:
    """Why ``documents`` cannot hold vectors on this database, or None if it can."""
    column = conn.execute(sql_text(
        "SELECT 1 FROM pg_attribute WHERE attrelid = to_regclass('documents') AND attname = 'embedding' "
        "AND NOT attisdropped")).first()
    if column is not None:
        return None
    available = conn.execute(sql_text("SELECT 1 FROM pg_available_extensions WHERE name = 'vector'")).first()
    return NO_EMBEDDING_COLUMN if available else NO_PGVECTOR


def require_vectors(session: Session) -> None:
    problem = vector_support_error(session)
    if problem:
        raise VectorSupportMissing(problem)


def _explain_database_error(exc: ProgrammingError) -> None:
    """A search failed in SQL: if it is because pgvector is missing, say so (else let it through)."""
    try:
        with db.engine().connect() as conn:
            problem = vector_support_error(conn)
    except Exception:  # the diagnosis must not hide the original error
        return
    if problem:
        raise VectorSupportMissing(problem) from exc


def _other_model(session: Session, model: str, exclude_documents: Sequence[str] = ()) -> str | None:
    """A model other than ``model`` that stored chunks were embedded with (index scans only)."""
    stmt = select(DocumentChunk.embedding_model).where(
        or_(DocumentChunk.embedding_model < model, DocumentChunk.embedding_model > model))
    if exclude_documents:
        stmt = stmt.where(DocumentChunk.document_id.not_in(list(exclude_documents)))
    return session.scalars(stmt.limit(1)).first()


def _mismatch(stored: str, active: str) -> ModelMismatch:
    return ModelMismatch(f"the documents were embedded with {stored}, this system now uses {active}: "
                         "run `voice-tools ingest --reembed`")


# -- search -------------------------------------------------------------------------------------

def search(query: str, top_k: int = 5, filters: dict[str, Any] | None = None,
           caller: str = "") -> list[dict[str, Any]]:
    """The documents most relevant to ``query`` that ``caller`` sees (see the module's doc)."""
    model, _ = embeddings.active_model()
    return search_vector(embeddings.embed_query(query), model, top_k, filters, caller=caller, text=query)


def search_vector(vector: Sequence[float] | np.ndarray, model: str, top_k: int = 5,
                  filters: dict[str, Any] | None = None, floor: float | None = None,
                  caller: str = "", text: str | None = None,
                  words_floor: float | None = None) -> list[dict[str, Any]]:
    """The documents of ``caller``'s own and the shared ones relevant to the question (``vector``,
    made by ``model``; and its words, ``text``), best first: at most ``top_k`` documents, each said by
    its chunk that ranks best (a document's other chunks are not results of their own).

    The order is :func:`rank_documents`'s. A document is returned only if it is relevant
    (:func:`relevant`): its closest chunk's cosine similarity (``score``) reaches ``floor``
    (:func:`min_score`), or its best worded chunk holds at least ``words_floor``
    (:func:`min_words`) of the question's word weight.
    """
    floor = min_score() if floor is None else floor
    words_floor = min_words() if words_floor is None else words_floor
    found: list[dict[str, Any]] = []
    for doc in rank_documents(vector, model, top_k, filters, caller=caller, text=text):
        if not relevant(doc, floor, words_floor):
            continue
        row = doc["row"]
        found.append({"id": row.id, "title": row.title, "snippet": snippet(row.content),
                      "score": round(doc["cosine"], 4), "metadata": row.doc_metadata})
        if len(found) == top_k:
            break
    return found


def relevant(doc: dict[str, Any], floor: float, words_floor: float) -> bool:
    """Whether a ranked document answers the question: its meaning is close enough (cosine), or it
    holds enough of the question's rarer words (the words' share of the question's weight)."""
    return doc["cosine"] >= floor or doc["words"] >= words_floor


def rank_documents(vector: Sequence[float] | np.ndarray, model: str, top_k: int = 5,
                   filters: dict[str, Any] | None = None, caller: str = "",
                   text: str | None = None) -> list[dict[str, Any]]:
    """Every candidate document for the question, best first, with the evidence for it:
    ``{document_id, cosine, words, fused, row}`` (no relevance decision: see :func:`search_vector`).

    Three rankings of documents, fused by reciprocal rank fusion (``weight/(RRF_K + rank)`` summed):

    1. by meaning: the documents of the chunks closest to ``vector`` (HNSW), each at its closest
       chunk's place (weight 1);
    2. by words, given ``text``: the documents of the chunks that hold the question's words
       (stemmed, no stop words), each at its best chunk's place: by the sum of the matched words'
       inverse document frequency, then ``ts_rank_cd`` (weight 1);
    3. by what the document is about: the documents found by 1 or 2, by the cosine of their
       opening chunk (embedded with the title) to the question (weight 1/2), so a long document
       that mentions everything somewhere does not outrank the one that is about it.

    ``cosine`` is the document's closest chunk's similarity; ``words`` the share (0..1) of the
    question's word weight (words no chunk holds weigh as the rarest) that its best worded chunk
    holds; ``row`` the chunk it is said by: its best in the chunk-level fusion of 1 and 2.
    """
    import numpy as np

    vector = np.asarray(vector, dtype=np.float32)
    if vector.shape != (EMBEDDING_DIM,):
        raise DocumentStoreError(f"a query vector must have {EMBEDDING_DIM} numbers, not {vector.size}")
    candidates = min(1000, max(MIN_CANDIDATES, top_k * CANDIDATES_PER_RESULT))  # chunks ranked by each half
    distance = DocumentChunk.embedding.cosine_distance(vector)
    columns = (DocumentChunk.id, DocumentChunk.owner, DocumentChunk.document_id, DocumentChunk.title,
               DocumentChunk.content, DocumentChunk.doc_metadata, distance.label("distance"))
    visible = [seen_by(DocumentChunk.owner, caller)]
    if filters:
        visible.append(DocumentChunk.doc_metadata.op("@>")(_jsonb(filters)))
    by_vector = select(*columns).where(*visible).order_by(distance, DocumentChunk.id).limit(candidates)
    try:
        with db.session() as s:
            stored = _other_model(s, model)
            if stored is not None:
                raise _mismatch(stored, model)
            # the HNSW scan looks at ef_search candidates; a filter (and the owner: other callers'
            # chunks) drops some of them afterwards, so the scan goes on until enough pass
            s.execute(sql_text(f"SET LOCAL hnsw.ef_search = {max(40, min(1000, candidates * (10 if filters else 2)))}"))
            _iterative_scan(s)
            nearest = s.execute(by_vector).all()
            worded, weights, total = (_by_words(s, text, columns, visible, candidates) if text and text.strip()
                                      else ([], {}, 0.0))
            pool = {(r.owner, r.document_id) for r in list(nearest) + list(worded)}
            openings = {(r.owner, r.document_id): float(r.distance) for r in s.execute(
                select(DocumentChunk.owner, DocumentChunk.document_id, distance.label("distance"))
                .where(*visible, DocumentChunk.chunk_index == 0,
                       tuple_(DocumentChunk.owner, DocumentChunk.document_id).in_(sorted(pool))))} if pool else {}
    except ProgrammingError as exc:
        _explain_database_error(exc)
        raise
    nearest = sorted(nearest, key=lambda r: (r.distance, r.id))  # relaxed_order may return it nearly sorted
    # the chunk each document is said by: its best in the chunk-level fusion
    chunk_fused: dict[tuple[str, str], float] = {}
    rows: dict[tuple[str, str], Any] = {}
    for ranking in (nearest, worded):
        for rank_, row in enumerate(ranking, 1):
            key = (row.owner, row.id)
            chunk_fused[key] = chunk_fused.get(key, 0.0) + 1.0 / (RRF_K + rank_)
            rows[key] = row
    docs: dict[tuple[str, str], dict[str, Any]] = {}
    for key in sorted(chunk_fused, key=lambda k: (-chunk_fused[k], rows[k].distance, k[1])):
        row = rows[key]
        doc = docs.setdefault((row.owner, row.document_id), {
            "document_id": row.document_id, "cosine": -1.0, "words": 0.0, "fused": 0.0, "row": row})
        doc["cosine"] = max(doc["cosine"], 1.0 - float(row.distance))
        if total:
            doc["words"] = max(doc["words"], weights.get(key, 0.0) / total)
    by_opening = sorted((d for d in docs if d in openings), key=lambda d: (openings[d], d))
    for ranking, weight in ((_documents_in(nearest), 1.0), (_documents_in(worded), 1.0), (by_opening, OPENING_WEIGHT)):
        for rank_, doc_key in enumerate(ranking, 1):
            docs[doc_key]["fused"] += weight / (RRF_K + rank_)
    return sorted(docs.values(), key=lambda d: (-d["fused"], -d["cosine"], d["document_id"]))


def _documents_in(ranking: Sequence[Any]) -> list[tuple[str, str]]:
    """A ranking of chunks as a ranking of their documents (each at its first chunk's place)."""
    return list(dict.fromkeys((row.owner, row.document_id) for row in ranking))


def _by_words(session: Session, text: str, columns: Sequence[Any], visible: Sequence[Any],
              limit: int) -> tuple[list[Any], dict[tuple[str, str], float], float]:
    """The chunks that hold any of the question's words (stemmed, without stop words: ``english``),
    best first: by the sum of the matched words' inverse document frequency (a word few chunks hold
    says more than a common one), then ``ts_rank_cd`` (where and how close together they are).
    With each chunk's ``(owner, id)`` -> that sum, and the question's whole weight (a word no chunk
    holds weighs as much as the rarest can)."""
    import math

    from sqlalchemy import case, literal

    lexemes = session.execute(select(func.tsvector_to_array(func.to_tsvector(SEARCH_CONFIG, text)))).scalar() or []
    lexemes = sorted(set(lexemes))[:MAX_QUERY_WORDS]
    if not lexemes:
        return [], {}, 0.0
    queries = [func.to_tsquery("simple", func.quote_literal(lexeme)) for lexeme in lexemes]
    any_word = func.to_tsquery("simple", " | ".join(f"'{lexeme.replace(chr(39), chr(39) * 2)}'" for lexeme in lexemes))
    counts = session.execute(select(func.count(), *(func.count().filter(DocumentChunk.search_text.op("@@")(q))
                                                     for q in queries))
                             .where(*visible, DocumentChunk.search_text.op("@@")(any_word))).one()
    total = max(1.0, float(session.execute(sql_text(
        "SELECT greatest(reltuples, 1) FROM pg_class WHERE oid = 'documents'::regclass")).scalar() or 1))
    total = max(total, float(counts[0]))
    weights = [math.log(1 + total / df) if df else 0.0 for df in counts[1:]]
    whole = sum(w if w else math.log(1 + total) for w in weights)
    if not counts[0]:
        return [], {}, whole  # no chunk holds any of the words
    idf = sum(case((DocumentChunk.search_text.op("@@")(q), literal(w)), else_=literal(0.0))
              for q, w in zip(queries, weights) if w)
    rank = func.ts_rank_cd(DocumentChunk.search_text, any_word)
    found = session.execute(select(*columns, idf.label("idf"))
                            .where(*visible, DocumentChunk.search_text.op("@@")(any_word))
                            .order_by(idf.desc(), rank.desc(), DocumentChunk.id).limit(limit)).all()
    return found, {(r.owner, r.id): float(r.idf) for r in found}, whole


def _iterative_scan(session: Session) -> None:
    """With a filter, let the HNSW scan go on until it has ``top_k`` rows that pass it
    (pgvector >= 0.8); an older pgvector has no such setting and keeps ef_search alone."""
    try:
        with session.begin_nested():
            session.execute(sql_text("SET LOCAL hnsw.iterative_scan = relaxed_order"))
    except DBAPIError:
        pass


def _jsonb(value: Any) -> Any:
    from sqlalchemy import cast, literal

    return cast(literal(value, type_=JSONB), JSONB)


def snippet(content: str, limit: int = SNIPPET_CHARS) -> str:
    """The start of a chunk as plain text: at most ``limit`` characters, cut at a word."""
    flat = " ".join(content.split())
    if len(flat) <= limit:
        return flat
    cut = flat[:limit].rsplit(" ", 1)[0].rstrip(",;:")
    return cut + "..."


def plain_summary(found: list[dict[str, Any]]) -> str:
    if not found:
        return "No matching documents."
    return f"{len(found)} document{'s' if len(found) != 1 else ''} found; best match: {found[0]['title']}."


def summarise(question: str, found: list[dict[str, Any]]) -> str:
    """One spoken sentence about ``found``: a chat model's when ``VOICE_TOOLS_SUMMARY_MODEL`` and
    ``OPENAI_API_KEY`` are set, else :func:`plain_summary`. A summary that fails falls back to the
    plain one (the search itself succeeded)."""
    conf = settings.load()
    if not (found and conf.summary_model and conf.openai_api_key):
        return plain_summary(found)
    listing = "\n".join(f"{i}. {d['title']}: {d['snippet']}" for i, d in enumerate(found, 1))
    try:
        client = embeddings.openai_client(conf)
        with embeddings.openai_errors():
            answer = client.chat.completions.create(
                model=conf.summary_model,
                messages=[
                    {"role": "system", "content": (
                        "You help a voice assistant answer a caller on the phone. In ONE short sentence that can "
                        "be spoken aloud (no lists, no markdown, no URLs), answer the question from the documents "
                        "below, or say that they do not answer it.")},
                    {"role": "user", "content": f"Question: {question}\n\nDocuments:\n{listing}"},
                ],
                max_completion_tokens=120,
            )
        sentence = " ".join((answer.choices[0].message.content or "").split())
    except Exception as exc:  # a summary is optional: say the plain one
        log.warning("summary by %s failed, using the plain one: %s", conf.summary_model, exc)
        return plain_summary(found)
    return sentence[:600] if sentence else plain_summary(found)


# -- chunking -------------------------------------------------------------------------------

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
SECTION_SEPARATOR = " › "


def _split_long(paragraph: str, limit: int) -> list[str]:
    """A paragraph longer than ``limit``: by sentences, then by words, then hard."""
    if len(paragraph) <= limit:
        return [paragraph]
    pieces: list[str] = []
    current = ""
    for sentence in _SENTENCE_END.split(paragraph):
        while len(sentence) > limit:
            cut = sentence.rfind(" ", 0, limit)
            cut = cut if cut > limit // 2 else limit
            if current:
                pieces.append(current)
                current = ""
            pieces.append(sentence[:cut].strip())
            sentence = sentence[cut:].strip()
        if current and len(current) + 1 + len(sentence) > limit:
            pieces.append(current)
            current = sentence
        else:
            current = f"{current} {sentence}".strip()
    if current:
        pieces.append(current)
    return [p for p in pieces if p]


class Chunk(NamedTuple):
    section: str   # the section's headings joined by " › " ("Installation › Linux"), '' before the first
    content: str   # its paragraphs: what is read out
    code: str      # the code blocks among them, one a line: searched, never read out


def chunk_sections(sections: Iterable[reading.Section], limit: int = CHUNK_CHARS) -> list[Chunk]:
    """Chunks of at most about ``limit`` characters of text: a new chunk at every section, its
    paragraphs packed together while they fit. A code block goes with the chunk that holds the
    paragraph before it (the section's first chunk when none is), and does not count in ``limit``;
    a chunk keeps the first ``CODE_CHARS`` characters of its code. A section of code alone ("File
    size humanization" and its example) is one chunk whose text is its heading."""
    chunks: list[Chunk] = []
    for section in sections:
        where = SECTION_SEPARATOR.join(section.path)
        if not section.paragraphs:
            if section.code and section.path:
                chunks.append(Chunk(where, section.path[-1], _code("\n".join(block for _, block in section.code))))
            continue
        texts: list[str] = []
        ends: list[int] = []  # per paragraph: the index in texts of the chunk that holds its end
        current = ""
        for paragraph in section.paragraphs:
            for piece in _split_long(paragraph, limit):
                if current and len(current) + 2 + len(piece) > limit:
                    texts.append(current)
                    current = piece
                else:
                    current = f"{current}\n\n{piece}" if current else piece
            ends.append(len(texts))
        if current:
            texts.append(current)
        code: list[list[str]] = [[] for _ in texts]
        for before, block in section.code:
            if texts:
                code[ends[before - 1] if before else 0].append(block)
        chunks.extend(Chunk(where, text, _code("\n".join(blocks))) for text, blocks in zip(texts, code))
    return chunks


def _code(code: str) -> str:
    """A chunk's code, cut at a word within ``CODE_CHARS`` characters."""
    if len(code) <= CODE_CHARS:
        return code
    cut = code.rfind(" ", 0, CODE_CHARS + 1)
    return code[:cut if cut > CODE_CHARS // 2 else CODE_CHARS]


def chunk_text(body: str, markdown: bool = True, limit: int = CHUNK_CHARS) -> list[Chunk]:
    """``body`` (Markdown, or plain text) parsed and cut as :func:`chunk_sections` does."""
    name = Path("text.md" if markdown else "text.txt")
    parsed = reading.parse_markdown(body, name) if markdown else reading.parse_text(body, name)
    return chunk_sections(parsed.sections, limit)


def read_document(path: Path) -> list[dict[str, Any]]:
    """The chunk rows (without embeddings) of one file (:class:`reading.Unreadable` if it cannot be read)."""
    parsed = reading.read(path)
    source = str(path)
    rows = []
    for index, (where, content, code) in enumerate(chunk_sections(parsed.sections)):
        metadata = {**parsed.meta, "source": source, "file": path.name}
        if where:
            metadata["section"] = where
        rows.append({"id": f"{source}#{index}", "document_id": source, "source": source, "title": parsed.title,
                     "chunk_index": index, "content": content, "code": code, "doc_metadata": metadata})
    return rows


def embedding_text(row: dict[str, Any]) -> str:
    """What is embedded for a chunk: its document's title and section path give it context, then
    its text, then its code (the model reads the first 256 tokens: the text comes first)."""
    head = [row["title"]]
    section = (row.get("doc_metadata") or {}).get("section")
    if section and section != row["title"]:
        head.append(section)
    code = row.get("code") or ""
    return "\n".join(head) + "\n" + row["content"] + (f"\n{code}" if code else "")


# -- ingest -------------------------------------------------------------------------------

def _files(paths: Iterable[str]) -> list[Path]:
    found: list[Path] = []
    for given in paths:
        path = Path(given).expanduser().resolve()
        if path.is_dir():
            found.extend(p for p in sorted(path.rglob("*"))
                         if p.is_file() and p.suffix.lower() in EXTENSIONS
                         and not any(part.startswith(".") for part in p.relative_to(path).parts))
        elif path.is_file():
            if path.suffix.lower() not in EXTENSIONS:
                raise DocumentStoreError(f"{given} is not a {', '.join(EXTENSIONS[:-1])} or {EXTENSIONS[-1]} file")
            found.append(path)
        else:
            raise DocumentStoreError(f"no such file or folder: {given}")
    unique: dict[Path, None] = dict.fromkeys(found)
    return list(unique)


def ingest(paths: list[str], reembed: bool = False, owner: str = SHARED,
           progress: Callable[[int, int, int], None] | None = None,
           reembed_progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Read, chunk, embed and store Markdown, HTML, PDF and text files (folders are walked; hidden
    ones skipped) as ``owner``'s documents ('' : shared by every caller).

    A file ingested again for the same owner replaces its chunks (in one transaction per batch of
    files); a chunk that has not changed (the same title, section and text, embedded by the
    active model) keeps its stored vector instead of being embedded again, and a text met twice
    in a batch is embedded once. A file that cannot be read is skipped (logged, and listed with
    the reason) and the rest goes on. With ``reembed`` every chunk already stored is embedded
    again with the active model first (:func:`reembed_all`, which calls ``reembed_progress``).
    ``progress(files done, files, chunks stored)`` is called after each batch is stored. Returns ``{files, chunks, model,
    seconds, reembedded, skipped: [{file, reason}]}``.

    The batches (``WRITE_BATCH`` chunks) flow through three stages at once: a thread reads and
    chunks the next files, this thread embeds (the model on every core), and a thread writes
    the previous batch (one transaction), so reading and the database hide behind the model.
    """
    started = time.perf_counter()
    files = _files(paths)
    model, dim = embeddings.active_model()
    with db.session() as s:
        require_vectors(s)
        if not reembed:
            stored = _other_model(s, model, exclude_documents=[str(f) for f in files])
            if stored is not None:
                raise _mismatch(stored, model)
    reembedded = reembed_all(model, dim, reembed_progress) if reembed else 0

    chunks = 0
    skipped: list[dict[str, str]] = []
    with ThreadPoolExecutor(1, thread_name_prefix="ingest-read") as reader, \
            ThreadPoolExecutor(1, thread_name_prefix="ingest-write") as writer:
        writing: tuple[Future[int], int] | None = None

        def wait_for_write() -> None:
            nonlocal chunks
            if writing is not None:
                chunks += writing[0].result()
                if progress is not None:
                    progress(writing[1], len(files), chunks)

        batches = _read_batches(files, skipped)
        upcoming = reader.submit(next, batches, None)
        while True:
            batch = upcoming.result()
            if batch is None:
                break
            upcoming = reader.submit(next, batches, None)  # the next files are read while this batch embeds
            group, files_done = batch
            _embed_rows(group, model, dim, owner)
            wait_for_write()
            writing = (writer.submit(_write, group, owner), files_done)
        wait_for_write()
    if chunks:
        _analyze()
    return {"files": len(files) - len(skipped), "chunks": chunks, "model": model,
            "seconds": round(time.perf_counter() - started, 3), "reembedded": reembedded, "skipped": skipped}


def _analyze() -> None:
    """Refresh the table's statistics: a search weighs a word by how many of all the chunks hold it
    (``reltuples``), which would otherwise wait for autovacuum (or be unknown on a new table)."""
    with db.engine().connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(sql_text("ANALYZE documents"))


def _read_batches(files: list[Path], skipped: list[dict[str, str]]) -> Iterator[
        tuple[list[tuple[Path, list[dict[str, Any]]]], int]]:
    """The files' chunk rows in groups of about ``WRITE_BATCH`` chunks, each with how many files are done."""
    group: list[tuple[Path, list[dict[str, Any]]]] = []
    for index, path in enumerate(files):
        try:
            group.append((path, read_document(path)))
        except reading.Unreadable as exc:
            log.warning("skipped %s: %s", path, exc)
            skipped.append({"file": str(path), "reason": str(exc)})
        if group and (sum(len(rows) for _, rows in group) >= WRITE_BATCH or index == len(files) - 1):
            yield group, index + 1
            group = []
    if group:
        yield group, len(files)


def _embed_rows(group: list[tuple[Path, list[dict[str, Any]]]], model: str, dim: int, owner: str = SHARED) -> None:
    """Give a group of files' chunks their vector, model and owner: a chunk stored unchanged for the same
    document keeps its vector, a text met twice is embedded once, the rest is embedded."""
    rows = [row for _, file_rows in group for row in file_rows]
    texts = [embedding_text(row) for row in rows]
    known = _stored_vectors([str(path) for path, _ in group], owner, model)
    missing = list(dict.fromkeys(t for t in texts if t not in known))
    known.update(zip(missing, embeddings.embed(missing, bulk=True)))
    for row, text in zip(rows, texts):
        row.update(owner=owner, embedding=known[text], embedding_model=model, embedding_dim=dim)


def _stored_vectors(document_ids: list[str], owner: str, model: str) -> dict[str, Any]:
    """embedding text -> the vector stored for it among these documents of ``owner`` made by ``model``."""
    import numpy as np

    if not document_ids:
        return {}
    with db.session() as s:
        stored = s.execute(select(DocumentChunk.title, DocumentChunk.content, DocumentChunk.code,
                                  DocumentChunk.doc_metadata, DocumentChunk.embedding)
                           .where(DocumentChunk.owner == owner, DocumentChunk.document_id.in_(document_ids),
                                  DocumentChunk.embedding_model == model)).all()
    return {embedding_text({"title": r.title, "content": r.content, "code": r.code, "doc_metadata": r.doc_metadata}):
            np.asarray(r.embedding, dtype=np.float32) for r in stored}


def _write(group: list[tuple[Path, list[dict[str, Any]]]], owner: str = SHARED) -> int:
    """Replace each file's chunks of ``owner`` with the group's embedded rows (one transaction)."""
    with db.session() as s:
        s.execute(delete(DocumentChunk).where(DocumentChunk.owner == owner,
                                              DocumentChunk.document_id.in_([str(path) for path, _ in group])))
        rows = [row for _, file_rows in group for row in file_rows]
        if rows:
            s.execute(insert(DocumentChunk), rows)
    return sum(len(file_rows) for _, file_rows in group)


def reembed_all(model: str, dim: int, progress: Callable[[int, int], None] | None = None) -> int:
    """Embed every stored chunk (of every owner) again with ``model``; the number done.

    Keyset pages of ``WRITE_BATCH`` chunks: a page is embedded while the previous one is written
    (one transaction, an UPDATE from a list of vectors) by a thread of its own.
    ``progress(done, total)`` is called after each page is written.
    """
    with db.session() as s:
        total = s.scalar(select(func.count()).select_from(DocumentChunk)) or 0
    done, after = 0, (SHARED, "")
    key = tuple_(DocumentChunk.owner, DocumentChunk.id)
    with ThreadPoolExecutor(1, thread_name_prefix="reembed-write") as writer:
        writing: Future[int] | None = None

        def wait_for_write() -> None:
            nonlocal done
            if writing is not None:
                done += writing.result()
                if progress is not None:
                    progress(done, total)

        while True:
            with db.session() as s:
                page = s.execute(
                    select(DocumentChunk.owner, DocumentChunk.id, DocumentChunk.title, DocumentChunk.content,
                           DocumentChunk.code, DocumentChunk.doc_metadata)
                    .where(key > tuple_(*after)).order_by(DocumentChunk.owner, DocumentChunk.id)
                    .limit(WRITE_BATCH)).all()
            if not page:
                break
            rows = [{"owner": r.owner, "id": r.id, "title": r.title, "content": r.content, "code": r.code,
                     "doc_metadata": r.doc_metadata} for r in page]
            vectors = embeddings.embed([embedding_text(row) for row in rows], bulk=True)
            wait_for_write()
            writing = writer.submit(_write_vectors, [(r["owner"], r["id"], v) for r, v in zip(rows, vectors)],
                                    model, dim)
            after = (page[-1].owner, page[-1].id)
        wait_for_write()
    return done


def _write_vectors(vectors: list[tuple[str, str, Any]], model: str, dim: int) -> int:
    """Store new vectors for chunks by (owner, id), with their model (one transaction, one statement)."""
    from pgvector.sqlalchemy import Vector
    from sqlalchemy import String, Text, bindparam, cast, values

    given = values(sql_column("owner", String), sql_column("id", Text), sql_column("embedding", Vector(EMBEDDING_DIM)),
                   name="given").data(vectors)
    with db.session() as s:
        s.execute(update(DocumentChunk)
                  .where(DocumentChunk.owner == given.c.owner, DocumentChunk.id == given.c.id)
                  .values(embedding=cast(given.c.embedding, Vector(EMBEDDING_DIM)), embedding_model=bindparam("model", model),
                          embedding_dim=bindparam("dim", dim)))
    return len(vectors)


# -- demo data ------------------------------------------------------------------------------

DEMO_DOCUMENTS = [
    ("q3-sales-northwest", "Q3 sales report: Northwest region",
     "Northwest region Q3 sales totalled $4.2M across Washington, Oregon, Idaho and Montana; "
     "12,450 units sold, up 8% on Q2.", {"kind": "sales", "region": "northwest", "quarter": "Q3"}),
    ("q3-sales-southwest", "Q3 sales report: Southwest region",
     "Southwest region Q3 sales totalled $3.1M across Arizona, New Mexico and Nevada; 9,870 units sold.",
     {"kind": "sales", "region": "southwest", "quarter": "Q3"}),
    ("onboarding-guide", "Onboarding guide for new sales staff",
     "New sales staff complete product training, shadow two customer calls and pass the knowledge check "
     "in their first two weeks.", {"kind": "training"}),
    ("travel-policy", "Travel and expenses policy",
     "Book travel through the portal; meals up to $60 a day; submit receipts within 30 days.",
     {"kind": "policy"}),
    ("product-voicehub-headset", "Product sheet: VoiceHub Pro headset",
     "The VoiceHub Pro headset has active noise cancelling, 30 hours of battery life and a two-year warranty; "
     "list price $249, volume discounts from 50 units.", {"kind": "product"}),
    ("product-returns", "Returns and warranty claims",
     "Customers may return unused products within 30 days for a full refund; warranty claims need the serial "
     "number and proof of purchase and are answered within five working days.", {"kind": "product"}),
    ("hr-paid-time-off", "Paid time off policy",
     "Full-time employees get 25 days of paid vacation a year plus public holidays; request leave in the HR "
     "portal at least two weeks ahead; up to five unused days carry over to next year.", {"kind": "hr"}),
    ("hr-parental-leave", "Parental leave",
     "Parents get 16 weeks of fully paid parental leave, which can be split into two blocks within the "
     "child's first year; tell your manager and HR eight weeks before it starts.", {"kind": "hr"}),
    ("it-password-reset", "IT help: resetting your password",
     "Reset a forgotten password at the self-service page with your phone for two-factor verification; "
     "passwords expire every 90 days; call the IT help desk on extension 4357 if you are locked out.",
     {"kind": "it"}),
    ("it-vpn-access", "IT help: VPN and remote access",
     "Install the company VPN client from the software centre and sign in with your network account; "
     "remote access needs a managed laptop with disk encryption turned on.", {"kind": "it"}),
]


def demo_rows() -> list[dict[str, Any]]:
    return [{"id": f"{doc_id}#0", "document_id": doc_id, "source": "demo", "title": title, "chunk_index": 0,
             "content": content, "code": "", "doc_metadata": {"source": "demo", **meta}}
            for doc_id, title, content, meta in DEMO_DOCUMENTS]


def load_demo() -> int:
    """Add the demo documents that are missing, embedded with the active model; the number added.

    Adds nothing (and says why in the log) on a database without pgvector or when the
    stored chunks were embedded by another model.
    """
    rows = demo_rows()
    model, dim = embeddings.active_model()
    with db.session() as s:
        problem = vector_support_error(s)
        if problem:
            log.warning("demo documents not loaded: %s", problem)
            return 0
        stored = _other_model(s, model)
        if stored is not None:
            log.warning("demo documents not loaded: %s", _mismatch(stored, model))
            return 0
        have = set(s.scalars(select(DocumentChunk.id).where(DocumentChunk.owner == SHARED,
                                                            DocumentChunk.id.in_([r["id"] for r in rows]))))
    missing = [row for row in rows if row["id"] not in have]
    if not missing:
        return 0
    vectors = embeddings.embed([embedding_text(row) for row in missing])
    for row, vector in zip(missing, vectors):
        row.update(embedding=vector, embedding_model=model, embedding_dim=dim)
    with db.session() as s:
        added = s.scalars(insert(DocumentChunk).values(missing)
                          .on_conflict_do_nothing(index_elements=["owner", "id"]).returning(DocumentChunk.id)).all()
    return len(added)
