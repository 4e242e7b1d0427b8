"""The batch engine: continuous batching over mlx-lm's `BatchGenerator`, on the MLX thread only.

Each `step` admits new requests into the running batch, drops cancelled ones,
advances every sequence by one decode token (and new ones by one prefill chunk),
and turns the raw tokens into events: detokenized text with stop strings and
end-of-sequence tokens removed, optional logprobs, and a finish when a sequence
ends. A failure inside the batched forward pass starts a fresh generator and
isolates the culprit: each sequence of the failed batch is replayed alone (its
prompt and the tokens it generated, prefilled at batch size one, then its next
input probed); one that fails again fails alone, the others rejoin the batch from
their replayed state and carry on. A second failure right after a recovery fails
the whole batch, so a fault no single sequence explains cannot loop.

Requests admitted together that begin with the same tokens (a system prompt no
snapshot covers) have that prefix prefilled once and each start from a private copy
(`engine/shared_prefix.py`); requests admitted while it is still in use start from it
too. `cached_tokens` counts only what the snapshot store served, never a shared
prefix: that was computed for the requests in flight. With a dense KV cache a
conversation's boundary snapshot is cut from the prompt's state instead of ending a
prefill segment there, which saves a forward pass before the first token.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, cast

import mlx.core as mx
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import KVCache, make_prompt_cache
from mlx_lm.sample_utils import greedy_sampler
from mlx_lm.tokenizer_utils import TokenizerWrapper

from courier.core.failure_codes import FailureCode
from courier.core.prompt_lookup import LookupLimits
from courier.core.snapshot_store import Origin
from courier.core.stop_text import StopTextMatcher
from courier.core.verify_width import StepCosts
from courier.engine import shared_prefix
from courier.engine.constrained import ConstrainedSequence, MaskFiller
from courier.engine.generation import (
    FinishReason,
    GenerationEvent,
    GenerationFailed,
    GenerationFinished,
    RequestId,
    SamplingParams,
    TokenLogprob,
    TokensGenerated,
    VisionInputs,
)
from courier.engine.model_state import CachedPrefix, compact_copy, prefill, prefill_embedded, resume
from courier.engine.penalties import Penalties
from courier.engine.sampling import Sampler, SeededSampler, build_sampler
from courier.engine.sampling import probe as sampling_probe
from courier.engine.speculative_batch import SpeculationCounters, SpeculativeGenerator, StepResponse
from courier.grammar.compiler import GrammarCompiler
from courier.grammar.constraint import GrammarError
from courier.model.vision.embedder import ImageEmbedder

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
    vision: VisionInputs | None = None  # the prompt's images (a vision-language model only)
    # `n` samples of one prompt: it is prefilled once and each sample starts from a copy of its state.
    n: int = 1
    choice: int = 0  # which sample this sequence is (set by the engine)


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
    # Requests admitted in the same step that share at least this many new prompt tokens prefill them once (0: off).
    shared_prefix_min_tokens: int = shared_prefix.MIN_SHARED_TOKENS
    # Prompt-lookup drafts verified in multi-token steps (None: one token per step, mlx-lm's own steps).
    speculation: LookupLimits | None = None
    # How a verify pass is costed when choosing its width: fitted to timed passes (tests pin a line).
    step_costs: Callable[[], StepCosts] = StepCosts


@dataclass(slots=True, kw_only=True)
class _SharedState:
    """A prefix prefilled once for requests that share it, kept while any of them is in flight."""

    key: shared_prefix.InFlight  # its tokens; the first `key.start` of them restored from a stored snapshot
    state: list[Any]  # compact; every request starts from its own copy
    # The stored snapshot it started from, held so that its identity (`key.origin`) cannot be reused meanwhile.
    anchor: Any
    users: set[int] = field(default_factory=set)  # uids of the sequences that started from it


@dataclass(slots=True, kw_only=True)
class _Sequence:
    request: EngineRequest
    uid: int
    detokenizer: Any
    stop: StopTextMatcher
    cached_tokens: int = 0
    generated: int = 0
    # A dense cache prefills its history and generation prompt in one segment; its boundary snapshot is then cut
    # from the state at the end of the prompt (0: none to cut).
    cut_boundary: int = 0
    shared: _SharedState | None = None
    token_ids: list[int] = field(default_factory=list)  # generated so far, for a replay after a fault
    sampler: Sampler = greedy_sampler  # its request's own (a grammar's wraps it); kept for a replay
    constrained: ConstrainedSequence | None = None  # its grammar state, kept for a replay too
    processors: list[Any] = field(default_factory=list)  # penalties, bias, grammar: kept for a replay too
    snapshot_prompt_tokens: int = 0  # how much of the prompt the snapshots it took cover
    unsent_ids: list[int] = field(default_factory=list)  # generated, but in no event yet (they added no text)
    drafted: int = 0  # draft tokens verified for it, accepted of them, and tokens its grammar forced
    accepted: int = 0
    forced: int = 0

    def took_snapshot(self, tokens: int) -> None:
        self.snapshot_prompt_tokens = max(self.snapshot_prompt_tokens, min(tokens, len(self.request.prompt_tokens)))

    @property
    def cache_write_tokens(self) -> int:
        return max(0, self.snapshot_prompt_tokens - self.cached_tokens)


@dataclass(slots=True)
class _StepRead:
    """What a step's tokens for one sequence read as: text, token ids and logprobs to send, and how it ends."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    reason: FinishReason | None = None
    stopped_early: bool = False  # a stop string ended it before the generator's own end


