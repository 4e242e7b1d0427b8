"""The prompt cache's disk tier through the real server: conversations that no longer fit in memory, a restart (clean
or `kill -9`), corrupt and foreign files, and a full disk, on a dense (trimmable) and a hybrid (not trimmable) model."""

from __future__ import annotations

import copy
import shutil
import signal
import stat
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import orjson
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.support.polling import attempts
from tests.support.server import RunningServer, running_server

GENERATION_PROMPT = 3  # "<|im_start|>assistant\n": only a trimmable cache can skip it
# A tiny model's conversation snapshot here is ~130-150 KB: memory holds two, so six conversations need the disk.
MEMORY_BUDGET = "320KiB"
DISK_BUDGET = "64MiB"
CONVERSATIONS = 6


@pytest.fixture(scope="module", params=["dense", "hybrid"])
def model(request: pytest.FixtureRequest) -> Path:
    directory: Path = request.getfixturevalue("tiny_llama_dir" if request.param == "dense" else "tiny_qwen3_next_dir")
    return directory


@contextmanager
def serving(
    model: Path, cache_dir: Path, prompt_cache_dir: Path, *extra: str, **options: Any
) -> Iterator[RunningServer]:
    args = [
        "--model",
        str(model),
        "--cache-dir",
        str(cache_dir),
        "--served-model-name",
        "tiny",
        "--prompt-cache-dir",
        str(prompt_cache_dir),
        "--prompt-cache-snapshot-capacity-bytes",
        MEMORY_BUDGET,
        "--prompt-cache-disk-bytes",
        DISK_BUDGET,
        *extra,
    ]
    with running_server(args, **options) as running:
        yield running


def stats(server: RunningServer) -> dict[str, Any]:
    with server.http() as http:
        figures: dict[str, Any] = http.get("/v1/cache/stats").json()
        return figures


def settled(server: RunningServer) -> dict[str, Any]:
    """Stats once every idle warm-up has run and the disk has done all it was asked (polled, never slept)."""
    for _ in attempts():
        figures = stats(server)
        warmups_done = figures["snapshot_warmups_run"] + figures["snapshot_warmups_skipped"]
        if (
            warmups_done == figures["snapshot_warmups_queued"]
            and figures["snapshot_warmups_pending"] == 0
            and figures["snapshot_disk_pending"] == 0
        ):
            return figures
    raise AssertionError(f"the cache never settled: {figures}")


class Conversations:
    """CONVERSATIONS conversations, each with its own customer and session, advanced one turn at a time."""

    def __init__(self, count: int = CONVERSATIONS) -> None:
        self.histories: list[list[ChatCompletionMessageParam]] = [
            [{"role": "system", "content": f"Customer {index} of the shop. " + "Answer with care. " * 30}]
            for index in range(count)
        ]
        self.last_prompt: list[int] = [0] * count

    def turn(self, client: openai.OpenAI, settle: RunningServer | None = None) -> list[tuple[int, int, int]]:
        """One more turn of every conversation, interleaved: (previous prompt, prompt, cached) per conversation. With
        `settle`, each reply's warm-up and disk writes are done before the next conversation's turn is asked."""
        seen = []
        for index, messages in enumerate(self.histories):
            messages.append({"role": "user", "content": f"Question {len(messages)}: where is my parcel?"})
            reply = client.chat.completions.create(
                model="tiny", messages=messages, max_tokens=8, temperature=0, user=f"customer-{index}"
            )
            assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
            cached = reply.usage.prompt_tokens_details.cached_tokens or 0
            seen.append((self.last_prompt[index], reply.usage.prompt_tokens, cached))
            self.last_prompt[index] = reply.usage.prompt_tokens
            messages.append({"role": "assistant", "content": reply.choices[0].message.content or ""})
            if settle is not None:
                settled(settle)
        return seen


def assert_warm(turns: list[tuple[int, int, int]]) -> None:
    """Each turn reused at least its conversation's whole previous prompt (but the generation prompt)."""
    cold = [(previous, prompt, cached) for previous, prompt, cached in turns if cached < previous - GENERATION_PROMPT]
    assert not cold, f"turns served cold (previous prompt, prompt, cached): {cold}"


def snapshot_files(prompt_cache_dir: Path) -> list[Path]:
    return sorted(prompt_cache_dir.glob("*/*.snap"))


