"""The quantized batch KV (`--kv-bits`) through the real server, on the tiny dense llama with 64-dimension heads:
streamed and `n` > 1 replies come back, greedy ones the same each time; /health and /v1/cache/stats say how the
batch holds its KV; a group size the model's heads do not allow stops the server at start-up, naming the flag."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest
from mlx import nn

from courier.server.batch_kv import has_attention_sinks
from tests.support import tiny_models
from tests.support.server import FIXED_PREFILL_CHUNKS, running_server


@pytest.fixture(scope="module")
def wide_dense(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_models.build_wide_llama(smollm2_dir, tmp_path_factory.mktemp("wide-kv-bits"))


def test_a_quantized_batch_serves_and_says_so(wide_dense: Path, cache_dir: Path) -> None:
    args = ["--model", str(wide_dense), "--cache-dir", str(cache_dir), "--served-model-name", "tiny"]
    with (
        running_server([*args, "--kv-bits", "8", "--kv-group-size", "32", *FIXED_PREFILL_CHUNKS]) as server,
        server.http() as http,
    ):
        body = {"model": "tiny", "messages": [{"role": "user", "content": "Count to ten."}], "temperature": 0}
        forked = http.post("/v1/chat/completions", json={**body, "max_tokens": 12, "n": 3}).json()
        replies = [choice["message"]["content"] for choice in forked["choices"]]
        assert len(replies) == 3 and len(set(replies)) == 1 and replies[0]  # greedy: one reply, thrice
        single = http.post("/v1/chat/completions", json={**body, "max_tokens": 12}).json()
        assert single["choices"][0]["message"]["content"] == replies[0]
        with http.stream("POST", "/v1/chat/completions", json={**body, "max_tokens": 12, "stream": True}) as stream:
            assert stream.status_code == 200 and "[DONE]" in stream.read().decode()
        assert http.get("/health").json()["batch_kv"] == {"bits": 8, "group_size": 32}
        figures = http.get("/v1/cache/stats").json()
        assert (figures["batch_kv_bits"], figures["batch_kv_group_size"]) == (8, 32)
        assert server.stop() == 0


def test_a_group_size_the_heads_do_not_allow_stops_the_server(tiny_llama_dir: Path, cache_dir: Path) -> None:
    """The tiny llama's heads are 16 wide: no group size MLX supports divides them."""
    args = ["--model", str(tiny_llama_dir), "--cache-dir", str(cache_dir), "--kv-bits", "4"]
    with running_server(args, wait_ready=False) as server:
        code = server.wait_exit()
    assert code != 0
    assert "--kv-group-size 64 does not divide the model's attention head dimension (16)" in server.log()


@pytest.mark.parametrize("sinks", [True, False])
def test_models_with_attention_sinks_are_told_apart(sinks: bool) -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    if sinks:
        model.layers[1].sinks = mx.zeros((2,))  # gpt-oss's attention: a learned sink per head
    assert has_attention_sinks(model) is sinks
