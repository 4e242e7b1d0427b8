"""Reading a step's output: each sequence's new tokens as text and events (the role vLLM's output processor plays).

The generator gives tokens; a reply is text with its stop strings and end-of-sequence tokens taken out, optional
logprobs, and exactly one finish. Tokens that add no text yet (part of a character, the start of a stop string) go
out with the next event. A sequence that ends leaves the registry here, after its completion snapshot is taken. A
sequence cut at its deadline ends here too, as a length cut with what it wrote, and so does one whose grammar could
not go on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

import mlx.core as mx
from mlx_lm.tokenizer_utils import TokenizerWrapper

from courier.core.failure_codes import FailureCode
from courier.core.prompt_cache.quantization import KvQuantization
from courier.engine.engine_io import EngineOutput
from courier.engine.generation import (
    FinishReason,
    GenerationEvent,
    GenerationFailed,
    GenerationFinished,
    TokenLogprob,
    TokensGenerated,
)
from courier.engine.sequences import RunningSequence, Sequences
from courier.engine.speculative_batch import StepResponse
from courier.engine.step_snapshots import completion_snapshot

DEADLINE_BEFORE_FIRST_TOKEN = "the request reached its deadline (--request-timeout) before its first token"


@dataclass(slots=True)
class _StepRead:
    """What a step's tokens for one sequence read as: text, token ids and logprobs to send, and how it ends."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    reason: FinishReason | None = None
    stopped_early: bool = False  # a stop string ended it before the generator's own end


class StepReader:
    def __init__(
        self,
        tokenizer: TokenizerWrapper,
        eos: frozenset[int],
        sequences: Sequences,
        quantization: KvQuantization | None = None,
    ) -> None:
        self._tokenizer = tokenizer
        self._eos = eos
        self._sequences = sequences
        self._quantization = quantization  # how completion snapshots store attention KV

    def advance(self, sequence: RunningSequence, response: Any, generator: Any) -> list[EngineOutput]:
        """A step's tokens for one sequence (one, or several from a verified draft), as one event; and its finish
        when it ended (a stop string it wrote leaves `generator` here)."""
        read = self._read(sequence, response, generator)
        text, token_ids, logprobs, reason = read.text, read.token_ids, read.logprobs, read.reason
        finish = response.finish_reason if not read.stopped_early else None
        request_id = sequence.request.request_id
        outputs: list[EngineOutput] = []
        choice = sequence.request.choice
        if text or logprobs:
            token_ids, sequence.unsent_ids = [*sequence.unsent_ids, *token_ids], []
            generated = TokensGenerated(text=text, token_ids=tuple(token_ids), logprobs=tuple(logprobs), choice=choice)
            outputs.append(EngineOutput(request_id, generated))
        else:
            sequence.unsent_ids.extend(token_ids)
        if reason is None:
            return outputs
        if sequence.request.snapshots and finish is not None:
            taken = completion_snapshot(sequence, response, self._quantization)
            if taken is not None:
                outputs.append(EngineOutput(request_id, taken))
        self._sequences.remove(sequence)
        outputs.append(EngineOutput(request_id, _finished(sequence, reason)))
        return outputs

    def _read(self, sequence: RunningSequence, response: Any, generator: Any) -> _StepRead:
        """Detokenize a step's tokens, with stop strings and end-of-sequence tokens taken out."""
        tokens, vectors = _step_tokens(response)
        if isinstance(response, StepResponse):
            sequence.drafted += response.drafted
            sequence.accepted += response.accepted
            sequence.forced += response.forced
        finish = response.finish_reason
        read = _StepRead()
        pieces: list[str] = []
        for index, (token, vector) in enumerate(zip(tokens, vectors, strict=True)):
            ends = finish if index == len(tokens) - 1 else None  # the generator's finish is its last token's
            sequence.generated += 1
            sequence.token_ids.append(token)
            ended_by_eos = ends == "stop" and token in self._eos
            text = ""
            if not ended_by_eos:
                sequence.detokenizer.add_token(token)
                text = sequence.detokenizer.last_segment
                read.token_ids.append(token)
                read.logprobs.extend(self._logprobs(sequence, token, vector))
            if ends is not None:
                sequence.detokenizer.finalize()
                text += sequence.detokenizer.last_segment
            scan = sequence.stop.feed(text)
            pieces.append(scan.text)
            if scan.stopped:
                read.reason = FinishReason.STOP
                if finish is None:
                    generator.remove([sequence.uid])
                else:
                    read.stopped_early = True  # before the generator's end: no completion snapshot past the stop
                break
            if ends is not None:
                pieces.append(sequence.stop.flush())
                stopped = ends == "stop" and not _grammar_failed(sequence)  # a grammar that failed ended it: a cut
                read.reason = FinishReason.STOP if stopped else FinishReason.LENGTH
        read.text = "".join(pieces)
        return read

    def _logprobs(self, sequence: RunningSequence, token: int, logprobs: mx.array) -> tuple[TokenLogprob, ...]:
        sampling = sequence.request.sampling
        if not sampling.logprobs:
            return ()
        top: tuple[tuple[int, str, float], ...] = ()
        if sampling.top_logprobs > 0:
            count = min(sampling.top_logprobs, logprobs.shape[-1])
            indices = mx.argpartition(-logprobs, count - 1)[:count]
            values = logprobs[indices]
            order = mx.argsort(-values)
            top_ids = cast("list[int]", indices[order].tolist())
            top_values = cast("list[float]", values[order].tolist())
            top = tuple((index, self._piece(index), value) for index, value in zip(top_ids, top_values, strict=True))
        chosen = cast("float", logprobs[token].item())
        entry = TokenLogprob(token_id=token, token=self._piece(token), logprob=chosen, top=top)
        return (entry,)

    def _piece(self, token: int) -> str:
        return str(self._tokenizer.decode([token]))