def test_conversations_beyond_the_memory_budget_stay_warm_on_disk(model: Path, cache_dir: Path, tmp_path: Path) -> None:
    trace_file = tmp_path / "spans.jsonl"
    prompt_cache_dir = tmp_path / "prompt-cache"
    with (
        serving(model, cache_dir, prompt_cache_dir, "--trace-file", str(trace_file)) as server,
        server.openai_client() as client,
    ):
        conversations = Conversations()
        conversations.turn(client)
        for _ in range(2):
            assert_warm(conversations.turn(client))
        figures = settled(server)
        with server.http() as http:
            metrics = http.get("/metrics").text
        assert server.stop() == 0
    assert figures["snapshot_spills"] > 0 and figures["snapshot_disk_hits"] > 0, figures
    assert figures["snapshot_disk_restores"] > 0 and figures["snapshot_disk_read_errors"] == 0, figures
    # Every conversation is held somewhere; memory holds two at most, the disk the rest (a write the busy writer
    # refused leaves an entry in memory only until memory lets go of it: then it is spilled).
    assert figures["snapshot_memory_entries"] <= 2, figures
    assert figures["snapshot_disk_entries"] >= CONVERSATIONS - figures["snapshot_memory_entries"], figures
    assert 'courier_prompt_cache_tier_hits_total{tier="disk"}' in metrics
    samples = [line.rsplit(" ", 1) for line in metrics.splitlines() if not line.startswith("#")]
    exported = {name: float(value) for name, value in samples}
    assert exported['courier_prompt_cache_tier_bytes{tier="disk"}'] == figures["snapshot_disk_bytes"]
    assert exported['courier_prompt_cache_tier_entries{tier="memory"}'] == figures["snapshot_memory_entries"]
    assert_spans_join_requests(trace_file)
    assert figures["snapshot_bytes"] <= figures["snapshot_capacity_bytes"]
    assert figures["snapshot_disk_bytes"] <= figures["snapshot_disk_capacity_bytes"]
    files = snapshot_files(prompt_cache_dir)
    assert len(files) == figures["snapshot_disk_entries"]
    assert sum(path.stat().st_size for path in files) <= figures["snapshot_disk_bytes"]
    assert {stat.S_IMODE(path.stat().st_mode) for path in files} == {0o600}
    assert stat.S_IMODE(files[0].parent.stat().st_mode) == 0o700


def assert_spans_join_requests(trace_file: Path) -> None:
    """Reading a snapshot back, and writing one behind a request, are spans in the trace of that request."""
    spans = [orjson.loads(line) for line in trace_file.read_text().splitlines()]
    requests = {span["context"]["trace_id"] for span in spans if span["name"].startswith("POST")}
    spills = [span for span in spans if span["name"] == "snapshot_store.spill"]
    restores = [span for span in spans if span["name"] == "snapshot_store.restore"]
    assert restores and {span["context"]["trace_id"] for span in restores} <= requests
    assert all(span["parent_id"] for span in restores)
    # A write behind a request is in its trace; an idle writer catching up on refused writes traces on its own.
    assert any(span["context"]["trace_id"] in requests and span["parent_id"] for span in spills)


@dataclass(frozen=True, slots=True, kw_only=True)
class CleanStop:
    """A model's prompt-cache directory as a first server left it when stopped cleanly, and the conversations it
    served: tests copy both, so each works on its own."""

    root: Path  # the --prompt-cache-dir
    directory: Path  # this model's snapshot files, under `root`
    conversations: Conversations

    def copy_to(self, root: Path) -> Conversations:
        """This directory's files in `root` (modes and times kept), and the conversations they were written for."""
        shutil.copytree(self.root, root, dirs_exist_ok=True)
        return copy.deepcopy(self.conversations)


