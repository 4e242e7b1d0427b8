"""A generation that raises inside the batched forward pass: a 500 envelope, and the server keeps serving."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.support.faulty_model import POISON_TOKEN, build_faulty_llama
from tests.support.server import FIXED_PREFILL_CHUNKS, RunningServer, ServerExited, running_server


@pytest.fixture(scope="module")
def faulty_dir(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_faulty_llama(smollm2_dir, tmp_path_factory.mktemp("faulty-llama"))


@pytest.fixture(scope="module")
def server(faulty_dir: Path, cache_dir: Path) -> Iterator[RunningServer]:
    """The faulty llama served, shared by the tests that send it poisoned requests (each counts its own failures)."""
    args = ["--model", str(faulty_dir), "--cache-dir", str(cache_dir), "--served-model-name", "faulty"]
    with running_server([*args, "--trust-remote-code", *FIXED_PREFILL_CHUNKS]) as running:
        yield running
        assert running.stop() == 0


def failed_so_far(server: RunningServer) -> int:
    with server.http() as http:
        failed: int = http.get("/health").json()["scheduler"]["failed"]
        return failed


def test_a_raising_generation_fails_with_500_and_the_server_keeps_serving(server: RunningServer) -> None:
    failed_before = failed_so_far(server)
    with server.openai_client() as client:
        before = client.completions.create(model="faulty", prompt=[1, 2, 3], max_tokens=4, temperature=0)
        with pytest.raises(openai.InternalServerError) as failed:
            client.completions.create(model="faulty", prompt=[1, 2, POISON_TOKEN], max_tokens=4)
        assert failed.value.status_code == 500
        body = failed.value.body
        assert isinstance(body, dict) and body["code"] == "generation_failed"
        assert "poisoned input" in body["message"]
        stream = client.completions.create(model="faulty", prompt=[POISON_TOKEN], max_tokens=4, stream=True)
        with pytest.raises(openai.APIError, match="poisoned input"):
            list(stream)
        after = client.completions.create(model="faulty", prompt=[1, 2, 3], max_tokens=4, temperature=0)
        assert after.choices[0].text == before.choices[0].text
        with server.http() as http:
            scheduler = http.get("/health").json()["scheduler"]
        assert (scheduler["failed"] - failed_before, scheduler["running"], scheduler["waiting"]) == (2, 0, 0)


def test_a_model_with_its_own_code_needs_trust_remote_code(faulty_dir: Path, cache_dir: Path) -> None:
    args = ["--model", str(faulty_dir), "--cache-dir", str(cache_dir)]
    with pytest.raises(ServerExited, match="trust_remote_code"), running_server(args):
        pass


def test_a_fault_fails_only_its_own_request_and_its_batch_mates_carry_on(server: RunningServer) -> None:
    """The poisoned request joins a running batch; the step fails; each request is replayed alone."""
    failed_before, log_start = failed_so_far(server), len(server.lines)
    with server.openai_client() as client:
        alone = client.completions.create(model="faulty", prompt=[1, 2, 3], max_tokens=1500, temperature=0)
        assert alone.usage is not None
        stream = client.completions.create(
            model="faulty",
            prompt=[1, 2, 3],
            max_tokens=1500,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = iter(stream)
        first = next(chunks)
        with pytest.raises(openai.InternalServerError, match="poisoned input"):
            client.completions.create(model="faulty", prompt=[4, POISON_TOKEN, 5], max_tokens=4)
        rest = list(chunks)
        text = "".join(chunk.choices[0].text for chunk in [first, *rest] if chunk.choices)
        finishes = [
            chunk.choices[0].finish_reason for chunk in rest if chunk.choices and chunk.choices[0].finish_reason
        ]
        usage = rest[-1].usage
        assert usage is not None
        assert finishes == [alone.choices[0].finish_reason]
        assert usage.completion_tokens == alone.usage.completion_tokens
        assert text == alone.choices[0].text
        assert any("replaying its 2 requests one by one" in line for line in server.lines[log_start:])
        with server.http() as http:
            scheduler = http.get("/health").json()["scheduler"]
        assert (scheduler["failed"] - failed_before, scheduler["running"], scheduler["waiting"]) == (1, 0, 0)
