"""The batch engine: continuous batching over mlx-lm's `BatchGenerator`, on the MLX thread only.

Each `step` admits new requests into the running batch, drops cancelled ones,
advances every sequence by one decode token (and new ones by one prefill chunk),
and turns the raw tokens into events: detokenized text with stop strings and
end-of-sequence tokens removed, optional logprobs, and a finish when a sequence
ends. A failure inside the batched forward pass fails the requests that were in
the batch and starts a fresh generator, so the engine keeps serving.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, cast

import mlx.core as mx
from mlx_lm.generate import BatchGenerator
from mlx_lm.tokenizer_utils import TokenizerWrapper

from courier.core.model_state import CachedPrefix, compact_copy, resume
from courier.core.sampling import build_sampler
from courier.core.snapshot_store import Origin
from courier.core.stop_text import StopTextMatcher
from courier.messages.base import RequestId
from courier.messages.generation import (
    FinishReason,
    GenerationEvent,
    GenerationFailed,
    GenerationFinished,
    SamplingParams,
    TokenLogprob,
    TokensGenerated,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineRequest:
    request_id: RequestId
    prompt_tokens: tuple[int, ...]
    sampling: SamplingParams
    prefix: CachedPrefix | None = None
    # Where the conversation's history ends in the prompt: a boundary snapshot is taken there (0: none).
    boundary: int = 0
    snapshots: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class SnapshotTaken:
    """A private copy of a sequence's model state after `tokens` (for the snapshot store)."""

    origin: Origin
    tokens: tuple[int, ...]
    state: Any
    nbytes: int
    continues: int | None = None
    prompt_length: int | None = None  # for a completion: how many of `tokens` were the prompt


@dataclass(frozen=True, slots=True)
class EngineOutput:
    request_id: RequestId
    event: GenerationEvent | SnapshotTaken


@dataclass(frozen=True, slots=True, kw_only=True)
class BatchLimits:
    max_batch: int
    prefill_batch: int
    prefill_step_size: int


@dataclass(slots=True, kw_only=True)
class _Sequence:
    request: EngineRequest
    uid: int
    detokenizer: Any
    stop: StopTextMatcher
    cached_tokens: int = 0
    generated: int = 0