def cut_at_deadline(sequence: RunningSequence) -> list[GenerationEvent]:
    """The end of a sequence past its deadline (already out of the batch): a length cut with what it wrote, the
    text its detokenizer and stop matcher still held included; a failure if it wrote nothing yet."""
    choice = sequence.request.choice
    if sequence.generated == 0:
        return [
            GenerationFailed(message=DEADLINE_BEFORE_FIRST_TOKEN, code=FailureCode.DEADLINE_EXCEEDED, choice=choice)
        ]
    sequence.detokenizer.finalize()
    scan = sequence.stop.feed(sequence.detokenizer.last_segment)
    text = scan.text if scan.stopped else scan.text + sequence.stop.flush()
    events: list[GenerationEvent] = []
    if text or sequence.unsent_ids:
        events.append(TokensGenerated(text=text, token_ids=tuple(sequence.unsent_ids), choice=choice))
    return [*events, _finished(sequence, FinishReason.LENGTH, deadline=True)]


def _finished(sequence: RunningSequence, reason: FinishReason, *, deadline: bool = False) -> GenerationFinished:
    return GenerationFinished(
        reason=reason,
        prompt_tokens=len(sequence.request.prompt_tokens),
        completion_tokens=sequence.generated,
        cached_tokens=sequence.cached_tokens,
        choice=sequence.request.choice,
        cache_write_tokens=sequence.cache_write_tokens,
        drafted_tokens=sequence.drafted,
        accepted_tokens=sequence.accepted,
        forced_tokens=sequence.forced,
        deadline=deadline,
    )


def _grammar_failed(sequence: RunningSequence) -> bool:
    """Whether its grammar could not go on (`engine/constrained.py`): its reply ended short of what the grammar
    asks, so it is reported as cut, never as a stop with partial text."""
    return sequence.constrained is not None and bool(sequence.constrained.failure)


def _step_tokens(response: Any) -> tuple[list[int], list[mx.array]]:
    """A generator response's tokens and their logprobs vectors (mlx-lm's carries one, a speculative one several)."""
    if isinstance(response, StepResponse):
        return response.tokens, response.logprobs
    return [int(response.token)], [response.logprobs]
