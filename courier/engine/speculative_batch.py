"""Multi-token decode steps inside the continuous batch: prompt-lookup drafts, verified in one forward pass.

`SpeculativeGenerator` is mlx-lm's `BatchGenerator` with its generation batch replaced by a
`SpeculativeGenerationBatch`. While no sequence of the batch has a draft in sight, a step is mlx-lm's own,
pipelined one (the next forward pass is queued before the host reads the last tokens). When one has, the step
waits for the pending tokens, asks each sequence's `PromptLookup` for a draft after its token, and runs one forward
pass over a right-padded block `[token, draft..., pad...]` per sequence; a sequence without a draft rides along
with its one token. Each sequence keeps the longest prefix of its draft that its own sampler reproduces at each
position, plus the token its sampler chose after that prefix (the next step's input), so every step moves each
sequence on by at least one token. The KV cache (`RaggedKVCache`, or with `--kv-bits` the quantized
`BatchQuantizedKVCache`) takes back each sequence's rejected positions.

Lossless: at every position the sequence's own sampler draws from the model's distribution given the tokens before
it, and a draft token is kept only when the draw equals it. That is greedy decoding exactly at temperature 0, and
the standard speculative acceptance rule for a draft that is a point mass (accept with probability p(draft), else a
draw from p without the draft) when sampling. A seeded sampler keys each draw by token position, and its position
is set back to the token after the last kept one, so a seeded output is the one without drafts.

Sequences with logits processors (penalties, logit bias, a grammar) do not draft: their processors read one token
per step. A `Forcing` lets a constrained sequence supply the tokens its grammar forces instead (JSON keys and
punctuation of a schema; see `ConstrainedSequence.forced_after`): they go into the block like a draft and are kept
without being drawn, and the sequence draws only after them. They weigh in the block width like a draft that is
always kept; those past the width are given back to the grammar (`Forcing.take_back`).

Every row's `PromptLookup` also drafts in shadow on steps that do not verify its draft, so its acceptance
estimate, which decides whether a wider pass pays, follows what it would keep now.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol, cast

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, GenerationBatch
from mlx_lm.sample_utils import greedy_sampler

from courier.core.prompt_cache.quantization import KvQuantization
from courier.core.step_planning.prompt_lookup import LookupLimits, PromptLookup
from courier.core.step_planning.verify_width import RowDraft, StepCosts, best_width
from courier.engine.quantized_batch_cache import as_generation_layer
from courier.engine.ragged_cache import RaggedKVCache
from courier.engine.sampling import SeededSampler

# The most tokens a grammar may force into one step (fewer when the block width's cost model cuts them).
MAX_FORCED_TOKENS = 16


class Forcing(Protocol):
    """The engine's grammars, by sequence uid: which may force tokens now, and which they force."""

    def may_force(self, uid: int) -> bool: ...

    def forced(self, uid: int, token: int, most: int) -> list[int]:
        """Advance uid's grammar over `token` (its next input) and return the tokens it then forces (at most
        `most`: all of them are appended)."""
        ...

    def may_draft(self, uid: int) -> bool:
        """Whether a constrained sequence may verify drafts: greedy, its grammar its only logits processor."""
        ...

    def valid(self, uid: int, tokens: list[int]) -> int:
        """How many of `tokens`, from the first, uid's grammar accepts now."""
        ...

    def take_back(self, uid: int, count: int) -> None:
        """The last `count` tokens `forced` returned for uid are not appended: its grammar goes back before them."""
        ...


class DraftKind(Enum):
    LOOKUP = "lookup"  # a free sequence's draft: drawn for at each position
    FORCED = "forced"  # tokens its grammar forces: kept without drawing
    GUIDED = "guided"  # a greedy constrained sequence's draft, valid under its grammar: its argmax at each
    # position is the masked one while it equals the draft; the draw after the kept tokens is made under the mask


@dataclass(frozen=True, slots=True)
class Draft:
    tokens: list[int]
    kind: DraftKind = DraftKind.LOOKUP