class BatchEngine:
    def __init__(self, model: Any, tokenizer: TokenizerWrapper, limits: BatchLimits) -> None:
        self._model = model
        self._tokenizer = tokenizer
        self._limits = limits
        self._eos = frozenset(int(token) for token in tokenizer.eos_token_ids)
        # The calling thread's own default stream: the engine is built and stepped on the MLX thread, and a
        # stream created on another thread (mlx-lm's module-level one) costs a cross-thread sync every step.
        self._stream = mx.default_stream(mx.default_device())
        self._generator = self._new_generator()
        self._by_uid: dict[int, _Sequence] = {}
        self._uid_by_request: dict[RequestId, int] = {}

    @property
    def model(self) -> Any:
        return self._model

    @property
    def active(self) -> int:
        return len(self._by_uid)

    def step(self, added: Sequence[EngineRequest], cancelled: Sequence[RequestId]) -> list[EngineOutput]:
        outputs: list[EngineOutput] = []
        for request in added:
            outputs.extend(self._admit(request))
        self._cancel(cancelled)
        if not self._by_uid:
            return outputs
        try:
            prompt_responses, responses = self._generator.next()
        except Exception as error:  # a fault in the batched forward pass: fail this batch, keep serving
            logger.exception("generation step failed; failing %d requests", len(self._by_uid))
            return outputs + self._fail_all(f"generation failed: {type(error).__name__}: {error}")
        outputs.extend(self._boundary_snapshots(prompt_responses))
        for response in responses:
            sequence = self._by_uid.get(response.uid)
            if sequence is not None:
                outputs.extend(self._advance(sequence, response))
        return outputs

    def _new_generator(self) -> BatchGenerator:
        return BatchGenerator(
            self._model,
            stop_tokens=[[token] for token in self._eos],
            completion_batch_size=self._limits.max_batch,
            prefill_batch_size=self._limits.prefill_batch,
            prefill_step_size=self._limits.prefill_step_size,
            stream=self._stream,
        )

    def _admit(self, request: EngineRequest) -> list[EngineOutput]:
        sampling = request.sampling
        prompt = list(request.prompt_tokens)
        start, cache = resume(request.prefix, len(prompt))
        segments = [prompt[start:]]
        if start < request.boundary < len(prompt):
            segments = [prompt[start : request.boundary], prompt[request.boundary :]]
        try:
            sampler = build_sampler(sampling.temperature, sampling.top_p, sampling.seed)
            (uid,) = self._generator.insert_segments(
                [segments],
                max_tokens=[sampling.max_tokens],
                caches=[cache] if cache is not None else None,
                all_tokens=[prompt[:start]] if cache is not None else None,
                samplers=[sampler],
            )
        except (ValueError, TypeError) as error:
            return [EngineOutput(request.request_id, GenerationFailed(message=f"cannot start generation: {error}"))]
        self._by_uid[uid] = _Sequence(
            request=request,
            uid=uid,
            detokenizer=self._tokenizer.detokenizer,
            stop=StopTextMatcher(sampling.stop),
            cached_tokens=start,
        )
        self._uid_by_request[request.request_id] = uid
        if request.snapshots and cache is not None and start >= request.boundary > 0:
            # Started at or past its history boundary from another session's (or an older) snapshot: keep that
            # state for this conversation too, or its next turn would find nothing of its own to extend.
            return [EngineOutput(request.request_id, _snapshot(Origin.BOUNDARY, prompt[:start], cache))]
        return []

    def _cancel(self, request_ids: Sequence[RequestId]) -> None:
        uids = [uid for request_id in request_ids if (uid := self._uid_by_request.pop(request_id, None)) is not None]
        if uids:
            self._generator.remove(uids)
            for uid in uids:
                del self._by_uid[uid]

    def _advance(self, sequence: _Sequence, response: Any) -> list[EngineOutput]:
        token = int(response.token)
        sequence.generated += 1
        finish = response.finish_reason
        ended_by_eos = finish == "stop" and token in self._eos
        text = ""
        if not ended_by_eos:
            sequence.detokenizer.add_token(token)
            text = sequence.detokenizer.last_segment
        if finish is not None:
            sequence.detokenizer.finalize()
            text += sequence.detokenizer.last_segment
        scan = sequence.stop.feed(text)
        text = scan.text
        reason: FinishReason | None = None
        if scan.stopped:
            reason = FinishReason.STOP
            if finish is None:
                self._generator.remove([sequence.uid])
        elif finish is not None:
            text += sequence.stop.flush()
            reason = FinishReason.STOP if finish == "stop" else FinishReason.LENGTH
        logprobs = self._logprobs(sequence, token, response.logprobs) if not ended_by_eos else ()
        request_id = sequence.request.request_id
        outputs: list[EngineOutput] = []
        if text or logprobs:
            outputs.append(EngineOutput(request_id, TokensGenerated(text=text, token_ids=(token,), logprobs=logprobs)))
        if reason is not None:
            if sequence.request.snapshots and response.prompt_cache is not None and response.all_tokens:
                snapshot = _snapshot(Origin.COMPLETION, response.all_tokens, response.prompt_cache)
                prefix = sequence.request.prefix
                continues = prefix.continues if prefix is not None else None
                prompt_length = len(sequence.request.prompt_tokens)
                snapshot = replace(snapshot, continues=continues, prompt_length=prompt_length)
                outputs.append(EngineOutput(request_id, snapshot))
            self._forget(sequence)
            finished = GenerationFinished(
                reason=reason,
                prompt_tokens=len(sequence.request.prompt_tokens),
                completion_tokens=sequence.generated,
                cached_tokens=sequence.cached_tokens,
            )
            outputs.append(EngineOutput(request_id, finished))
        return outputs

    def _boundary_snapshots(self, prompt_responses: Sequence[Any]) -> list[EngineOutput]:
        """The state at the end of a conversation's history, just prefilled (end of its first segment)."""
        wanted = [
            r.uid
            for r in prompt_responses
            if r.end_of_segment and not r.end_of_prompt and (s := self._by_uid.get(r.uid)) and s.request.snapshots
        ]
        if not wanted:
            return []
        outputs: list[EngineOutput] = []
        for uid, (cache, tokens) in self._generator.extract_cache(wanted).items():
            sequence = self._by_uid[uid]
            outputs.append(EngineOutput(sequence.request.request_id, _snapshot(Origin.BOUNDARY, tokens, cache)))
        return outputs

    def _logprobs(self, sequence: _Sequence, token: int, logprobs: mx.array) -> tuple[TokenLogprob, ...]:
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

    def _forget(self, sequence: _Sequence) -> None:
        self._by_uid.pop(sequence.uid, None)
        self._uid_by_request.pop(sequence.request.request_id, None)

    def _fail_all(self, message: str) -> list[EngineOutput]:
        failed = [EngineOutput(s.request.request_id, GenerationFailed(message=message)) for s in self._by_uid.values()]
        self._by_uid.clear()
        self._uid_by_request.clear()
        self._generator = self._new_generator()
        return failed


def _snapshot(origin: Origin, tokens: Sequence[int], cache: list[Any]) -> SnapshotTaken:
    state, nbytes = compact_copy(cache)
    return SnapshotTaken(origin=origin, tokens=tuple(tokens), state=state, nbytes=nbytes)
