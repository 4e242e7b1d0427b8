"""Admission into the batch: where each new request starts, what is prefilled before it joins, and its sequence.

A request starts from its cached prefix (the snapshot store's), or from a prefix it shares with requests admitted
beside it, prefilled once (`engine/shared_prefix.py`); a vision request's images are prefilled from the vision
tower's embeddings at batch size one; `n` samples are prefilled once and forked. Then each sequence joins mlx-lm's
generator with its own sampler, grammar state and logits processors, and is registered in `Sequences`. A request
that cannot start (a bad grammar, a fault in its own prefill) fails here, alone.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import mlx.core as mx
from mlx_lm.tokenizer_utils import TokenizerWrapper

from courier.core.prompt_cache.entries import Origin
from courier.core.stop_text import StopTextMatcher
from courier.engine import shared_prefix
from courier.engine.constrained import ConstrainedSequence, MaskFiller
from courier.engine.engine_io import BatchLimits, EngineOutput, EngineRequest
from courier.engine.generation import GenerationFailed
from courier.engine.model_state import compact_copy, prefill, prefill_embedded, resume
from courier.engine.penalties import Penalties
from courier.engine.sampling import Sampler, build_sampler
from courier.engine.sequences import RunningSequence, Sequences
from courier.engine.shared_prefix import SharedState
from courier.engine.step_snapshots import snapshot
from courier.grammar.compiler import GrammarCompiler
from courier.grammar.constraint import GrammarError
from courier.model.vision.embedder import ImageEmbedder

logger = logging.getLogger(__name__)


class Admission:
    """Admits requests into a generator; keeps the in-batch shared prefixes still in use."""

    def __init__(
        self,
        model: Any,
        tokenizer: TokenizerWrapper,
        limits: BatchLimits,
        sequences: Sequences,
        *,
        stream: Any,
        dense: bool,
        eos: frozenset[int],
        embedder: ImageEmbedder | None = None,
        grammars: GrammarCompiler | None = None,
        masks: MaskFiller | None = None,
    ) -> None:
        self._model = model
        self._tokenizer = tokenizer
        self._limits = limits
        self._sequences = sequences
        self._stream = stream
        self._dense = dense
        self._eos = eos
        self._embedder = embedder
        self._grammars = grammars
        self._masks = masks
        self.shared: list[SharedState] = []

    def admit(self, added: Sequence[EngineRequest], generator: Any) -> list[EngineOutput]:
        """Each request into `generator` (or failed); shared prefixes no sequence holds any more are dropped."""
        outputs: list[EngineOutput] = []
        starts, failed = self._share_prefixes(added)
        for index, request in enumerate(added):
            if index in failed:
                outputs.append(EngineOutput(request.request_id, GenerationFailed(message=failed[index])))
            else:
                outputs.extend(self._admit(request, generator, starts.get(index)))
        self.shared = [shared for shared in self.shared if shared.users]
        return outputs

    def prefill_images(self, request: EngineRequest, start: int, cache: Any) -> tuple[int, Any]:
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

    def _share_prefixes(
        self, added: Sequence[EngineRequest]
    ) -> tuple[dict[int, tuple[SharedState, int]], dict[int, str]]:
        """Where requests start that share a prefix (see `engine/shared_prefix.py`), and those that failed.

        A request whose prompt begins with a shared prefix still in flight starts from it (a dense one cut to
        what they have in common); the others that share a prefix among themselves get it prefilled here, once.
        Returns index -> (shared state, tokens of it to start from), and index -> why its request failed (a
        fault in the shared prefill).
        """
        starts: dict[int, tuple[SharedState, int]] = {}
        failed: dict[int, str] = {}
        min_tokens = self._limits.shared_prefix_min_tokens
        if min_tokens <= 0 or not added:
            return starts, failed
        candidates = [_candidate(request) for request in added]
        self.shared = [shared for shared in self.shared if shared.users]
        keys = [shared.key for shared in self.shared]
        single = [index for index, request in enumerate(added) if request.n == 1]  # `n` samples fork their own
        for index in single:
            found = shared_prefix.match_in_flight(candidates[index], keys, trimmable=self._dense, min_tokens=min_tokens)
            if found is not None:
                starts[index] = (self.shared[found[0]], found[1])
        rest = [index for index in single if index not in starts]
        # An idle engine prefills a whole shared prefix in this step; a running batch waits for this step, so then
        # no more than one prefill chunk is shared (the rest is prefilled in the batch, chunk by chunk).
        most = self._limits.prefill_step_size if len(self._sequences) else None
        for group in shared_prefix.plan([candidates[i] for i in rest], min_tokens=min_tokens, max_tokens=most):
            members = [rest[i] for i in group.members]
            first = added[members[0]]
            shared = self._prefill_shared(first, group)
            if isinstance(shared, str):
                failed.update(dict.fromkeys(members, shared))
            elif shared is not None:
                self.shared.append(shared)
                starts.update(dict.fromkeys(members, (shared, group.length)))
                logger.debug(
                    "shared prefix: %d tokens prefilled once for %d requests", group.shared_tokens, len(members)
                )
        return starts, failed

    def _prefill_shared(self, first: EngineRequest, group: shared_prefix.SharedPrefix) -> SharedState | str | None:
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
        return SharedState(key=key, state=state, anchor=anchor)

    def _admit(
        self, request: EngineRequest, generator: Any, start_from: tuple[SharedState, int] | None
    ) -> list[EngineOutput]:
        prompt = list(request.prompt_tokens)
        shared: SharedState | None = None
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
                start, cache = self.prefill_images(request, start, cache)
            except Exception as error:  # a fault in the vision tower or the prefill: fail this request only
                logger.exception("image prefill failed for %s", request.request_id)
                failed = GenerationFailed(message=f"generation failed: {type(error).__name__}: {error}")
                return [EngineOutput(request.request_id, failed)]
        if request.n > 1:
            return self._fork(request, generator, start, cache, cached)
        segments = [prompt[start:]]
        cut_boundary = 0
        if start < request.boundary < len(prompt):
            if self._dense and request.snapshots and request.boundary < len(prompt) - 1:
                # One segment, one forward pass less before the first token; the boundary snapshot is cut from the
                # state at the end of the prompt (all but its last token) when that segment ends.
                cut_boundary = request.boundary
            else:
                segments = [prompt[start : request.boundary], prompt[request.boundary :]]
        outputs = self._insert(
            request, generator, segments, cache, start, cached=cached, cut_boundary=cut_boundary, shared=shared
        )
        if outputs or cache is None:
            return outputs
        if request.snapshots and start >= request.boundary > 0:
            # Started at or past its history boundary from another session's (or an older) snapshot, or from an
            # in-batch shared prefix that ends there: keep that state for this conversation too, or its next turn
            # would find nothing of its own to extend.
            self._sequences.of_request(request.request_id)[-1].took_snapshot(start)
            kept = snapshot(Origin.BOUNDARY, prompt[:start], cache, quantization=self._limits.snapshot_quantization)
            return [EngineOutput(request.request_id, kept)]
        return []

    def _fork(self, request: EngineRequest, generator: Any, start: int, cache: Any, cached: int) -> list[EngineOutput]:
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
                    quantization = self._limits.snapshot_quantization
                    history = snapshot(Origin.BOUNDARY, prompt[:start], cache, quantization=quantization)
                    outputs.append(EngineOutput(request.request_id, history))
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
            refused = self._insert(sample, generator, [list(prompt[start:])], copy, start, cached=cached)
            if refused:  # the others leave with it: the request fails as one
                taken = self._sequences.take_request(request.request_id)
                if taken:
                    generator.remove([sequence.uid for sequence in taken])
                return outputs + refused
        if outputs:  # the boundary snapshot: counted once, with the first sample
            self._sequences.of_request(request.request_id)[0].took_snapshot(request.boundary)
        return outputs

    def _insert(
        self,
        request: EngineRequest,
        generator: Any,
        segments: list[list[int]],
        cache: Any,
        start: int,
        *,
        cached: int,
        cut_boundary: int = 0,
        shared: SharedState | None = None,
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
            (uid,) = generator.insert_segments(
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
        sequence = RunningSequence(
            request=request,
            uid=uid,
            detokenizer=self._tokenizer.detokenizer,
            stop=StopTextMatcher(sampling.stop),
            cached_tokens=cached,
            prompt_depth=start,
            cut_boundary=cut_boundary,
            shared=shared,
            sampler=sampler,
            constrained=constrained,
            processors=processors,
        )
        self._sequences.add(sequence)
        return []

    def _constrain(self, request: EngineRequest, sampler: Sampler) -> ConstrainedSequence | None:
        """The grammar state of a constrained request (None for a free one). Raises `GrammarError`."""
        constraint = request.sampling.constraint
        if constraint is None:
            return None
        if self._grammars is None or self._masks is None:
            raise GrammarError("this server was started without constrained decoding", "")
        return ConstrainedSequence(
            constraint,
            compiler=self._grammars,
            filler=self._masks,
            decode=self._tokenizer.decode,
            prompt_length=len(request.prompt_tokens),
            sampler=sampler,
            eos_tokens=sorted(self._eos),
            renormalize=0 < request.sampling.top_p < 1,
        )


def _processors(request: EngineRequest, constrained: ConstrainedSequence | None) -> list[Any]:
    """A sequence's logits processors: its penalties and bias, then its grammar's (which reads, never changes)."""
    processors: list[Any] = []
    if request.sampling.penalised:
        generated = constrained.generated if constrained is not None else None  # one read of the step for both
        processors.append(Penalties(request.sampling, request.prompt_tokens, generated))
    if constrained is not None:
        processors.extend(constrained.processors)
    return processors


def _candidate(request: EngineRequest) -> shared_prefix.Candidate:
    length = len(request.prompt_tokens)
    prefix = request.prefix
    start = prefix.matched if prefix is not None and 0 < prefix.matched < length else 0
    # Requests share only when they start from the same state (the same stored snapshot, trimmed alike, or none) and
    # are the same tenant's: a prefix prefilled for one API key is never another's to start from.
    state = (id(prefix.state), prefix.length) if start > 0 and prefix is not None else None
    origin = (request.tenant, state)
    # A prompt with images shares nothing: its image tokens stand for pixels other prompts do not have.
    limit = 0 if request.vision is not None else shared_prefix.limit_for(length, start, request.boundary)
    return shared_prefix.Candidate(tokens=request.prompt_tokens, start=start, origin=origin, limit=limit)