class BatchEngine:
    def __init__(
        self,
        model: Any,
        tokenizer: TokenizerWrapper,
        limits: BatchLimits,
        embedder: ImageEmbedder | None = None,
        grammars: GrammarCompiler | None = None,
    ) -> None:
        self._model = model
        self._grammars = grammars
        self.masks = MaskFiller(grammars.vocab_size, limits.max_batch) if grammars is not None else None
        self._embedder = embedder
        self._tokenizer = tokenizer
        self._limits = limits
        self._eos = frozenset(int(token) for token in tokenizer.eos_token_ids)
        # The calling thread's own default stream: the engine is built and stepped on the MLX thread, and a
        # stream created on another thread (mlx-lm's module-level one) costs a cross-thread sync every step.
        self._stream = mx.default_stream(mx.default_device())
        # Plain KV caches only (no sliding window, no recurrent state): the state after a prompt holds the exact
        # state after each of its prefixes, so a boundary snapshot needs no separate prefill segment, and a verify
        # step can take back rejected positions per sequence.
        self._dense = all(type(layer) is KVCache for layer in make_prompt_cache(model))
        self.speculation = SpeculationCounters()
        self._generator = self._new_generator()
        self._by_uid: dict[int, _Sequence] = {}
        self._uids_by_request: dict[RequestId, list[int]] = {}  # a request of `n` samples runs `n` sequences
        self._shared: list[_SharedState] = []
        self._just_recovered = False  # the last step failed and its sequences were replayed

    @property
    def model(self) -> Any:
        return self._model

    @property
    def active(self) -> int:
        return len(self._by_uid)

    @property
    def speculation_mode(self) -> str:
        if self._limits.speculation is None:
            return "off (--no-speculation)"
        if not self._dense:
            return "off (the model's cache cannot take positions back: recurrent or sliding-window layers)"
        return "on"

    @property
    def speculating(self) -> bool:
        """Whether decode steps verify drafts: asked for, and a model whose KV cache can take positions back."""
        return self._limits.speculation is not None and self._dense

    def step(
        self, added: Sequence[EngineRequest], cancelled: Sequence[RequestId], expired: Sequence[RequestId] = ()
    ) -> list[EngineOutput]:
        """Admit `added`, drop `cancelled`, end `expired` (past their deadline) with what they wrote, then advance
        every running sequence by one step."""
        outputs: list[EngineOutput] = self._end_at_deadline(expired)
        starts, failed = self._share_prefixes(added)
        for index, request in enumerate(added):
            if index in failed:
                outputs.append(EngineOutput(request.request_id, GenerationFailed(message=failed[index])))
            else:
                outputs.extend(self._admit(request, starts.get(index)))
        self._shared = [shared for shared in self._shared if shared.users]  # none of its requests could start
        self._cancel(cancelled)
        if not self._by_uid:
            return outputs
        try:
            prompt_responses, responses = self._generator.next()
        except Exception as error:  # a fault in the batched forward pass: isolate the culprit, keep serving
            return outputs + self._recover(error)
        self._just_recovered = False
        if responses and not self.speculating:  # a speculative generator counts its own steps
            self.speculation.steps += 1
            self.speculation.tokens += len(responses)
        outputs.extend(self._boundary_snapshots(prompt_responses))
        for response in responses:
            sequence = self._by_uid.get(response.uid)
            if sequence is not None:
                outputs.extend(self._advance(sequence, response))
        return outputs

    def may_force(self, uid: int) -> bool:
        """Whether a sequence's grammar holds its output now (`Forcing`, for the speculative generator)."""
        sequence = self._by_uid.get(uid)
        return sequence is not None and sequence.constrained is not None and sequence.constrained.matching

    def forced(self, uid: int, token: int, most: int) -> list[int]:
        constrained = self._by_uid[uid].constrained
        return constrained.forced_after(token, most) if constrained is not None else []

    def take_back(self, uid: int, count: int) -> None:
        constrained = self._by_uid[uid].constrained
        if constrained is not None:
            constrained.take_back(count)

    def may_draft(self, uid: int) -> bool:
        """A constrained sequence may verify drafts when it decodes greedily and its grammar is its only
        processor (penalties would change the argmax a draft is checked against)."""
        sequence = self._by_uid.get(uid)
        if sequence is None or sequence.constrained is None:
            return False
        return sequence.constrained.greedy and not sequence.request.sampling.penalised

    def valid(self, uid: int, tokens: list[int]) -> int:
        constrained = self._by_uid[uid].constrained
        return constrained.valid(tokens) if constrained is not None else 0

    def _new_generator(self) -> BatchGenerator:
        options: dict[str, Any] = {
            "stop_tokens": [[token] for token in self._eos],
            "completion_batch_size": self._limits.max_batch,
            "prefill_batch_size": self._limits.prefill_batch,
            "prefill_step_size": self._limits.prefill_step_size,
            "stream": self._stream,
        }
        if self.speculating:
            generator = SpeculativeGenerator(
                self._model,
                lookup=self._limits.speculation,
                counters=self.speculation,
                costs=self._limits.step_costs(),
                **options,
            )
            generator.set_forcing(self)
            return generator
        return BatchGenerator(self._model, **options)

    def _share_prefixes(
        self, added: Sequence[EngineRequest]
    ) -> tuple[dict[int, tuple[_SharedState, int]], dict[int, str]]:
        """Where requests start that share a prefix (see `engine/shared_prefix.py`), and those that failed.

        A request whose prompt begins with a shared prefix still in flight starts from it (a dense one cut to
        what they have in common); the others that share a prefix among themselves get it prefilled here, once.
        Returns index -> (shared state, tokens of it to start from), and index -> why its request failed (a
        fault in the shared prefill).
        """
        starts: dict[int, tuple[_SharedState, int]] = {}
        failed: dict[int, str] = {}
        min_tokens = self._limits.shared_prefix_min_tokens
        if min_tokens <= 0 or not added:
            return starts, failed
        candidates = [_candidate(request) for request in added]
        keys = [shared.key for shared in self._shared]
        single = [index for index, request in enumerate(added) if request.n == 1]  # `n` samples fork their own
        for index in single:
            found = shared_prefix.match_in_flight(candidates[index], keys, trimmable=self._dense, min_tokens=min_tokens)
            if found is not None:
                starts[index] = (self._shared[found[0]], found[1])
        rest = [index for index in single if index not in starts]
        # An idle engine prefills a whole shared prefix in this step; a running batch waits for this step, so then
        # no more than one prefill chunk is shared (the rest is prefilled in the batch, chunk by chunk).
        most = self._limits.prefill_step_size if self._by_uid else None
        for group in shared_prefix.plan([candidates[i] for i in rest], min_tokens=min_tokens, max_tokens=most):
            members = [rest[i] for i in group.members]
            first = added[members[0]]
            shared = self._prefill_shared(first, group)
            if isinstance(shared, str):
                failed.update(dict.fromkeys(members, shared))
            elif shared is not None:
                self._shared.append(shared)
                starts.update(dict.fromkeys(members, (shared, group.length)))
                logger.debug(
                    "shared prefix: %d tokens prefilled once for %d requests", group.shared_tokens, len(members)
                )
        return starts, failed

    def _prefill_shared(self, first: EngineRequest, group: shared_prefix.SharedPrefix) -> _SharedState | str | None:
        """The group's shared prefix, prefilled from where its members start; None: cannot; str: failed (why)."""
        prompt = first.prompt_tokens
        anchor = first.prefix.state if first.prefix is not None and group.start > 0 else None
        cached, cache = resume(first.prefix, len(prompt)) if group.start > 0 else (0, None)
        if cached != group.start:
            return None  # the cached prefix cannot be resumed after all: each member starts on its own
        try:
            with mx.stream(self._stream):
                cache = prefill(self._model, prompt[group.start : group.length], cache)
            state, _ = compact_copy(cache)
        except Exception as error:  # a fault in the forward pass: fail these requests, keep serving
            logger.exception("shared prefix prefill failed; failing %d requests", len(group.members))
            return f"generation failed: {type(error).__name__}: {error}"
        origin = _candidate(first).origin
        key = shared_prefix.InFlight(origin=origin, start=group.start, tokens=tuple(prompt[: group.length]))
        return _SharedState(key=key, state=state, anchor=anchor)

    def _release(self, sequence: _Sequence) -> None:
        """A sequence left: its mask row is freed; a shared state no sequence in flight started from is dropped."""
        if sequence.constrained is not None:
            sequence.constrained.release()
            sequence.constrained = None
        shared = sequence.shared
        if shared is not None:
            shared.users.discard(sequence.uid)
            if not shared.users:
                self._shared = [s for s in self._shared if s is not shared]

    def _admit(self, request: EngineRequest, start_from: tuple[_SharedState, int] | None = None) -> list[EngineOutput]:
        prompt = list(request.prompt_tokens)
        shared: _SharedState | None = None
        if start_from is not None:
            # From a private copy of a prefix prefilled once for every request that shares it (cut to its first
            # `start` tokens if it covers more). Only what the snapshot store served counts as cached: a shared
            # prefix was computed for requests in flight, not kept for later.
            shared, start = start_from
            cut = start if start < len(shared.key.tokens) else None
            cache, cached = compact_copy(shared.state, cut)[0], shared.key.start
        else:
            start, cache = resume(request.prefix, len(prompt))
            cached = start
        if request.vision is not None:
            try:
                start, cache = self._prefill_images(request, start, cache)
            except Exception as error:  # a fault in the vision tower or the prefill: fail this request only
                logger.exception("image prefill failed for %s", request.request_id)
                failed = GenerationFailed(message=f"generation failed: {type(error).__name__}: {error}")
                return [EngineOutput(request.request_id, failed)]
        if request.n > 1:
            return self._fork(request, start, cache, cached)
        segments = [prompt[start:]]
        cut_boundary = 0
        if start < request.boundary < len(prompt):
            if self._dense and request.snapshots and request.boundary < len(prompt) - 1:
                # One segment, one forward pass less before the first token; the boundary snapshot is cut from the
                # state at the end of the prompt (all but its last token) when that segment ends.
                cut_boundary = request.boundary
            else:
                segments = [prompt[start : request.boundary], prompt[request.boundary :]]
        outputs = self._insert(request, segments, cache, start, cached=cached, cut_boundary=cut_boundary, shared=shared)
        if outputs or cache is None:
            return outputs
        if request.snapshots and start >= request.boundary > 0:
            # Started at or past its history boundary from another session's (or an older) snapshot, or from an
            # in-batch shared prefix that ends there: keep that state for this conversation too, or its next turn
            # would find nothing of its own to extend.
            self._by_uid[self._uids_by_request[request.request_id][-1]].took_snapshot(start)
            return [EngineOutput(request.request_id, _snapshot(Origin.BOUNDARY, prompt[:start], cache))]
        return []

    def _fork(self, request: EngineRequest, start: int, cache: Any, cached: int) -> list[EngineOutput]:
        """`n` samples of one prompt: all of it but its last token prefilled once (the conversation's boundary
        snapshot taken on the way), then each sample joins the batch from its own copy of that state, with its own
        sampler (a seeded request's sample `i` draws from seed + i) and processors. The samples take no snapshot
        of their own: which of them a conversation goes on with is not known."""
        prompt = request.prompt_tokens
        outputs: list[EngineOutput] = []
        try:
            with mx.stream(self._stream):
                if request.snapshots and start < request.boundary < len(prompt) - 1:
                    cache = prefill(self._model, prompt[start : request.boundary], cache)
                    start = request.boundary
                    outputs.append(EngineOutput(request.request_id, _snapshot(Origin.BOUNDARY, prompt[:start], cache)))
                if start < len(prompt) - 1:
                    cache = prefill(self._model, prompt[start:-1], cache)
                    start = len(prompt) - 1
        except Exception as error:  # a fault in the forward pass: fail this request only
            logger.exception("prefill of %d samples failed for %s", request.n, request.request_id)
            failed = GenerationFailed(message=f"generation failed: {type(error).__name__}: {error}")
            return [EngineOutput(request.request_id, failed)]
        seed = request.sampling.seed
        for choice in range(request.n):
            sampling = replace(request.sampling, seed=seed + choice if seed is not None else None)
            sample = replace(request, n=1, choice=choice, snapshots=False, sampling=sampling)
            copy = compact_copy(cache)[0] if cache is not None else None
            refused = self._insert(sample, [list(prompt[start:])], copy, start, cached=cached)
            if refused:  # the others leave with it: the request fails as one
                self._cancel([request.request_id])
                return outputs + refused
        if outputs:  # the boundary snapshot: counted once, with the first sample
            self._by_uid[self._uids_by_request[request.request_id][0]].took_snapshot(request.boundary)
        return outputs

    def _insert(
        self,
        request: EngineRequest,
        segments: list[list[int]],
        cache: Any,
        start: int,
        *,
        cached: int,
        cut_boundary: int = 0,
        shared: _SharedState | None = None,
    ) -> list[EngineOutput]:
        """One sequence into the batch, from `cache` (the state after the prompt's first `start` tokens); a request
        that cannot start (a bad grammar, a sampler refused) fails here."""
        sampling = request.sampling
        prompt = list(request.prompt_tokens)
        constrained: ConstrainedSequence | None = None
        try:
            sampler = build_sampler(sampling)
            constrained = self._constrain(request, sampler)
            processors = _processors(request, constrained)
            (uid,) = self._generator.insert_segments(
                [segments],
                max_tokens=[sampling.max_tokens],
                caches=[cache] if cache is not None else None,
                all_tokens=[prompt[:start]] if cache is not None else None,
                samplers=[constrained.sample if constrained is not None else sampler],
                logits_processors=[processors] if processors else None,
            )
        except (ValueError, TypeError) as error:  # GrammarError included
            if constrained is not None:
                constrained.release()
            failed = GenerationFailed(message=f"cannot start generation: {error}", choice=request.choice)
            return [EngineOutput(request.request_id, failed)]
        self._by_uid[uid] = _Sequence(
            request=request,
            uid=uid,
            detokenizer=self._tokenizer.detokenizer,
            stop=StopTextMatcher(sampling.stop),
            cached_tokens=cached,
            cut_boundary=cut_boundary,
            shared=shared,
            sampler=sampler,
            constrained=constrained,
            processors=processors,
        )
        if shared is not None:
            shared.users.add(uid)
        self._uids_by_request.setdefault(request.request_id, []).append(uid)
        return []

    def _constrain(self, request: EngineRequest, sampler: Any) -> ConstrainedSequence | None:
        """The grammar state of a constrained request (None for a free one). Raises `GrammarError`."""
        constraint = request.sampling.constraint
        if constraint is None:
            return None
        if self._grammars is None or self.masks is None:
            raise GrammarError("this server was started without constrained decoding", "")
        return ConstrainedSequence(
            constraint,
            compiler=self._grammars,
            filler=self.masks,
            decode=self._tokenizer.decode,
            prompt_length=len(request.prompt_tokens),
            sampler=sampler,
            eos_tokens=sorted(self._eos),
            renormalize=0 < request.sampling.top_p < 1,
        )

    def _prefill_images(self, request: EngineRequest, start: int, cache: Any) -> tuple[int, Any]:
        """Prefill through the prompt's last image token from input embeddings (the vision tower's features in
        the image tokens' places), at batch size one; the rest of the prompt joins the batch as text.

        Returns where the batch takes over and the state so far (unchanged when a stored snapshot of the same
        images already covers them).
        """
        vision, embedder = request.vision, self._embedder
        if vision is None:
            return start, cache
        if embedder is None:
            raise ValueError("the model takes no images")
        prompt = request.prompt_tokens
        end = min(embedder.image_span_end(prompt), len(prompt) - 1)
        if end <= start:
            return start, cache
        with mx.stream(self._stream):
            embeddings = embedder.embeddings(prompt, vision.arrays)
            cache = prefill_embedded(self._model, prompt, embeddings, cache, start=start, end=end)
        return end, cache

    def _cancel(self, request_ids: Sequence[RequestId]) -> None:
        uids = [uid for request_id in request_ids for uid in self._uids_by_request.pop(request_id, [])]
        if uids:
            self._generator.remove(uids)
            for uid in uids:
                self._release(self._by_uid.pop(uid))

    def _end_at_deadline(self, request_ids: Sequence[RequestId]) -> list[EngineOutput]:
        """Requests past their deadline leave the batch. Each sequence that wrote tokens ends as a length cut with
        them (and the text its detokenizer and stop matcher still held); one that wrote none fails."""
        outputs: list[EngineOutput] = []
        for request_id in request_ids:
            uids = self._uids_by_request.pop(request_id, [])
            if uids:
                self._generator.remove(uids)
            for uid in uids:
                sequence = self._by_uid.pop(uid)
                self._release(sequence)
                outputs.extend(EngineOutput(request_id, event) for event in _cut_at_deadline(sequence))
        return outputs

    def _advance(self, sequence: _Sequence, response: Any) -> list[EngineOutput]:
        """A step's tokens for one sequence (one, or several from a verified draft), as one event."""
        read = self._read(sequence, response)
        text, token_ids, logprobs, reason = read.text, read.token_ids, read.logprobs, read.reason
        finish = response.finish_reason if not read.stopped_early else None
        request_id = sequence.request.request_id
        outputs: list[EngineOutput] = []
        choice = sequence.request.choice
        if text or logprobs:
            # Tokens that added no text (part of a character, a stop string's start) go out with the next event.
            token_ids, sequence.unsent_ids = [*sequence.unsent_ids, *token_ids], []
            generated = TokensGenerated(text=text, token_ids=tuple(token_ids), logprobs=tuple(logprobs), choice=choice)
            outputs.append(EngineOutput(request_id, generated))
        else:
            sequence.unsent_ids.extend(token_ids)
        if reason is not None:
            if sequence.request.snapshots and finish is not None and response.prompt_cache and response.all_tokens:
                snapshot = _snapshot(Origin.COMPLETION, response.all_tokens, response.prompt_cache)
                prefix = sequence.request.prefix
                continues = prefix.continues if prefix is not None else None
                prompt_length = len(sequence.request.prompt_tokens)
                snapshot = replace(snapshot, continues=continues, prompt_length=prompt_length)
                outputs.append(EngineOutput(request_id, snapshot))
                sequence.took_snapshot(prompt_length)
            self._forget(sequence)
            finished = GenerationFinished(
                reason=reason,
                prompt_tokens=len(sequence.request.prompt_tokens),
                completion_tokens=sequence.generated,
                cached_tokens=sequence.cached_tokens,
                choice=choice,
                cache_write_tokens=sequence.cache_write_tokens,
                drafted_tokens=sequence.drafted,
                accepted_tokens=sequence.accepted,
                forced_tokens=sequence.forced,
            )
            outputs.append(EngineOutput(request_id, finished))
        return outputs

    def _read(self, sequence: _Sequence, response: Any) -> _StepRead:
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
                    self._generator.remove([sequence.uid])
                else:
                    read.stopped_early = True  # before the generator's end: no completion snapshot past the stop
                break
            if ends is not None:
                pieces.append(sequence.stop.flush())
                read.reason = FinishReason.STOP if ends == "stop" else FinishReason.LENGTH
        read.text = "".join(pieces)
        return read

    def _boundary_snapshots(self, prompt_responses: Sequence[Any]) -> list[EngineOutput]:
        """The states at the end of a prefill segment: a conversation's history, and the prompt but its last token.

        With a dense cache the history's state is cut from the prompt's (its first `boundary` positions), in the
        order a two-segment prefill would give them: history first.
        """
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
            request_id = sequence.request.request_id
            cut = sequence.cut_boundary
            if 0 < cut < len(tokens):
                outputs.append(EngineOutput(request_id, _snapshot(Origin.BOUNDARY, tokens[:cut], cache, length=cut)))
            outputs.append(EngineOutput(request_id, _snapshot(Origin.BOUNDARY, tokens, cache)))
            sequence.took_snapshot(len(tokens))
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
        request_id = sequence.request.request_id
        uids = self._uids_by_request.get(request_id, [])
        if sequence.uid in uids:
            uids.remove(sequence.uid)
        if not uids:
            self._uids_by_request.pop(request_id, None)
        self._release(sequence)

    def _recover(self, error: Exception) -> list[EngineOutput]:
        """A fresh generator; each sequence of the failed batch replayed alone, failing only those that fail."""
        reason = f"generation failed: {type(error).__name__}: {error}"
        _renew_random_state()
        if self._just_recovered or len(self._by_uid) <= 1:
            logger.exception("generation step failed; failing %d requests", len(self._by_uid))
            return self._fail_all(reason)
        logger.exception("generation step failed; replaying its %d requests one by one", len(self._by_uid))
        sequences = list(self._by_uid.values())
        self._by_uid.clear()
        self._uids_by_request.clear()
        self._shared.clear()
        self._generator = self._new_generator()
        self._just_recovered = True
        outputs: list[EngineOutput] = []
        for sequence in sequences:
            sequence.shared = None
            try:
                self._replay(sequence)
            except Exception as replay_error:  # this one faults on its own: the culprit
                _renew_random_state()  # whatever its fault left there, the next replay starts clean
                logger.warning("request %s fails on its own: %s", sequence.request.request_id, replay_error)
                message = f"generation failed: {type(replay_error).__name__}: {replay_error}"
                self._release(sequence)
                failed = GenerationFailed(message=message, choice=sequence.request.choice)
                outputs.append(EngineOutput(sequence.request.request_id, failed))
        self._just_recovered = bool(self._by_uid)  # nothing replayed: the next batch starts afresh
        return outputs

    def _replay(self, sequence: _Sequence) -> None:
        """Rebuild `sequence`'s state at batch size one, probe its next input, and put it back in the batch."""
        request = sequence.request
        tokens = [*request.prompt_tokens, *sequence.token_ids]
        with mx.stream(self._stream):
            start, cache = resume(request.prefix, len(request.prompt_tokens))  # from its stored snapshot, if any
            if request.vision is not None:
                start, cache = self._prefill_images(request, start, cache)
            cache = prefill(self._model, tokens[start:-1], cache) if start < len(tokens) - 1 else cache
            probe, _ = compact_copy(cache) if cache is not None else (None, 0)
            logits = self._model(mx.array([tokens[-1:]]), cache=probe)[:, -1, :]
            # Its sampler's filters too: a fault in one sequence's sampling fails that sequence here, alone.
            sampling_probe(sequence.sampler, logits - mx.logsumexp(logits, axis=-1, keepdims=True))
        remaining = max(1, (request.sampling.max_tokens or 1) - sequence.generated)
        if isinstance(sequence.sampler, SeededSampler):  # its next draw is for the token after those it has sent
            sequence.sampler.position = len(sequence.token_ids)
        constrained = sequence.constrained
        (uid,) = self._generator.insert_segments(
            [[tokens[-1:]]],
            max_tokens=[remaining],
            caches=[cache] if cache is not None else None,
            all_tokens=[tokens[:-1]] if cache is not None else None,
            samplers=[constrained.sample if constrained is not None else sequence.sampler],
            logits_processors=[sequence.processors] if sequence.processors else None,
        )
        sequence.uid = uid
        sequence.cut_boundary = 0
        self._by_uid[uid] = sequence
        self._uids_by_request.setdefault(request.request_id, []).append(uid)

    def _fail_all(self, message: str) -> list[EngineOutput]:
        failed = [EngineOutput(s.request.request_id, GenerationFailed(message=message)) for s in self._by_uid.values()]
        for sequence in self._by_uid.values():
            self._release(sequence)
        self._by_uid.clear()
        self._uids_by_request.clear()
        self._shared.clear()
        self._generator = self._new_generator()
        return failed


