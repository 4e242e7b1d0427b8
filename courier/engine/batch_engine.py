"""The batch engine: continuous batching over mlx-lm's `BatchGenerator`, on the MLX thread only.

Each `step` ends the requests past their deadline, admits new requests into the running batch (`admission.py`),
drops cancelled ones (keeping what one had prefilled of its prompt: `cancelled_prefill.py`), advances every
sequence by one decode step (and new ones by one prefill chunk, sized so that a long prompt neither stalls the
running streams nor keeps a new request out of the batch for long: `core/step_planning/prefill_budget.py`), and
turns the raw tokens into events (`step_reader.py`): detokenized text with stop strings and end-of-sequence tokens
removed, optional logprobs, and a finish when a sequence ends, with the snapshots the store keeps
(`step_snapshots.py`). A failure inside the batched forward pass starts a fresh generator and isolates the culprit
(`recovery.py`).

The engine owns the generator's lifecycle: which kind it is (mlx-lm's, or the speculative one that verifies drafts
and grammar-forced tokens in one pass, `speculative_batch.py`), and a fresh one after a fault. The sequences it
runs live in `Sequences` (`sequences.py`), which the speculative generator asks about each sequence's grammar.

Requests admitted together that begin with the same tokens (a system prompt no snapshot covers) have that prefix
prefilled once; `cached_tokens` counts only what the snapshot store served, never a shared prefix: that was
computed for the requests in flight. With a dense KV cache a conversation's boundary snapshot is cut from the
prompt's state instead of ending a prefill segment there, which saves a forward pass before the first token.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import KVCache, make_prompt_cache
from mlx_lm.tokenizer_utils import TokenizerWrapper

from courier.core.prompt_cache.quantization import KvQuantization
from courier.core.step_planning.depth_costs import StepWork
from courier.core.step_planning.prefill_budget import PrefillBudget
from courier.engine.admission import Admission
from courier.engine.cancelled_prefill import prefilled_so_far
from courier.engine.constrained import MaskFiller
from courier.engine.engine_io import BatchLimits, EngineOutput, EngineRequest
from courier.engine.generation import RequestId
from courier.engine.mlx_lm_surface import check_mlx_lm_surface
from courier.engine.quantized_generation import quantized_generator
from courier.engine.recovery import Recovery
from courier.engine.sequences import Sequences
from courier.engine.speculative_batch import SpeculationCounters, SpeculativeGenerator
from courier.engine.step_reader import StepReader, cut_at_deadline
from courier.engine.step_snapshots import boundary_snapshots
from courier.grammar.compiler import GrammarCompiler
from courier.model.vision.embedder import ImageEmbedder

logger = logging.getLogger(__name__)
# A step at least this long is logged (debug) with its parts: admission, the batched pass, rows, prefill chunk.
SLOW_STEP_S = 0.5


class BatchEngine:
    def __init__(
        self,
        model: Any,
        tokenizer: TokenizerWrapper,
        limits: BatchLimits,
        embedder: ImageEmbedder | None = None,
        grammars: GrammarCompiler | None = None,
    ) -> None:
        # The speculative generator and the ragged cache use mlx-lm's private surface: a release that moved it
        # stops start-up here, naming what moved, rather than decoding wrongly.
        check_mlx_lm_surface()
        self._model = model
        self._limits = limits
        self.masks = MaskFiller(grammars.vocab_size, limits.max_batch) if grammars is not None else None
        self._eos = frozenset(int(token) for token in tokenizer.eos_token_ids)
        # The calling thread's own default stream: the engine is built and stepped on the MLX thread, and a
        # stream created on another thread (mlx-lm's module-level one) costs a cross-thread sync every step.
        self._stream = mx.default_stream(mx.default_device())
        # Plain KV caches only (no sliding window, no recurrent state): the state after a prompt holds the exact
        # state after each of its prefixes, so a boundary snapshot needs no separate prefill segment, and a verify
        # step can take back rejected positions per sequence.
        self._dense = all(type(layer) is KVCache for layer in make_prompt_cache(model))
        self.speculation = SpeculationCounters()
        self._sequences = Sequences()
        self._admission = Admission(
            model,
            tokenizer,
            limits,
            self._sequences,
            stream=self._stream,
            dense=self._dense,
            eos=self._eos,
            embedder=embedder,
            grammars=grammars,
            masks=self.masks,
        )
        self._reader = StepReader(tokenizer, self._eos, self._sequences, limits.snapshot_quantization)
        self._recovery = Recovery(model, self._sequences, self._admission, stream=self._stream)
        self._prefill = PrefillBudget(
            stall_s=limits.prefill_stall_s, largest=limits.prefill_step_size, costs=limits.prefill_costs()
        )
        self._generator = self._new_generator()

    @property
    def model(self) -> Any:
        return self._model

    @property
    def snapshot_quantization(self) -> KvQuantization | None:
        """How the snapshots it takes store attention KV (an idle warm-up's too)."""
        return self._limits.snapshot_quantization

    @property
    def kv_quantization(self) -> KvQuantization | None:
        """How the generation batch holds attention KV (`--kv-bits`; None: as computed)."""
        return self._limits.kv_quantization

    @property
    def active(self) -> int:
        return len(self._sequences)

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
        """End `expired` (past their deadline) with what they wrote, admit `added`, drop `cancelled`, then advance
        every running sequence by one step."""
        entered = time.perf_counter()
        outputs = self._end_at_deadline(expired)
        outputs.extend(self._admission.admit(added, self._generator))
        outputs.extend(self._cancel(cancelled))
        if not self._sequences:
            return outputs
        work = self._work()
        chunk = self._generator.prefill_step_size = self._prefill.chunk(work)
        started = time.perf_counter()
        try:
            with self._generator.stats() as done:
                prompt_responses, responses = self._generator.next()
        except Exception as error:  # a fault in the batched forward pass: isolate the culprit, keep serving
            self._generator = self._new_generator()
            self._admission.shared.clear()
            return outputs + self._recovery.recover(error, self._generator)
        ended = time.perf_counter()
        self._prefill.observe(work, chunk=chunk, prompt_tokens=done.prompt_tokens, seconds=ended - started)
        if ended - entered >= SLOW_STEP_S:
            costs = self._prefill.costs
            logger.debug(
                "slow step: %.2f s admitting %d, %.2f s batched pass (%d decoding, deepest %d; %d prefilling, "
                "deepest %d, chunk %d, %d prompt tokens; costed %.3f s + %.2e s/position + %.2e s/pair attended)",
                started - entered,
                len(added),
                ended - started,
                len(work.decode_depths),
                max(work.decode_depths, default=0),
                len(work.prefill_depths),
                max(work.prefill_depths, default=0),
                chunk,
                done.prompt_tokens,
                costs.fixed,
                costs.per_position,
                costs.per_attended,
            )
        for response in prompt_responses:
            if (sequence := self._sequences.get(response.uid)) is not None:
                done_tokens, total = response.progress
                sequence.prompt_depth = max(0, len(sequence.request.prompt_tokens) - (total - done_tokens))
                sequence.prompt_done = sequence.prompt_done or response.end_of_prompt
        self._recovery.step_succeeded()
        if responses and not self.speculating:  # a speculative generator counts its own steps
            self.speculation.steps += 1
            self.speculation.tokens += len(responses)
        outputs.extend(
            boundary_snapshots(prompt_responses, self._sequences, self._generator, self._limits.snapshot_quantization)
        )
        for response in responses:
            sequence = self._sequences.get(response.uid)
            if sequence is not None:
                outputs.extend(self._reader.advance(sequence, response, self._generator))
        return outputs

    def admission_seconds(self, prompts: Sequence[tuple[int, int]]) -> float:
        """About how long the step admitting `prompts` (each its cached depth and its tokens still to prefill)
        takes with nothing else running, by the cost model its chunks are sized with (`prefill_budget.py`), as
        fitted last. It reads only that model and settings, so the scheduler asks it on the event loop: the MLX
        thread may be stepping another model meanwhile."""
        if not prompts:
            return 0.0
        costs = self._prefill.latest_costs
        work = StepWork(prefill_depths=[depth for depth, _ in prompts[: self._limits.prefill_batch]])
        chunk = min(self._prefill.chunk(work, costs), max(tokens for _, tokens in prompts))
        return costs.estimate(work.positions(chunk), work.attended(chunk))

    def _work(self) -> StepWork:
        """What this step processes: a token of each decoding sequence, a chunk of each prompt being prefilled
        (the first `prefill_batch` waiting, as the generator takes them), each at its depth."""
        decode_depths: list[int] = []
        prefill_depths: list[int] = []
        for sequence in self._sequences:
            if sequence.decoding:
                decode_depths.append(sequence.depth)
            elif len(prefill_depths) < self._limits.prefill_batch:
                prefill_depths.append(sequence.depth)
        return StepWork(decode_depths=decode_depths, prefill_depths=prefill_depths)

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
                kv_quantization=self._limits.kv_quantization,
                **options,
            )
            generator.set_forcing(self._sequences)
            return generator
        if self._limits.kv_quantization is not None:
            return quantized_generator(self._model, self._limits.kv_quantization, **options)
        return BatchGenerator(self._model, **options)

    def _cancel(self, request_ids: Sequence[RequestId]) -> list[EngineOutput]:
        """Requests whose consumers left leave the batch; what one had prefilled of its prompt is kept for the store
        (`cancelled_prefill.py`), so the same request sent again does not prefill it again."""
        outputs: list[EngineOutput] = []
        for request_id in request_ids:
            taken = self._sequences.take_request(request_id)
            if taken:
                outputs.extend(prefilled_so_far(taken, self._generator, self._limits.snapshot_quantization))
                self._generator.remove([sequence.uid for sequence in taken])
        return outputs

    def _end_at_deadline(self, request_ids: Sequence[RequestId]) -> list[EngineOutput]:
        """Requests past their deadline leave the batch. Each sequence that wrote tokens ends as a length cut with
        them; one that wrote none fails."""
        outputs: list[EngineOutput] = []
        for request_id in request_ids:
            taken = self._sequences.take_request(request_id)
            if taken:
                self._generator.remove([sequence.uid for sequence in taken])
            for sequence in taken:
                outputs.extend(EngineOutput(request_id, event) for event in cut_at_deadline(sequence))
        return outputs
