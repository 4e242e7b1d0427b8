"""TokenCounterActor with the real SmolLM2 tokenizer, asked over real streams."""

from __future__ import annotations

from collections.abc import AsyncIterator
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import pytest
from anyio.streams.memory import MemoryObjectSendStream
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import load_tokenizer
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from courier.actors.token_counter import TokenCounterActor
from courier.core.failure_codes import FailureCode
from courier.core.template_options import NO_OPTIONS, TemplateOptions
from courier.messages.base import FailureKind, RequestFailed
from courier.messages.token_counter import (
    Detokenize,
    DetokenizeReply,
    DetokenizeResult,
    TokenCounterMessage,
    TokenizeChat,
    TokenizeReply,
    TokenizeResult,
    TokenizeText,
)
from courier.runtime.actor import ask
from courier.runtime.faults import FaultCounter
from courier.runtime.trace_attributes import TEMPLATE_LEFT_OUT
from courier.status.tokenizer_stats import TokenizerStats

Outbox = MemoryObjectSendStream[TokenCounterMessage]


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path) -> TokenizerWrapper:
    return load_tokenizer(smollm2_dir)


@pytest.fixture
async def outbox(tokenizer: TokenizerWrapper) -> AsyncIterator[Outbox]:
    send, receive = anyio.create_memory_object_stream[TokenCounterMessage](8)
    async with anyio.create_task_group() as task_group:
        await task_group.start(TokenCounterActor(tokenizer).run, receive)
        yield send
        send.close()


async def tokenize_chat(outbox: Outbox, messages: list[dict[str, Any]]) -> TokenizeResult | RequestFailed:
    return await ask(
        outbox, lambda reply: TokenizeChat(messages=messages, tools=None, add_generation_prompt=True, reply=reply)
    )


@pytest.mark.anyio
async def test_tokenize_text_matches_the_tokenizer(outbox: Outbox, tokenizer: TokenizerWrapper) -> None:
    reply: TokenizeReply = await ask(
        outbox, lambda r: TokenizeText(text="Hello world", add_special_tokens=True, reply=r)
    )
    assert reply == TokenizeResult(tokens=tuple(tokenizer.encode("Hello world")))


@pytest.mark.anyio
async def test_tokenize_chat_renders_the_template(outbox: Outbox, tokenizer: TokenizerWrapper) -> None:
    reply = await tokenize_chat(outbox, [{"role": "user", "content": "What is the capital of France?"}])
    assert isinstance(reply, TokenizeResult)
    text = tokenizer.decode(list(reply.tokens))
    assert text.startswith("<|im_start|>system\n")
    assert text.endswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.anyio
async def test_template_failure_fails_only_that_request(outbox: Outbox) -> None:
    failed = await tokenize_chat(outbox, [{"role": "user"}])
    assert isinstance(failed, RequestFailed)
    assert (failed.kind, failed.param) == (FailureKind.INVALID_REQUEST, "messages[0]")
    assert failed.message.startswith("messages[0]: the model's chat template cannot render this message (")
    ok = await tokenize_chat(outbox, [{"role": "user", "content": "still serving?"}])
    assert isinstance(ok, TokenizeResult)


@pytest.mark.anyio
async def test_detokenize_round_trip_and_out_of_range_ids(outbox: Outbox, tokenizer: TokenizerWrapper) -> None:
    ids = tuple(tokenizer.encode("round trip"))
    round_trip: DetokenizeReply = await ask(outbox, lambda r: Detokenize(tokens=ids, reply=r))
    assert round_trip == DetokenizeResult(text="round trip")
    failed: DetokenizeReply = await ask(outbox, lambda r: Detokenize(tokens=(1, 49152, -1), reply=r))
    assert isinstance(failed, RequestFailed)
    assert failed.param == "tokens"
    assert "49152" in failed.message


@pytest.mark.anyio
async def test_each_message_is_handled_in_a_named_span(outbox: Outbox, span_exporter: InMemorySpanExporter) -> None:
    reply: TokenizeReply = await ask(outbox, lambda r: TokenizeText(text="x", add_special_tokens=False, reply=r))
    assert isinstance(reply, TokenizeResult)
    assert "token_counter.TokenizeText" in [span.name for span in span_exporter.get_finished_spans()]


