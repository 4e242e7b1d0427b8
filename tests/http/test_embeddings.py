"""POST /v1/embeddings through the real server and the official openai client (issue 33, item 5).

One process serves a tiny random-weight BERT embedding model (mlx-embeddings, built on the fly), a tiny llama that
only generates, and the same llama with mean pooling enabled (`--embedding-pooling`). Vectors are unit vectors in
the input's order, the same whether an input comes alone, in a batch, as text or as its token ids; base64 and
`dimensions` follow OpenAI's shapes; what a model cannot do is a 400 saying so.
"""

from __future__ import annotations

import base64
import math
import shutil
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.server import RunningServer, running_server

TEXTS = ["hello world", "a much longer sentence than the first one, to pad the batch", "short"]
BERT_WIDTH = 32  # tests/support/tiny_embedding_model.py
LLAMA_WIDTH = 64  # tests/support/tiny_models.py
CLOSE = 1e-4


HUB_REPO, HUB_REVISION = "courier-tests/tiny-bert", "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def hub_cache(tiny_bert_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Hugging Face cache holding the tiny BERT as HUB_REPO, laid out as the hub client leaves a download."""
    cache = tmp_path_factory.mktemp("hf-hub")
    repo = cache / ("models--" + HUB_REPO.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(HUB_REVISION)
    shutil.copytree(tiny_bert_dir, repo / "snapshots" / HUB_REVISION)
    return cache


@pytest.fixture(scope="module")
def server(tiny_bert_dir: Path, tiny_llama_dir: Path, cache_dir: Path, hub_cache: Path) -> Iterator[RunningServer]:
    args = [
        *("--model", f"bert={tiny_bert_dir}", "--model", f"chat={tiny_llama_dir}"),
        *("--model", f"pooled={tiny_llama_dir}", "--embedding-pooling", "pooled=mean"),
        *("--model", HUB_REPO, "--model", "not-downloaded=courier-tests/absent"),
        *("--cache-dir", str(cache_dir)),
    ]
    with running_server(args, env={"HF_HUB_CACHE": str(hub_cache), "HF_HUB_OFFLINE": "1"}) as running:
        yield running
        assert running.stop() == 0


@pytest.fixture
def http(server: RunningServer) -> Iterator[httpx.Client]:
    with server.http() as client:
        yield client


def embed(http: httpx.Client, model: str, value: Any, **fields: Any) -> httpx.Response:
    return http.post("/v1/embeddings", json={"model": model, "input": value, **fields})


def vectors(reply: httpx.Response) -> list[list[float]]:
    assert reply.status_code == 200, reply.text
    data = reply.json()["data"]
    assert [item["index"] for item in data] == list(range(len(data)))
    return [item["embedding"] for item in data]


def norm(vector: list[float]) -> float:
    return math.sqrt(sum(value * value for value in vector))


def assert_close(left: list[float], right: list[float]) -> None:
    assert len(left) == len(right)
    assert max(abs(a - b) for a, b in zip(left, right, strict=True)) < CLOSE


def tokens(http: httpx.Client, text: str) -> list[int]:
    """The text's ids as the embedding model's tokenizer gives them (the tiny models share one tokenizer)."""
    reply = http.post("/tokenize", json={"model": "chat", "prompt": text})
    ids: list[int] = reply.json()["tokens"]
    return ids


@pytest.mark.parametrize(("model", "width"), [("bert", BERT_WIDTH), ("pooled", LLAMA_WIDTH)])
def test_a_batch_embeds_each_input_as_it_would_alone(http: httpx.Client, model: str, width: int) -> None:
    batch = embed(http, model, TEXTS)
    together = vectors(batch)
    assert len(together) == len(TEXTS)
    for text, vector in zip(TEXTS, together, strict=True):
        assert len(vector) == width
        assert abs(norm(vector) - 1) < CLOSE
        assert_close(vector, vectors(embed(http, model, text))[0])
    assert len({tuple(round(value, 4) for value in vector) for vector in together}) == len(TEXTS)
    usage = batch.json()["usage"]
    assert usage["prompt_tokens"] == usage["total_tokens"] > len(TEXTS)
    assert batch.json()["model"] == model


def test_token_ids_embed_as_their_text_does(http: httpx.Client) -> None:
    ids = tokens(http, TEXTS[0])
    by_ids = vectors(embed(http, "pooled", ids))[0]
    assert_close(by_ids, vectors(embed(http, "pooled", TEXTS[0]))[0])
    several = vectors(embed(http, "pooled", [ids, tokens(http, TEXTS[2])]))
    assert_close(several[0], by_ids)


def test_the_openai_client_reads_base64_and_dimensions(server: RunningServer, http: httpx.Client) -> None:
    full = vectors(embed(http, "bert", TEXTS[:2]))
    with server.openai_client() as client:
        answer = client.embeddings.create(model="bert", input=TEXTS[:2])  # the client asks for base64
        assert [len(item.embedding) for item in answer.data] == [BERT_WIDTH, BERT_WIDTH]
        for item, vector in zip(answer.data, full, strict=True):
            assert_close(item.embedding, vector)
        assert answer.usage.prompt_tokens > 0
        short = client.embeddings.create(model="bert", input=TEXTS[0], dimensions=8, encoding_format="float")
    head = full[0][:8]
    assert_close(short.data[0].embedding, [value / norm(head) for value in head])
    raw = embed(http, "bert", TEXTS[0], encoding_format="base64").json()["data"][0]["embedding"]
    assert_close(list(struct.unpack(f"<{BERT_WIDTH}f", base64.b64decode(raw))), full[0])


REFUSED: list[tuple[str, dict[str, Any], str, str]] = [
    ("/v1/embeddings", {"model": "chat", "input": "hi"}, "model", "model_not_supported"),  # no pooling for it
    (
        "/v1/chat/completions",
        {"model": "bert", "messages": [{"role": "user", "content": "hi"}]},
        "model",
        "model_not_supported",
    ),
    ("/v1/embeddings", {"model": "bert", "input": ""}, "input", "invalid_request"),
    ("/v1/embeddings", {"model": "bert", "input": ["ok", ""]}, "input[1]", "invalid_request"),
    ("/v1/embeddings", {"model": "bert", "input": []}, "input", "invalid_request"),
    ("/v1/embeddings", {"model": "bert", "input": [[1, 2], "x", 3]}, "input[2]", "invalid_request"),
    ("/v1/embeddings", {"model": "bert", "input": "word " * 200}, "input", "invalid_request"),  # past 128 tokens
    ("/v1/embeddings", {"model": "bert", "input": [[10**9]]}, "input", "invalid_request"),
    (
        "/v1/embeddings",
        {"model": "bert", "input": "hi", "encoding_format": "hex"},
        "encoding_format",
        "invalid_request",
    ),
    ("/v1/embeddings", {"model": "bert", "input": "hi", "dimensions": 33}, "dimensions", "invalid_request"),
    ("/v1/embeddings", {"model": "bert", "input": "hi", "dimensions": 0}, "dimensions", "invalid_request"),
]


@pytest.mark.parametrize(("path", "body", "param", "code"), REFUSED, ids=[str(case[1])[:60] for case in REFUSED])
def test_what_a_model_cannot_do_is_a_400_naming_it(
    http: httpx.Client, path: str, body: dict[str, Any], param: str, code: str
) -> None:
    reply = http.post(path, json=body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param, code)


def test_models_shows_what_each_model_embeds(http: httpx.Client) -> None:
    for model in ("bert", "pooled", "chat"):
        http.post("/v1/embeddings", json={"model": model, "input": "load it"})
    shown = {model["id"]: model.get("capabilities") for model in http.get("/v1/models").json()["data"]}
    assert shown["bert"]["embeddings"] == {"dimensions": BERT_WIDTH, "pooling": "model", "max_input_tokens": 128}
    assert shown["bert"]["generation"] is False
    assert shown["pooled"]["embeddings"]["pooling"] == "mean"
    assert shown["pooled"]["generation"] is True
    assert shown["chat"]["embeddings"] is None


def test_an_embedding_model_named_by_its_hub_repo_embeds_as_its_directory_does(http: httpx.Client) -> None:
    """Only a repo's files tell an encoder from a generative model: they are fetched (here: found in the offline
    cache) before either loader is chosen."""
    from_hub, from_directory = vectors(embed(http, HUB_REPO, TEXTS)), vectors(embed(http, "bert", TEXTS))
    assert len(from_hub[0]) == BERT_WIDTH
    for left, right in zip(from_hub, from_directory, strict=True):
        assert_close(left, right)
    missing = embed(http, "not-downloaded", "hello")
    assert missing.status_code == 503
    error = missing.json()["error"]
    assert error["code"] == "model_load_failed"
    assert "cannot load model from courier-tests/absent: it is not in the Hugging Face cache" in error["message"]
    assert vectors(embed(http, "bert", "still here"))  # the failed load disturbed nothing