@dataclass(slots=True)
class SpeculationCounters:
    """Totals since start (the engine reads them for /metrics and /health)."""

    steps: int = 0  # forward passes of the generation batch
    verify_steps: int = 0  # of which verified drafts or forced tokens
    tokens: int = 0  # tokens emitted by the generation batch
    drafted: int = 0
    accepted: int = 0
    forced: int = 0  # fast-forwarded by a grammar


@dataclass(slots=True)
class StepResponse:
    """One sequence's tokens from one step (one or more), with a logprobs vector per token."""

    uid: int
    tokens: list[int]
    logprobs: list[mx.array]
    finish_reason: str | None
    prompt_cache: list[Any] | None
    all_tokens: list[int] | None
    drafted: int = 0
    accepted: int = 0
    forced: int = 0


@dataclass(slots=True)
class _Row:
    """What one sequence drafts from, kept in step with the batch's rows."""

    lookup: PromptLookup | None  # None: it does not draft
    forced: list[int] = field(default_factory=list)


class SpeculativeGenerationBatch(GenerationBatch):  # type: ignore[misc]
    limits: LookupLimits | None = None  # None: no drafts (forced tokens still apply)
    forcing: Forcing | None = None
    kv_quantization: KvQuantization | None = None  # `--kv-bits`: rows are quantized as they join
    counters: SpeculationCounters
    # mlx-lm's own attributes this class reads (its module is untyped).
    prompt_cache: list[Any]
    _rows: list[_Row]
    _costs: StepCosts
    _next_tokens: Any
    _next_logprobs: list[Any]

    @classmethod
    def create(
        cls, model: Any, sampler: Any, limits: LookupLimits | None, counters: SpeculationCounters, costs: StepCosts
    ) -> SpeculativeGenerationBatch:
        batch = cast("SpeculativeGenerationBatch", cls.empty(model, sampler))
        batch.limits = limits
        batch.counters = counters
        batch._rows = []
        batch._costs = costs
        return batch

    def extend(self, batch: GenerationBatch) -> None:
        super().extend(batch)
        self.prompt_cache = [as_generation_layer(layer, self.kv_quantization) for layer in self.prompt_cache]
        for index, processors in enumerate(batch.logits_processors):
            guided = self.forcing is not None and self.forcing.may_draft(batch.uids[index])
            lookup = (
                PromptLookup(batch.tokens[index], self.limits) if self.limits and (guided or not processors) else None
            )
            self._rows.append(_Row(lookup))

    def filter(self, keep: list[int]) -> None:
        super().filter(keep)
        self._rows = [self._rows[index] for index in keep]

    def extract_prefix(self, index: int, length: int) -> list[Any]:
        caches: list[Any] = self.extract_cache(index)
        for cache in caches:
            if cache.offset > length:
                cache.keys, cache.values = cache.keys[..., :length, :], cache.values[..., :length, :]
                cache.offset = length
        return caches

    @property
    def _ragged(self) -> bool:
        return bool(self.prompt_cache) and all(isinstance(c, RaggedKVCache) for c in self.prompt_cache)

    def next(self) -> list[StepResponse]:
        if not self.uids:
            return []
        self.counters.steps += 1
        started = time.perf_counter()
        if self._ragged and self._worth_verifying():
            verified = self._verify()
            if verified is not None:
                responses, positions = verified
                self._costs.observe(positions, time.perf_counter() - started)
                return responses
        rows = list(self._rows)
        plain = super().next()
        responses = []
        for row, response in zip(rows, plain, strict=True):
            if row.lookup is not None:
                row.lookup.extend([response.token])
                row.lookup.shadow()
            responses.append(
                StepResponse(
                    uid=response.uid,
                    tokens=[response.token],
                    logprobs=[response.logprobs],
                    finish_reason=response.finish_reason,
                    prompt_cache=response.prompt_cache,
                    all_tokens=response.all_tokens,
                )
            )
        self.counters.tokens += len(responses)
        self._costs.observe(len(rows), time.perf_counter() - started)
        return responses

    def _worth_verifying(self) -> bool:
        """Whether a verify pass may pay, judged before waiting for the pending tokens: rows with a draft in sight
        (or a grammar that may force tokens), at their draft lengths and acceptance."""
        forcing = self.forcing
        estimates: list[RowDraft] = []
        for uid, row in zip(self.uids, self._rows, strict=True):
            if forcing is not None and forcing.may_force(uid):
                return True  # forced tokens cost nothing to find and are always kept
            lookup = row.lookup
            seen = lookup is not None and lookup.may_propose()
            estimates.append(RowDraft(lookup.draft_length, lookup.acceptance) if lookup and seen else RowDraft(0, 0.0))
        longest = max(estimate.tokens for estimate in estimates)
        return longest > 0 and best_width(estimates, self._costs, most=1 + longest) > 1

    def _drafts(self, inputs: list[int]) -> list[Draft]:
        """Each row's draft after its input token (forced tokens, a lookup draft, or none), cut to the block width
        with the most expected tokens per second (forced tokens cut are given back to the grammar)."""
        drafts: list[Draft] = []
        estimates: list[RowDraft] = []
        forcing = self.forcing
        for index, (row, token) in enumerate(zip(self._rows, inputs, strict=True)):
            room = max(0, self.max_tokens[index] - self._num_tokens[index] - 1)  # it may emit this many after `token`
            uid = self.uids[index]
            constrained = forcing is not None and forcing.may_force(uid)
            most = min(room, MAX_FORCED_TOKENS)
            forced = forcing.forced(uid, token, most) if forcing is not None and constrained else []
            processed = bool(self.logits_processors[index])
            if forced:
                drafts.append(Draft(forced, DraftKind.FORCED))
            elif row.lookup is None or room == 0 or (processed and not constrained):
                drafts.append(Draft([]))  # (a constrained sequence drafts only while its grammar holds the output)
            elif forcing is not None and processed:
                proposed = row.lookup.propose(token)[:room]
                drafts.append(Draft(proposed[: forcing.valid(uid, proposed)] if proposed else [], DraftKind.GUIDED))
            else:
                drafts.append(Draft(row.lookup.propose(token)[:room]))
            acceptance = 1.0 if forced else row.lookup.acceptance if row.lookup is not None else 0.0
            estimates.append(RowDraft(len(drafts[-1].tokens), acceptance))
        longest = max(len(draft.tokens) for draft in drafts)
        width = best_width(estimates, self._costs, most=1 + longest)
        for index, draft in enumerate(drafts):
            surplus = len(draft.tokens) - (width - 1)
            if surplus > 0:
                if draft.kind is DraftKind.FORCED and forcing is not None:
                    forcing.take_back(self.uids[index], surplus)
                drafts[index] = Draft(draft.tokens[: width - 1], draft.kind)
        return drafts

    def _verify(self) -> tuple[list[StepResponse], int] | None:
        """One step over every row's block, and the positions it computed; None when no row has a draft worth
        verifying (the plain step runs)."""
        mx.eval(self._next_tokens)
        inputs = cast("list[int]", self._next_tokens.tolist())
        drafts = self._drafts(inputs)
        width = 1 + max(len(draft.tokens) for draft in drafts)
        if width == 1:
            return None
        self.counters.verify_steps += 1
        pairs = zip(inputs, drafts, strict=True)
        block = [[token, *draft.tokens] + [token] * (width - 1 - len(draft.tokens)) for token, draft in pairs]
        logits = self.model(mx.array(block), cache=self.prompt_cache)  # [rows, width, vocabulary]
        chosen, logprobs, positions = self._draw(logits, inputs, drafts)
        mx.eval(chosen)
        drawn = cast("list[list[int]]", chosen.tolist())
        accepted = [
            len(draft.tokens) if draft.kind is DraftKind.FORCED else _agreeing(draft.tokens, drawn[index])
            for index, draft in enumerate(drafts)
        ]
        self._draw_guided(logits, inputs=inputs, drafts=drafts, accepted=accepted, drawn=drawn, logprobs=logprobs)
        emitted: list[tuple[list[int], list[mx.array], int, int]] = []
        next_logprobs: list[mx.array] = []
        for index, (token, draft) in enumerate(zip(inputs, drafts, strict=True)):
            kept, row_logprobs = accepted[index], logprobs[index]
            vectors = [self._next_logprobs[index], *row_logprobs[:kept]]
            emitted.append(([token, *draft.tokens[:kept]], vectors, len(draft.tokens), kept))
            next_logprobs.append(row_logprobs[kept])
            sampler = self._sampler(index)
            start = positions[index]
            if isinstance(sampler, SeededSampler) and start is not None:
                sampler.position = start + kept + 1  # the kept tokens and the draw after them
        for cache in self.prompt_cache:
            cache.keep([1 + kept for kept in accepted], width)
        self._next_tokens = mx.array([drawn[index][kept] for index, kept in enumerate(accepted)], dtype=mx.uint32)
        self._next_logprobs = next_logprobs
        return self._respond(emitted, drafts), len(inputs) * width

    def _draw_guided(
        self,
        logits: mx.array,
        *,
        inputs: list[int],
        drafts: list[Draft],
        accepted: list[int],
        drawn: list[list[int]],
        logprobs: list[mx.array],
    ) -> None:
        """The draws after the kept part of guided drafts: under the grammar's mask once it has read those tokens
        (through the row's processors, as a plain step would), written into `drawn` and `logprobs` in place."""
        draws: list[tuple[int, int, mx.array]] = []
        for index, draft in enumerate(drafts):
            if draft.kind is not DraftKind.GUIDED or not draft.tokens:
                continue
            kept = accepted[index]
            tokens = mx.array([inputs[index], *draft.tokens[:kept]], dtype=mx.int32)
            context = self._token_context[index].update_and_fetch(tokens)
            row_logits = logits[index, kept : kept + 1]
            for processor in self.logits_processors[index]:
                row_logits = processor(context, row_logits)
            row_logprobs = row_logits - mx.logsumexp(row_logits, axis=-1, keepdims=True)
            logprobs[index] = mx.concatenate([logprobs[index][:kept], row_logprobs], axis=0)
            draws.append((index, kept, self._sampler(index)(row_logprobs).reshape(1)))
        if draws:
            mx.eval([draw for _, _, draw in draws])
            for index, kept, draw in draws:
                drawn[index][kept] = cast("int", draw.item())

    def _sampler(self, index: int) -> Any:
        samplers = self.samplers or []
        sampler = samplers[index] if index < len(samplers) else None
        return self.fallback_sampler if sampler is None else sampler

    def _draw(
        self, logits: mx.array, inputs: list[int], drafts: list[Draft]
    ) -> tuple[mx.array, list[mx.array], list[int | None]]:
        """Each row's own choice at each block position (the last of a forced block only), its logprobs per
        position, and for a seeded sampler the token position of block position 0 (None otherwise), to set it
        after the kept tokens. A guided row's choices are its plain argmax here (`_draw_guided` draws after its
        kept tokens)."""
        choices: list[mx.array] = []
        logprobs: list[mx.array] = []
        positions: list[int | None] = []
        greedy = mx.argmax(logits, axis=-1)  # [rows, width]: a greedy row needs no normalised logits
        for index, draft in enumerate(drafts):
            guided = draft.kind is DraftKind.GUIDED and bool(draft.tokens)
            processors = bool(self.logits_processors[index]) and not guided
            row_logits = self._processed(index, logits[index], inputs[index], draft) if processors else logits[index]
            row_logprobs = row_logits - mx.logsumexp(row_logits, axis=-1, keepdims=True)
            logprobs.append(row_logprobs)
            sampler = self._sampler(index)
            if not processors and (sampler is greedy_sampler or guided):
                choices.append(greedy[index])
                positions.append(None)
                continue
            first = len(draft.tokens) if draft.kind is DraftKind.FORCED else 0
            seeded = isinstance(sampler, SeededSampler)
            positions.append(sampler.position - first if seeded else None)
            drawn: list[mx.array] = [mx.zeros((first,), dtype=mx.uint32)]
            for position in range(first, len(draft.tokens) + 1):
                drawn.append(sampler(row_logprobs[position : position + 1]).reshape(1).astype(mx.uint32))
            drawn.append(mx.zeros((logits.shape[1] - len(draft.tokens) - 1,), dtype=mx.uint32))
            choices.append(mx.concatenate(drawn))
        return mx.stack(choices), logprobs, positions

    def _processed(self, index: int, logits: mx.array, token: int, draft: Draft) -> mx.array:
        """A row's logits with its processors applied at the one position it draws at (after forced tokens),
        given the tokens up to there (processors read one step's tokens from their context)."""
        forced = draft.kind is DraftKind.FORCED
        position = len(draft.tokens) if forced else 0
        read = [token, *draft.tokens] if forced else [token]
        context = self._token_context[index].update_and_fetch(mx.array(read, dtype=mx.int32))
        processed = logits[position : position + 1]
        for processor in self.logits_processors[index]:
            processed = processor(context, processed)
        return mx.concatenate([logits[:position], processed, logits[position + 1 :]], axis=0)

    def _respond(
        self, emitted: list[tuple[list[int], list[mx.array], int, int]], drafts: list[Draft]
    ) -> list[StepResponse]:
        responses: list[StepResponse] = []
        keep: list[int] = []
        for index, (tokens, logprobs, drafted, accepted) in enumerate(emitted):
            forced = drafts[index].kind is DraftKind.FORCED
            row = self._rows[index]
            if row.lookup is not None:
                row.lookup.extend(tokens)
                if drafted and not forced:
                    row.lookup.record(drafted, accepted)
                elif not forced:
                    row.lookup.shadow()
            finish: str | None = None
            for position, token in enumerate(tokens):
                self._num_tokens[index] += 1
                if self._num_tokens[index] >= self.max_tokens[index]:
                    finish = "length"
                if self._matchers[index].advance(token):
                    finish = "stop"
                if finish is not None:
                    del tokens[position + 1 :], logprobs[position + 1 :]
                    break
            self.tokens[index].extend(tokens)
            if forced:
                self.counters.forced += drafted
            else:
                self.counters.drafted += drafted
                self.counters.accepted += accepted
            self.counters.tokens += len(tokens)
            done = finish is not None
            responses.append(
                StepResponse(
                    uid=self.uids[index],
                    tokens=tokens,
                    logprobs=logprobs,
                    finish_reason=finish,
                    prompt_cache=self.extract_prefix(index, len(self.tokens[index])) if done else None,
                    all_tokens=self.tokens[index] if done else None,
                    drafted=0 if forced else drafted,
                    accepted=0 if forced else accepted,
                    forced=drafted if forced else 0,
                )
            )
            if not done:
                keep.append(index)
        if len(keep) < len(self.uids):
            self.filter(keep)
        return responses


def _agreeing(draft: Sequence[int], drawn: Sequence[int]) -> int:
    """How many of the draft's tokens, from the first, equal what the sequence drew at their positions."""
    count = 0
    while count < len(draft) and draft[count] == drawn[count]:
        count += 1
    return count


class SpeculativeGenerator(BatchGenerator):  # type: ignore[misc]
    """mlx-lm's continuous batching with multi-token decode steps (see the module docstring)."""

    def __init__(
        self,
        model: Any,
        *,
        lookup: LookupLimits | None,
        counters: SpeculationCounters,
        costs: StepCosts | None = None,
        kv_quantization: KvQuantization | None = None,
        **options: Any,
    ) -> None:
        super().__init__(model, **options)
        self._generation_batch = SpeculativeGenerationBatch.create(
            self.model, self.sampler, lookup, counters, costs or StepCosts()
        )
        self._generation_batch.kv_quantization = kv_quantization

    def set_forcing(self, forcing: Forcing | None) -> None:
        self._generation_batch.forcing = forcing