@pytest.mark.anyio
async def test_an_advisory_effort_the_template_cannot_take_is_named_on_the_span(
    outbox: Outbox, span_exporter: InMemorySpanExporter
) -> None:
    """SmolLM2's template reads no `reasoning_effort`: Anthropic's effort is served without, and the span says so."""
    messages = [{"role": "user", "content": "Hello"}]
    effort = TemplateOptions(reasoning_effort="high", effort_param="output_config.effort", effort_advisory=True)
    plain, advised = [
        await ask(
            outbox,
            lambda r, o=options: TokenizeChat(  # type: ignore[misc]
                messages=messages, tools=None, add_generation_prompt=True, reply=r, options=o
            ),
        )
        for options in (NO_OPTIONS, effort)
    ]
    assert isinstance(plain, TokenizeResult) and isinstance(advised, TokenizeResult)
    assert advised.tokens == plain.tokens
    left_out = [
        tuple(span.attributes[TEMPLATE_LEFT_OUT])  # type: ignore[arg-type]
        for span in span_exporter.get_finished_spans()
        if span.attributes is not None and TEMPLATE_LEFT_OUT in span.attributes
    ]
    assert left_out == [("output_config.effort",)]


class CountingTokenizer:
    """The real tokenizer, counting what it is asked to encode or render."""

    def __init__(self, tokenizer: TokenizerWrapper) -> None:
        self._tokenizer = tokenizer
        self.calls = 0

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._tokenizer, name)
        if name in ("encode", "apply_chat_template"):
            self.calls += 1
        return attribute