def _cut_at_deadline(sequence: _Sequence) -> list[GenerationEvent]:
    choice = sequence.request.choice
    if sequence.generated == 0:
        message = "the request reached its deadline (--request-timeout) before its first token"
        return [GenerationFailed(message=message, code=FailureCode.DEADLINE_EXCEEDED, choice=choice)]
    sequence.detokenizer.finalize()
    scan = sequence.stop.feed(sequence.detokenizer.last_segment)
    text = scan.text if scan.stopped else scan.text + sequence.stop.flush()
    events: list[GenerationEvent] = []
    if text or sequence.unsent_ids:
        events.append(TokensGenerated(text=text, token_ids=tuple(sequence.unsent_ids), choice=choice))
    finished = GenerationFinished(
        reason=FinishReason.LENGTH,
        prompt_tokens=len(sequence.request.prompt_tokens),
        completion_tokens=sequence.generated,
        cached_tokens=sequence.cached_tokens,
        choice=choice,
        cache_write_tokens=sequence.cache_write_tokens,
        drafted_tokens=sequence.drafted,
        accepted_tokens=sequence.accepted,
        forced_tokens=sequence.forced,
        deadline=True,
    )
    return [*events, finished]


def _renew_random_state() -> None:
    """MLX's global random state, seeded afresh after a failed step: a function compiled with that state as its
    input and output (mlx-lm's samplers are) that raised mid-trace leaves a traced array in it, and every later
    unseeded draw would fail. Courier's samplers compile nothing; this keeps any other such fault to one step."""
    mx.random.seed(int.from_bytes(os.urandom(8), "little"))