@pytest.fixture(scope="module")
def left_by_a_clean_stop(cache_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[[Path], CleanStop]:
    """Per model, once per module: CONVERSATIONS conversations, two turns each, every reply settled before the next
    request (its files all written), then a clean stop (SIGTERM)."""
    made: dict[Path, CleanStop] = {}

    def left(model: Path) -> CleanStop:
        if model not in made:
            root = tmp_path_factory.mktemp("clean-stop")
            conversations = Conversations()
            with serving(model, cache_dir, root, "--log-level", "info") as server, server.openai_client() as client:
                # A disk slower than the requests sheds writes by design, and a conversation whose spill it refused
                # is not kept: each reply is settled before the next request.
                conversations.turn(client, settle=server)
                conversations.turn(client, settle=server)
                directory = Path(stats(server)["snapshot_disk_directory"])
                assert server.stop(signal.SIGTERM) == 0
            made[model] = CleanStop(root=root, directory=directory, conversations=conversations)
        return made[model]

    return left


def test_a_restart_keeps_every_conversation_warm_after_a_clean_stop_and_after_a_kill_9(
    model: Path, left_by_a_clean_stop: Callable[[Path], CleanStop], cache_dir: Path, tmp_path: Path
) -> None:
    """One directory through three servers: the first stopped cleanly (`left_by_a_clean_stop`), the second (on the
    first's files) killed, the third on what the kill -9 left."""
    conversations = left_by_a_clean_stop(model).copy_to(tmp_path)
    for stop in (signal.SIGKILL, signal.SIGTERM):
        with serving(model, cache_dir, tmp_path) as server, server.openai_client() as client:
            adopted = stats(server)["snapshot_disk_adopted"]
            # Settled reply by reply before the kill -9 (so the files are all written); the last server's turns are
            # not waited for.
            turns = conversations.turn(client, settle=server if stop is signal.SIGKILL else None)
            figures = settled(server)
            code = server.stop(stop)
        assert code == (0 if stop is signal.SIGTERM else -signal.SIGKILL)
        assert_warm(turns)
        assert adopted >= CONVERSATIONS
        assert figures["snapshot_disk_hits"] >= CONVERSATIONS


def test_corrupt_files_are_misses_that_are_deleted_and_counted(
    model: Path, left_by_a_clean_stop: Callable[[Path], CleanStop], cache_dir: Path, tmp_path: Path
) -> None:
    conversations = left_by_a_clean_stop(model).copy_to(tmp_path)
    damaged = snapshot_files(tmp_path)
    assert damaged
    for path in damaged:
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF  # the last byte of the last array: the header still reads, the payload digest fails
        path.write_bytes(bytes(data))
    with serving(model, cache_dir, tmp_path) as server, server.openai_client() as client:
        turns = conversations.turn(client)
        figures = settled(server)
        with server.http() as http:
            assert http.get("/health").status_code == 200
        assert server.stop() == 0
    assert [cached for _, _, cached in turns] == [0] * CONVERSATIONS  # nothing corrupt was used
    assert figures["snapshot_disk_unreadable"] >= CONVERSATIONS, figures
    assert figures["snapshot_disk_read_errors"] >= CONVERSATIONS, figures
    assert not set(damaged) & set(snapshot_files(tmp_path))  # deleted, and replaced by this run's own


def test_another_model_never_reads_these_files(
    tiny_llama_dir: Path,
    tiny_qwen3_next_dir: Path,
    left_by_a_clean_stop: Callable[[Path], CleanStop],
    cache_dir: Path,
    tmp_path: Path,
) -> None:
    """The dense model's files (`left_by_a_clean_stop`), and the hybrid's directory holding one of them: the hybrid
    server deletes that foreign file on start-up and never reads the dense model's own."""
    left_by_a_clean_stop(tiny_llama_dir).copy_to(tmp_path)
    (llama_files,) = {path.parent for path in snapshot_files(tmp_path)}
    hybrid_directory = (
        tmp_path / left_by_a_clean_stop(tiny_qwen3_next_dir).directory.name
    )  # where the hybrid model's files go
    hybrid_directory.mkdir(mode=0o700)
    planted = hybrid_directory / "planted.snap"
    shutil.copy(next(llama_files.glob("*.snap")), planted)
    conversations = Conversations(count=2)  # the same prompts as the dense model's first two conversations
    with serving(tiny_qwen3_next_dir, cache_dir, tmp_path) as server, server.openai_client() as client:
        figures = stats(server)
        turns = conversations.turn(client)
        assert server.stop() == 0
    assert Path(figures["snapshot_disk_directory"]) == hybrid_directory != llama_files
    assert figures["snapshot_disk_adopted"] == 0
    assert "1 unreadable files deleted" in server.log()
    assert not planted.exists()
    assert [cached for _, _, cached in turns] == [0, 0]
    assert len(list(llama_files.glob("*.snap"))) >= 2  # the other model's files are left alone


def test_a_second_server_on_the_same_directory_runs_memory_only(
    tiny_llama_dir: Path, cache_dir: Path, tmp_path: Path
) -> None:
    """The lock is the directory's, whatever model is served: the dense model alone."""
    with serving(tiny_llama_dir, cache_dir, tmp_path) as first, serving(tiny_llama_dir, cache_dir, tmp_path) as second:
        assert stats(first)["snapshot_disk_directory"]
        assert stats(second)["snapshot_disk_directory"] == ""
        assert "in use by another Courier process" in second.log()
        assert second.stop() == 0 and first.stop() == 0


def in_a_small_tmpfs(directory: Path, size: str) -> Any:
    def launch(command: list[str]) -> list[str]:
        script = f'mount -t tmpfs -o size={size} tmpfs "{directory}" && exec "$@"'
        return ["unshare", "--map-root-user", "--mount", "sh", "-c", script, "sh", *command]

    return launch


def test_a_full_disk_degrades_to_memory_only_with_a_warning(model: Path, cache_dir: Path, tmp_path: Path) -> None:
    disk = tmp_path / "small"
    disk.mkdir()
    probe = in_a_small_tmpfs(disk, "200k")(["true"])
    if shutil.which("unshare") is None or subprocess.run(probe, capture_output=True, check=False).returncode != 0:
        pytest.skip("needs unshare (util-linux) and user namespaces to mount a small tmpfs in a private namespace")
    with serving(model, cache_dir, disk, launcher=in_a_small_tmpfs(disk, "200k")) as server:
        with server.openai_client() as client:
            conversations = Conversations(count=2)
            conversations.turn(client)
            turns = conversations.turn(client)
        figures = settled(server)
        with server.http() as http:
            assert http.get("/health").status_code == 200
        assert server.stop() == 0
    assert "is full; snapshots stay in memory only" in server.log()
    assert figures["snapshot_disk_write_errors"] > 0
    assert_warm(turns)  # two conversations fit in memory: the disk's failure costs nothing here
