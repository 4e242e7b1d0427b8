"""Quantized prompt-cache snapshots through the real server (`--prompt-cache-bits`), on tiny dense and hybrid models
with 64-dimension attention heads: a memory budget that holds two conversations as computed holds six at 8 bits;
/v1/cache/stats says how they are stored; a restart keeps them on disk; a restart with other bits starts a cold
directory of its own and never adopts the other's files; a group size the head dimension does not allow stops the
server at start-up, and fails the load of one model of several."""

from __future__ import annotations

import copy
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.support import tiny_models
from tests.support.polling import attempts
from tests.support.server import RunningServer, running_server

# At 2,048 B/token as computed, a ~200-token conversation takes ~410 KB: 1 MiB holds two. At 8-bit/64 (576 B/token,
# plus the hybrid's fixed recurrent state) it holds eight.
MEMORY_BUDGET = "1MiB"
CONVERSATIONS = 6
GENERATION_PROMPT = 3


@pytest.fixture(scope="module")
def wide_dense(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The dense one alone, where the model family makes no difference (the directories and files of a setting)."""
    return tiny_models.build_wide_llama(smollm2_dir, tmp_path_factory.mktemp("wide-dense"))


@pytest.fixture(scope="module", params=["dense", "hybrid"])
def wide(request: pytest.FixtureRequest, smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    if request.param == "dense":
        dense: Path = request.getfixturevalue("wide_dense")
        return dense
    return tiny_models.build_wide_qwen3_next(smollm2_dir, tmp_path_factory.mktemp("wide-hybrid"))


@contextmanager
def serving(model: Path, cache_dir: Path, prompt_cache_dir: Path, *extra: str) -> Iterator[RunningServer]:
    args = ["--model", str(model), "--cache-dir", str(cache_dir), "--served-model-name", "tiny"]
    args += ["--prompt-cache-dir", str(prompt_cache_dir), "--prompt-cache-snapshot-capacity-bytes", MEMORY_BUDGET]
    with running_server([*args, *extra]) as running:
        yield running


def stats(server: RunningServer) -> dict[str, Any]:
    with server.http() as http:
        figures: dict[str, Any] = http.get("/v1/cache/stats").json()
        return figures


def settled(server: RunningServer) -> dict[str, Any]:
    """Stats once every idle warm-up has run and the disk has done all it was asked (polled, never slept)."""
    for _ in attempts():
        figures = stats(server)
        done = figures["snapshot_warmups_run"] + figures["snapshot_warmups_skipped"]
        idle = not figures["snapshot_warmups_pending"] and not figures["snapshot_disk_pending"]
        if done == figures["snapshot_warmups_queued"] and idle:
            return figures
    raise AssertionError(f"the cache never settled: {figures}")


class Conversations:
    def __init__(self, count: int = CONVERSATIONS) -> None:
        self.histories: list[list[ChatCompletionMessageParam]] = [
            [{"role": "system", "content": f"Customer {index} of the shop. " + "Answer with care. " * 36}]
            for index in range(count)
        ]
        self.last_prompt = [0] * count

    def turn(self, client: openai.OpenAI, server: RunningServer) -> list[tuple[int, int]]:
        """One more turn of each, each settled before the next: (previous prompt, cached) per conversation."""
        seen = []
        for index, messages in enumerate(self.histories):
            messages.append({"role": "user", "content": f"Question {len(messages)}: where is my parcel?"})
            reply = client.chat.completions.create(
                model="tiny", messages=messages, max_tokens=8, temperature=0, user=f"customer-{index}"
            )
            assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
            seen.append((self.last_prompt[index], reply.usage.prompt_tokens_details.cached_tokens or 0))
            self.last_prompt[index] = reply.usage.prompt_tokens
            messages.append({"role": "assistant", "content": reply.choices[0].message.content or ""})
            settled(server)
        return seen


def assert_warm(turns: list[tuple[int, int]]) -> None:
    cold = [(previous, cached) for previous, cached in turns if cached < previous - GENERATION_PROMPT]
    assert not cold, f"turns served cold (previous prompt, cached): {cold}"


def directories(prompt_cache_dir: Path) -> set[Path]:
    return {path for path in prompt_cache_dir.iterdir() if path.is_dir()}


@dataclass(frozen=True, slots=True, kw_only=True)
class EightBitRun:
    """What a first server at 8 bits left: its prompt-cache directory, stopped cleanly, the conversations it served,
    its second turns and its settled stats. Tests copy the directory and the conversations, so each works on its own."""

    root: Path  # the --prompt-cache-dir
    conversations: Conversations
    second_turns: list[tuple[int, int]]
    figures: dict[str, Any]

    def copy_to(self, root: Path) -> Conversations:
        """The directory's files in `root` (modes and times kept), and the conversations they were written for."""
        shutil.copytree(self.root, root, dirs_exist_ok=True)
        return copy.deepcopy(self.conversations)


@pytest.fixture(scope="module")
def eight_bit_run(cache_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[[Path], EightBitRun]:
    """Per model, once per module: CONVERSATIONS conversations, two turns each, at `--prompt-cache-bits 8`."""
    made: dict[Path, EightBitRun] = {}

    def run(model: Path) -> EightBitRun:
        if model not in made:
            root = tmp_path_factory.mktemp("eight-bits")
            conversations = Conversations()
            with (
                serving(model, cache_dir, root, "--prompt-cache-bits", "8") as server,
                server.openai_client() as client,
            ):
                conversations.turn(client, server)
                second_turns = conversations.turn(client, server)
                figures = settled(server)
                assert server.stop() == 0
            made[model] = EightBitRun(
                root=root, conversations=conversations, second_turns=second_turns, figures=figures
            )
        return made[model]

    return run


def test_quantized_snapshots_hold_more_conversations_and_survive_a_restart(
    wide: Path, eight_bit_run: Callable[[Path], EightBitRun], cache_dir: Path, tmp_path: Path
) -> None:
    first = eight_bit_run(wide)
    assert_warm(first.second_turns)
    figures = first.figures
    conversations = first.copy_to(tmp_path)
    assert (figures["snapshot_bits"], figures["snapshot_group_size"]) == (8, 64)
    # Every conversation's latest state in memory, in a budget that holds two as computed: nothing left for the disk.
    assert figures["snapshot_memory_entries"] >= CONVERSATIONS, figures
    assert figures["snapshot_evictions_lru"] == figures["snapshot_disk_hits"] == 0, figures
    assert figures["snapshot_bytes"] <= figures["snapshot_capacity_bytes"] == 1024**2
    assert 3 * figures["snapshot_bytes_per_entry"] < 2048 * conversations.last_prompt[0]  # ~3.3x under computed
    with serving(wide, cache_dir, tmp_path, "--prompt-cache-bits", "8") as server, server.openai_client() as client:
        adopted = stats(server)["snapshot_disk_adopted"]
        assert_warm(conversations.turn(client, server))  # read back from disk, dequantized into the batch
        figures = settled(server)
        assert server.stop() == 0
    assert adopted >= CONVERSATIONS
    assert figures["snapshot_disk_hits"] >= CONVERSATIONS
    assert figures["snapshot_disk_read_errors"] == 0 and not any(figures["snapshot_disk_files_rejected"].values())


def test_other_bits_start_a_directory_of_their_own(
    wide_dense: Path, eight_bit_run: Callable[[Path], EightBitRun], cache_dir: Path, tmp_path: Path
) -> None:
    conversations = eight_bit_run(wide_dense).copy_to(tmp_path)  # an 8-bit server's directory, stopped cleanly
    (eight,) = directories(tmp_path)
    written = sorted(path.name for path in eight.glob("*.snap"))
    assert written
    with serving(wide_dense, cache_dir, tmp_path, "--prompt-cache-bits", "4") as server:
        (four,) = directories(tmp_path) - {eight}
        for path in eight.glob("*.snap"):  # the 8-bit files, copied where a 4-bit server looks
            shutil.copy(path, four / path.name)
        assert server.stop() == 0
    with (
        serving(wide_dense, cache_dir, tmp_path, "--prompt-cache-bits", "4") as server,
        server.openai_client() as client,
    ):
        first = stats(server)
        turns = conversations.turn(client, server)
        assert server.stop() == 0
    # Signed under the 8-bit directory's key: not this directory's files, deleted and counted; the turns start cold.
    assert first["snapshot_disk_adopted"] == 0
    assert first["snapshot_disk_files_rejected"]["unauthenticated"] == len(written)
    assert all(cached < previous - GENERATION_PROMPT for previous, cached in turns)
    assert sorted(path.name for path in eight.glob("*.snap")) == written  # the 8-bit directory left as it was
    with serving(wide_dense, cache_dir, tmp_path) as server:  # as computed: a third directory
        assert stats(server)["snapshot_bits"] is None
        assert len(directories(tmp_path)) == 3
        assert server.stop() == 0


def test_a_group_size_the_head_dimension_does_not_allow_stops_the_server(tiny_llama_dir: Path, cache_dir: Path) -> None:
    """The tiny llama's heads are 16 wide: no group size MLX supports divides them."""
    args = ["--model", str(tiny_llama_dir), "--cache-dir", str(cache_dir), "--prompt-cache-bits", "8"]
    with running_server(args, wait_ready=False) as server:
        code = server.wait_exit()
    assert code != 0
    assert "--prompt-cache-group-size 64 does not divide the model's attention head dimension (16)" in server.log()


def test_of_several_models_one_whose_heads_the_group_does_not_divide_fails_its_load_alone(
    wide_dense: Path, tiny_llama_dir: Path, cache_dir: Path, tmp_path: Path
) -> None:
    """The setting is the server's; a model it cannot apply to is that model's failure, told to its requests."""
    args = ["--model", f"wide={wide_dense}", "--model", f"narrow={tiny_llama_dir}", "--cache-dir", str(cache_dir)]
    args += ["--prompt-cache-dir", str(tmp_path), "--prompt-cache-bits", "8"]
    with running_server(args) as server, server.http() as http:
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        assert http.post("/v1/chat/completions", json={**body, "model": "wide"}).status_code == 200
        refused = http.post("/v1/chat/completions", json={**body, "model": "narrow"})
        assert refused.status_code == 503
        error = refused.json()["error"]
        assert error["code"] == "model_load_failed"
        assert "does not divide the model's attention head dimension (16)" in error["message"]
        assert http.post("/v1/chat/completions", json={**body, "model": "wide"}).status_code == 200
        assert stats(server)["snapshot_bits"] == 8
        assert server.stop() == 0
    assert "loading model narrow failed unexpectedly" not in server.log()