def _processors(request: EngineRequest, constrained: ConstrainedSequence | None) -> list[Any]:
    """A sequence's logits processors: its penalties and bias, then its grammar's (which reads, never changes)."""
    processors: list[Any] = []
    if request.sampling.penalised:
        generated = constrained.generated if constrained is not None else None  # one read of the step for both
        processors.append(Penalties(request.sampling, request.prompt_tokens, generated))
    if constrained is not None:
        processors.extend(constrained.processors)
    return processors


def _step_tokens(response: Any) -> tuple[list[int], list[mx.array]]:
    """A generator response's tokens and their logprobs vectors (mlx-lm's carries one, a speculative one several)."""
    if isinstance(response, StepResponse):
        return response.tokens, response.logprobs
    return [int(response.token)], [response.logprobs]


def _candidate(request: EngineRequest) -> shared_prefix.Candidate:
    length = len(request.prompt_tokens)
    prefix = request.prefix
    start = prefix.matched if prefix is not None and 0 < prefix.matched < length else 0
    # Requests share only when they start from the same state: the same stored snapshot, trimmed alike, or none.
    origin = (id(prefix.state), prefix.length) if start > 0 and prefix is not None else None
    # A prompt with images shares nothing: its image tokens stand for pixels other prompts do not have.
    limit = 0 if request.vision is not None else shared_prefix.limit_for(length, start, request.boundary)
    return shared_prefix.Candidate(tokens=request.prompt_tokens, start=start, origin=origin, limit=limit)


def _snapshot(origin: Origin, tokens: Sequence[int], cache: list[Any], length: int | None = None) -> SnapshotTaken:
    state, nbytes = compact_copy(cache, length)
    return SnapshotTaken(origin=origin, tokens=tuple(tokens), state=state, nbytes=nbytes)