@pytest.mark.anyio
async def test_a_text_too_big_for_the_context_is_refused_without_being_tokenized(tokenizer: TokenizerWrapper) -> None:
    counting = CountingTokenizer(tokenizer)
    longest = max(len(entry.encode()) for entry in tokenizer.get_vocab())
    huge = "word " * (64 * longest // 5 + 1)  # more bytes than 64 tokens of the longest entry could hold
    send, receive = anyio.create_memory_object_stream[TokenCounterMessage](8)
    async with anyio.create_task_group() as task_group:
        await task_group.start(TokenCounterActor(counting).run, receive)
        with send:
            text: TokenizeReply = await ask(
                send, lambda r: TokenizeText(text=huge, add_special_tokens=True, max_tokens=64, reply=r)
            )
            chat: TokenizeReply = await ask(
                send,
                lambda r: TokenizeChat(
                    messages=[{"role": "user", "content": huge}],
                    tools=None,
                    add_generation_prompt=True,
                    max_tokens=64,
                    reply=r,
                ),
            )
            assert counting.calls == 0  # refused by size alone
            fits: TokenizeReply = await ask(
                send, lambda r: TokenizeText(text="word " * 10, add_special_tokens=True, max_tokens=64, reply=r)
            )
    for refused, param in ((text, "prompt"), (chat, "messages")):
        assert isinstance(refused, RequestFailed)
        assert (refused.code, refused.param) == (FailureCode.CONTEXT_LENGTH_EXCEEDED, param)
        assert "bytes" in refused.message
    assert isinstance(fits, TokenizeResult) and counting.calls == 1


@pytest.mark.anyio
async def test_a_render_that_raises_unexpectedly_fails_that_request_only(smollm2_dir: Path) -> None:
    """A chat template raising what no handler expects: the runtime answers 500 and the counter serves on."""
    tokenizer = load_tokenizer(smollm2_dir)
    tokenizer._tokenizer.chat_template = "{{ messages[0]['content'] | int / 0 }}"  # ZeroDivisionError
    faults = FaultCounter()
    send, receive = anyio.create_memory_object_stream[TokenCounterMessage](8)
    async with anyio.create_task_group() as task_group:
        await task_group.start(partial(TokenCounterActor(tokenizer).run, faults=faults), receive)
        with send:
            failed = await tokenize_chat(send, [{"role": "user", "content": "1"}])
            served: TokenizeReply = await ask(
                send, lambda r: TokenizeText(text="still here", add_special_tokens=False, reply=r)
            )
    assert isinstance(failed, RequestFailed)
    assert (failed.kind, failed.code) == (FailureKind.INTERNAL, FailureCode.INTERNAL_ERROR)
    assert faults.by_actor() == {"token_counter": 1}
    assert isinstance(served, TokenizeResult)


BILLING = "x-anthropic-billing-header: cc_version=2.1.197.c40; cc_entrypoint=sdk-cli;"


@pytest.mark.parametrize("normalize", [True, False], ids=["normalized", "opted-out"])
@pytest.mark.anyio
async def test_a_volatile_system_prompt_line_is_left_out_unless_opted_out(
    tokenizer: TokenizerWrapper, normalize: bool
) -> None:
    """Claude Code's billing line (another value per conversation) never reaches the template, the history's render
    (the snapshot boundary) included; `--no-prompt-cache-normalize` keeps every byte."""
    messages = [{"role": "system", "content": f"{BILLING}\nYou are an agent."}, {"role": "user", "content": "Hi"}]
    send, receive = anyio.create_memory_object_stream[TokenCounterMessage](8)
    async with anyio.create_task_group() as task_group:
        await task_group.start(TokenCounterActor(tokenizer, normalize=normalize).run, receive)
        with send:
            reply: TokenizeReply = await ask(
                send,
                lambda r: TokenizeChat(
                    messages=messages, tools=None, add_generation_prompt=True, with_history_boundary=True, reply=r
                ),
            )
    assert isinstance(reply, TokenizeResult)
    text = tokenizer.decode(list(reply.tokens))
    system = "You are an agent." if normalize else f"{BILLING}\nYou are an agent."
    assert text.startswith(f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n")
    assert tokenizer.decode(list(reply.tokens[: reply.history_boundary])).startswith(f"<|im_start|>system\n{system}")


def _conversation(turns: int) -> list[dict[str, Any]]:
    system = {"role": "system", "content": "You are a careful agent. " * 600}  # past a few reuse checkpoints
    history: list[dict[str, Any]] = [system]
    for turn in range(turns):
        history += [
            {"role": "user", "content": f"Step {turn}: list the files under src/{turn}/."},
            {"role": "assistant", "content": f"src/{turn}/main.py\nsrc/{turn}/util.py"},
        ]
    return history


def _reused(span_exporter: InMemorySpanExporter) -> list[int]:
    spans = [span for span in span_exporter.get_finished_spans() if span.name == "token_counter.TokenizeChat"]
    return [int(str((span.attributes or {})["courier.tokenize.reused_tokens"])) for span in spans]


@pytest.mark.parametrize("remember", [True, False], ids=["prompt-cache", "no-prompt-cache"])
@pytest.mark.anyio
async def test_a_later_turn_reuses_its_tenants_earlier_render_and_no_one_elses(
    tokenizer: TokenizerWrapper, span_exporter: InMemorySpanExporter, remember: bool
) -> None:
    """A conversation's next turn takes the tokens its last render shares (the trace says how many), for the tenant
    that sent it only, and nothing between requests without the prompt cache; the tokens are always the
    tokenizer's own, and so is the history boundary."""
    send, receive = anyio.create_memory_object_stream[TokenCounterMessage](8)
    asked: list[tuple[str | None, list[dict[str, Any]]]] = [
        ("tenant-a", _conversation(1)),
        ("tenant-a", _conversation(2)),  # the same conversation a turn later
        ("tenant-b", _conversation(2)),  # the same text, another tenant
        (None, _conversation(3)),  # a request that opted out of the prompt cache
    ]
    replies: list[TokenizeReply] = []
    async with anyio.create_task_group() as task_group:
        stats = TokenizerStats()
        await task_group.start(TokenCounterActor(tokenizer, remember_renders=remember, stats=stats).run, receive)
        with send:
            for scope, messages in asked:
                replies.append(
                    await ask(
                        send,
                        lambda r, m=messages, s=scope: TokenizeChat(  # type: ignore[misc]
                            messages=m,
                            tools=None,
                            add_generation_prompt=True,
                            with_history_boundary=True,
                            reuse_scope=s,
                            reply=r,
                        ),
                    )
                )
    for (_, messages), reply in zip(asked, replies, strict=True):
        assert isinstance(reply, TokenizeResult)
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        history = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
        assert list(reply.tokens) == tokenizer.encode(text, add_special_tokens=False)
        history_tokens = tokenizer.encode(history, add_special_tokens=False)
        assert list(reply.tokens[: reply.history_boundary]) == history_tokens[: reply.history_boundary]
        assert reply.history_boundary >= len(history_tokens) - 1
    first, later, other_tenant, opted_out = _reused(span_exporter)
    assert first == 0 and other_tenant == 0 and opted_out == 0
    assert later > 0.9 * len(replies[1].tokens) if remember else later == 0  # type: ignore[union-attr]
    # /metrics' figures: every render counted, the reuse, and what is kept (the three with a scope, if any).
    tokens = sum(len(reply.tokens) for reply in replies if isinstance(reply, TokenizeResult))
    assert (stats.renders, stats.tokens, stats.reused_tokens) == (4, tokens, later)
    assert stats.kept_renders == (3 if remember else 0) and (stats.kept_bytes > 0) == remember
