"""End to end through a real `courier serve` (tiny llama) with the official openai client."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.support.server import RunningServer, running_server

MAX_BODY_BYTES = 65536


MLX_CACHE_LIMIT = 8 * 1024 * 1024


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path, cache_dir: Path) -> Iterator[RunningServer]:
    args = ["--model", str(tiny_llama_dir), "--cache-dir", str(cache_dir), "--max-body-bytes", str(MAX_BODY_BYTES)]
    env = {"COURIER_SERVED_MODEL_NAME": "tiny", "COURIER_MLX_CACHE_LIMIT": str(MLX_CACHE_LIMIT)}
    with running_server(args, env=env) as running:
        yield running
        assert running.stop() == 0


def test_no_blas_gemv_and_no_cpu_attention_leave_products_on_sgemm_and_softmax_to_mlx(
    tiny_llama_dir: Path, cache_dir: Path
) -> None:
    args = ["--model", str(tiny_llama_dir), "--cache-dir", str(cache_dir), "--no-blas-gemv"]
    env = {"COURIER_SERVED_MODEL_NAME": "tiny", "COURIER_CPU_ATTENTION": "false"}
    with running_server(args, env=env) as running:
        with running.http() as http:
            health = http.get("/health").json()
            prompt = " ".join(["one two three"] * 12)  # more queries than a decode step: prefill attention
            reply = http.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 2})
        assert running.stop() == 0
    assert reply.status_code == 200, reply.text
    assert health["cpu_attention"] == {"active": False, "detail": "off by configuration; MLX's own softmax"}
    assert "CPU attention: off by configuration" in running.log()
    blas = health["blas"]
    if blas["library"] == "OpenBLAS":  # on MLX's reference BLAS there is nothing to forward to
        assert blas["gemv"] == "off by configuration"
        assert "gemv: off by configuration" in running.log()


def test_health_reports_device_blas_and_weight_format(server: RunningServer) -> None:
    with server.http() as http:
        response = http.get("/health")
    assert response.status_code == 200
    body = response.json()
    assert body["status"] == "ok"
    assert body["model"] == "tiny"
    assert body["device"] == "cpu"
    assert body["weight_format"] == "float32 (from 4-bit affine, group size 32)"
    assert body["blas"]["library"] in ("OpenBLAS", "reference")
    if body["blas"]["library"] == "OpenBLAS" and shutil.which("cc"):
        assert body["blas"]["gemv"].startswith("products of up to 3 rows through cblas_sgemv"), body["blas"]
    if shutil.which("g++"):
        assert body["cpu_attention"]["active"] is True, body["cpu_attention"]
    assert body["model_info"]["prompt_cache_trimmable"] is True
    memory = body["memory"]
    assert memory["cache_limit_bytes"] == MLX_CACHE_LIMIT
    assert 0 <= memory["cache_bytes"] <= MLX_CACHE_LIMIT
    assert memory["active_bytes"] > 0  # the model's weights
    with server.http() as http:
        metrics = http.get("/metrics").text
    assert "courier_mlx_cache_bytes" in metrics and "courier_mlx_active_bytes" in metrics
    # What a Kubernetes inference gateway reads, by vLLM's names (idle: nothing queued or running).
    assert 'vllm:num_requests_waiting{model_name="tiny"} 0.0' in metrics.splitlines()
    assert 'vllm:kv_cache_usage_perc{model_name="tiny"} 0.0' in metrics.splitlines()


def test_models_list_and_retrieve_with_the_openai_client(server: RunningServer) -> None:
    with server.openai_client() as client:
        models = client.models.list()
        assert [model.id for model in models.data] == ["tiny"]
        assert client.models.retrieve("tiny").owned_by == "courier"
        with pytest.raises(openai.NotFoundError) as error:
            client.models.retrieve("gpt-9")
    assert error.value.body["code"] == "model_not_found"  # type: ignore[index]


def test_models_are_served_without_the_v1_prefix_too(server: RunningServer) -> None:
    with server.http() as http:
        listed = http.get("/models")
        one = http.get("/models/tiny")
        missing = http.get("/models/gpt-9")
        assert listed.json() == http.get("/v1/models").json()
    assert listed.status_code == one.status_code == 200
    assert [model["id"] for model in listed.json()["data"]] == ["tiny"]
    assert one.json() == listed.json()["data"][0]
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    client = openai.OpenAI(base_url=server.base_url, api_key="not-needed", max_retries=0)  # a base URL without /v1
    with client:
        assert [model.id for model in client.models.list().data] == ["tiny"]


def test_tokenize_and_detokenize_round_trip(server: RunningServer) -> None:
    with server.http() as http:
        tokens = http.post("/tokenize", json={"prompt": "Hello world", "model": "tiny"}).json()
        assert tokens["count"] == len(tokens["tokens"]) == 2
        assert tokens["max_model_len"] == 2048
        text = http.post("/detokenize", json={"tokens": tokens["tokens"]}).json()
    assert text == {"prompt": "Hello world"}


def test_tokenize_chat_messages(server: RunningServer) -> None:
    with server.http() as http:
        body = http.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
        bare = http.post(
            "/tokenize", json={"messages": [{"role": "user", "content": "Hi"}], "add_generation_prompt": False}
        ).json()
    assert body["count"] > bare["count"] > 5


BAD_REQUESTS: list[tuple[str, str, bytes | None, int, str | None, str | None]] = [
    # method, path, body, status, param, code
    ("POST", "/tokenize", b"{not json", 400, None, "invalid_json"),
    ("POST", "/tokenize", b"\xff\xfe\x00", 400, None, "invalid_json"),
    ("POST", "/tokenize", b"[1, 2]", 400, None, None),
    ("POST", "/tokenize", b"", 400, None, None),
    ("POST", "/tokenize", b"{}", 400, "prompt", None),
    ("POST", "/tokenize", b'{"prompt": "a", "messages": []}', 400, "prompt", None),
    ("POST", "/tokenize", b'{"prompt": 5}', 400, "prompt", None),
    ("POST", "/tokenize", b'{"messages": "hi"}', 400, "messages", None),
    ("POST", "/tokenize", b'{"messages": [{"role": "user"}]}', 400, "messages[0].content", None),
    ("POST", "/tokenize", b'{"messages": []}', 400, "messages", None),
    ("POST", "/tokenize", b'{"messages": [{"role": "wizard", "content": "Hi"}]}', 400, "messages[0].role", None),
    # found by bench/fuzz.py: parts that are not objects reached the chat template
    ("POST", "/tokenize", b'{"messages": [{"role": "user", "content": ["x"]}]}', 400, "messages[0].content[0]", None),
    ("POST", "/tokenize", b'{"messages": [{"role": "user", "content": [[]]}]}', 400, "messages[0].content[0]", None),
    ("POST", "/tokenize", b'{"messages": [{"role": "user", "content": [1]}]}', 400, "messages[0].content[0]", None),
    ("POST", "/tokenize", b'{"prompt": "a", "add_special_tokens": "yes"}', 400, "add_special_tokens", None),
    ("POST", "/tokenize", b'{"prompt": "a", "model": "other"}', 404, "model", "model_not_found"),
    ("POST", "/detokenize", b'{"tokens": ["a"]}', 400, "tokens", None),
    ("POST", "/detokenize", b'{"tokens": [true]}', 400, "tokens", None),
    ("POST", "/detokenize", b'{"tokens": [99999999]}', 400, "tokens", None),
    ("POST", "/detokenize", b"{}", 400, "tokens", None),
    ("GET", "/v1/nothing-here", None, 404, None, "unknown_route"),
    ("DELETE", "/health", None, 405, None, "method_not_allowed"),
    ("POST", "/tokenize", b'{"prompt": "' + b"x" * MAX_BODY_BYTES + b'"}', 413, None, "request_too_large"),
]


@pytest.mark.parametrize(("method", "path", "body", "status", "param", "code"), BAD_REQUESTS)
def test_bad_input_gets_an_openai_error_envelope(
    server: RunningServer, method: str, path: str, body: bytes | None, status: int, param: str | None, code: str | None
) -> None:
    with server.http() as http:
        response = http.request(method, path, content=body, headers={"content-type": "application/json"})
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["message"]
        assert error["param"] == param
        if code is not None:
            assert error["code"] == code
        assert http.get("/health").status_code == 200  # still serving


def test_chunked_body_over_the_limit_is_refused(server: RunningServer) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"prompt": "'
        for _ in range(MAX_BODY_BYTES // 1024 + 2):
            yield b"y" * 1024
        yield b'"}'

    with server.http() as http:
        response = http.post("/tokenize", content=chunks())
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"


def test_sampling_defaults_come_from_flags_then_the_models_generation_config(
    tiny_llama_dir: Path, cache_dir: Path, tmp_path: Path
) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, model)
    (model / "generation_config.json").write_text('{"temperature": 0.6, "top_p": 0.8, "do_sample": true}')
    base = ["--model", str(model), "--cache-dir", str(cache_dir), "--served-model-name", "tiny"]
    for flags, expected in (
        ([], {"temperature": 0.6, "top_p": 0.8, "source": "generation_config.json", "max_tokens": 4096}),
        (
            ["--default-temperature", "0", "--default-max-tokens", "7"],
            {"temperature": 0.0, "top_p": 0.8, "source": "flags, then generation_config.json", "max_tokens": 7},
        ),
    ):
        with running_server([*base, *flags]) as server, server.http() as http:
            assert http.get("/v1/models/tiny").json()["sampling_defaults"] == expected
            if expected["max_tokens"] == 7:  # its end tokens banned, a reply runs to the default cap (the cap
                # against the room the context leaves is tests/actors/test_ingress.py's)
                bias = {"0": -100, "2": -100}
                chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "logit_bias": bias}
                usage = http.post("/v1/chat/completions", json=chat).json()["usage"]
                assert usage["completion_tokens"] == 7
            response = http.post("/v1/responses", json={"model": "tiny", "input": "Hi", "max_output_tokens": 2}).json()
            assert (response["temperature"], response["top_p"]) == (expected["temperature"], expected["top_p"])
            sent = http.post(
                "/v1/responses", json={"model": "tiny", "input": "Hi", "max_output_tokens": 2, "temperature": 1.5}
            ).json()
            assert sent["temperature"] == 1.5  # what the request sends wins
