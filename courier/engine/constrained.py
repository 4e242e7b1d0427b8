"""Constrained sequences in the batch: grammar masks on the logits, filled off the MLX thread with a bounded wait.

mlx-lm's generation batch calls, each step, every sequence's logits processors (with the tokens so far) and then
every sequence's sampler. A constrained sequence gets one of each from a `ConstrainedSequence`: the processor reads
the token it generated last step, advances its grammar matcher (host side) and starts filling its mask on a worker
thread (`MaskFiller`), so a step's masks are computed together, beside the
forward pass; the first sampler called in the step waits for them, each for at most `FILL_BUDGET_S`, and each
sampler then keeps its row's allowed tokens (renormalised where top_p needs it) and samples as asked (temperature,
top_p, seed). An unconstrained sequence has neither, so a batch without constraints runs exactly as before.

A triggered constraint (a tool call in `auto` mode) leaves text free until the trigger (the call's start marker)
appears in the output; from there the grammar holds until the call is complete, then text is free again, or, when
only one call is allowed, the output ends. A grammar that cannot go on ends the output at once and says so
(`failure`): a matcher in error (past a limit llguidance meets only while parsing, such as a row of more than
`max_items_in_row` items, or a token it refuses after a replay gone wrong), a mask that allows nothing, or a mask
not ready within the step budget. The
engine then reports the reply as cut (`finish_reason: "length"`), never as a stop with partial text.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from concurrent.futures import TimeoutError as FutureTimeout
from enum import Enum
from typing import Any

import mlx.core as mx
import numpy as np
from llguidance import LLMatcher
from llguidance.numpy import fill_next_token_bitmask
from mlx_lm.sample_utils import greedy_sampler

from courier.engine.generated_tokens import GeneratedTokens
from courier.engine.sampling import SeededSampler
from courier.grammar.compiler import GrammarCompiler
from courier.grammar.constraint import Constraint

logger = logging.getLogger(__name__)

Sampler = Callable[[mx.array], mx.array]
RECENT_FILLS = 4096
# The longest a step waits for one sequence's mask, from when its fill started; a sequence whose mask is later ends,
# cut. llguidance's limits (`grammar/constraint.py`: lexer fuel and Earley items per step) hold a mask to about 20 ms
# of work, so this is only met by a machine starved of CPU; it bounds what one grammar can add to a step.
FILL_BUDGET_S = 0.25
# The most a step spends finding the tokens a sequence's grammar forces (`forced_after`): each candidate takes a
# mask. Those not found in time are sampled like any other token, under the mask, in the next steps: lossless.
FORCE_BUDGET_S = 0.02
FILL_WORKERS = max(1, min(8, os.cpu_count() or 1))  # masks filled at once (llguidance computes a mask in one thread)


class MaskFiller:
    """Each constrained sequence's next mask, filled off the MLX thread, with a bounded wait.

    A row's fill starts on a worker thread as soon as its grammar has read the step's token (`due`, from the
    logits processor), so the masks of a step are computed together, beside the forward pass. The first sampler of
    the step waits for them (`row`), each at most `budget_s` from when it started: a mask still not ready then is
    not waited for, and its sequence ends, cut (llguidance's limits bound a mask to tens of milliseconds, so only
    a pathological grammar on a starved machine gets there). A fill that is given up finishes on its own and is
    dropped; each fill writes into an array of its own, so nothing it holds is reused meanwhile.
    """

    def __init__(self, vocab_size: int, rows: int, *, budget_s: float = FILL_BUDGET_S) -> None:
        self.vocab_size = vocab_size
        self.budget_s = budget_s
        self._words = (vocab_size + 31) // 32
        self._free = list(range(max(1, rows)))
        self._rows = max(1, rows)
        self._pool = ThreadPoolExecutor(max_workers=FILL_WORKERS, thread_name_prefix="courier-masks")
        self._fills: dict[int, tuple[float, Future[np.ndarray[Any, np.dtype[np.int32]]]]] = {}
        self._due: list[int] = []  # rows whose fill started since the step's masks were last collected
        self._masks: dict[int, np.ndarray[Any, np.dtype[np.int32]]] = {}
        self._missing: dict[int, str] = {}  # rows whose mask this step did not get, and why
        self.late = 0  # masks not ready within the budget, since start
        # Seconds per fill and rows per fill, most recent last (bench/structured.py reads them).
        self.fill_seconds: deque[float] = deque(maxlen=RECENT_FILLS)
        self.fill_rows: deque[int] = deque(maxlen=RECENT_FILLS)

    def acquire(self) -> int:
        if not self._free:  # more constrained sequences than rows (a replay after a fault): grow
            self._free.extend(range(self._rows, 2 * self._rows))
            self._rows *= 2
        return self._free.pop()

    def release(self, row: int) -> None:
        """The row's sequence has left: a fill still running for it finishes on its own and is dropped."""
        self._fills.pop(row, None)
        self._masks.pop(row, None)
        self._missing.pop(row, None)
        if row in self._due:
            self._due.remove(row)
        self._free.append(row)

    def due(self, row: int, matcher: LLMatcher) -> None:
        """Start filling the row's mask from `matcher`, which must not be touched until `row` has answered."""
        self.settle(row)
        self._fills[row] = (time.perf_counter(), self._pool.submit(self._fill, matcher))
        self._due.append(row)

    def settle(self, row: int) -> None:
        """Wait for a fill of the row still out (one its sampler never collected), so its matcher is free again."""
        pending = self._fills.pop(row, None)
        if pending is not None:
            wait([pending[1]])
            if row in self._due:
                self._due.remove(row)

    def row(self, row: int) -> np.ndarray[Any, np.dtype[np.int32]] | None:
        """The row's mask for this step; None when it was not ready within the budget (`missing` says why)."""
        if self._due:
            self._collect()
        if row in self._missing:
            return None
        return self._masks.get(row)

    def missing(self, row: int) -> str:
        return self._missing.pop(row, "") or "its grammar's mask was not computed"

    def _collect(self) -> None:
        """Wait for every mask due this step, each at most the budget from when it started."""
        due, self._due = self._due, []
        first = min(self._fills[row][0] for row in due if row in self._fills) if due else time.perf_counter()
        for row in due:
            pending = self._fills.pop(row, None)
            if pending is None:
                continue
            started, future = pending
            try:
                self._masks[row] = future.result(timeout=max(0.0, started + self.budget_s - time.perf_counter()))
            except FutureTimeout:
                self.late += 1
                self._missing[row] = f"its grammar's mask was not ready within the step budget ({self.budget_s:g} s)"
            except Exception as error:  # a fill that raised fails its own sequence only
                self._missing[row] = f"its grammar's mask could not be computed: {error}"
        self.fill_seconds.append(time.perf_counter() - first)
        self.fill_rows.append(len(due))

    def _fill(self, matcher: LLMatcher) -> np.ndarray[Any, np.dtype[np.int32]]:
        mask = np.full((1, self._words), -1, dtype=np.int32)
        fill_next_token_bitmask(matcher, mask, 0)
        row: np.ndarray[Any, np.dtype[np.int32]] = mask[0]
        return row


class _Phase(Enum):
    FREE = "free"  # before a trigger, or between triggered calls
    CONSTRAINED = "constrained"
    DONE = "done"  # only an end-of-sequence token may follow


class ConstrainedSequence:
    """A sequence's grammar state, with the logits processor and the sampler that carry it."""

    def __init__(
        self,
        constraint: Constraint,
        *,
        compiler: GrammarCompiler,
        filler: MaskFiller,
        decode: Callable[[Sequence[int]], str],
        prompt_length: int,
        sampler: Sampler,
        eos_tokens: Sequence[int],
        renormalize: bool = False,
        generated: GeneratedTokens | None = None,
    ) -> None:
        self.constraint = constraint
        self._compiler = compiler
        self._filler = filler
        self._decode = decode
        self._tokens = generated or GeneratedTokens(prompt_length)
        self._consumed = 0  # how many of the generated tokens the grammar state has seen
        self._inner = sampler
        # Only a sampler that reads probabilities (top_p) needs the masked distribution renormalised: greedy and
        # temperature sampling take logits as they are, and a log-sum-exp over the vocabulary costs as much as
        # the rest of the mask (about 0.9 ms for 49k tokens on a CPU).
        self._renormalize = renormalize
        # Built here, on the MLX thread (an array made on another thread's stream cannot be used on this one).
        self._eos = sorted(set(eos_tokens))
        self._eos_bias: mx.array | None = None
        self._row = filler.acquire()
        self._tail = ""  # the end of the free text, to spot the trigger
        self._matcher: LLMatcher | None = None
        self._stopped: LLMatcher | None = None  # the matcher the last forced run completed, if it did
        self.phase = _Phase.FREE
        self.failure = ""  # why the grammar could not go on ("" while it can): the output then ends, cut
        if not constraint.trigger:
            self._start_matching()

    @property
    def generated(self) -> GeneratedTokens:
        return self._tokens

    @property
    def processors(self) -> list[Callable[[mx.array, mx.array], mx.array]]:
        return [self.process]

    def release(self) -> None:
        self._filler.release(self._row)

    @property
    def matching(self) -> bool:
        """Whether its grammar holds the output now (a forced continuation is possible)."""
        return self.phase is _Phase.CONSTRAINED

    @property
    def greedy(self) -> bool:
        """Whether it decodes greedily (a guided draft is then verified by its plain argmax)."""
        return self._inner is greedy_sampler

    def valid(self, tokens: list[int]) -> int:
        """How many of `tokens`, from the first, its grammar accepts in its present state."""
        if self.phase is not _Phase.CONSTRAINED or self._matcher is None:
            return 0
        self._filler.settle(self._row)
        return int(self._matcher.validate_tokens(tokens))

    def forced_after(self, token: int, most: int) -> list[int]:
        """Advance the grammar over `token` (the step's input, not yet read from the context) and over the tokens
        the grammar then forces (at most `most`), and return those: taken as generated, appended without sampling,
        unless `take_back` gives some of them back.

        Forced means the mask allows that one token and no other: the grammar's forced text can often be written
        as other tokens too (`{"` or `{` then `"`), and the model's choice among them is kept. A seeded sampler
        passes over their draws, so what it samples after them is what it would have.

        Each candidate costs a mask: the search stops after `FORCE_BUDGET_S`, and the tokens not reached are
        sampled under the mask in the next steps, as they would be without fast-forward."""
        self._filler.settle(self._row)
        self._advance(token)
        self._consumed += 1
        forced: list[int] = []
        self._stopped = None
        if self.phase is not _Phase.CONSTRAINED or self._matcher is None:
            return forced
        until = time.perf_counter() + FORCE_BUDGET_S
        for candidate in self._matcher.compute_ff_tokens()[:most]:
            matcher = self._matcher
            if (
                matcher is None
                or self.phase is not _Phase.CONSTRAINED
                or time.perf_counter() > until
                or not _only(matcher.compute_bitmask(), candidate)
            ):
                break
            self._advance(candidate)
            if self.failure:  # refused after all (a limit met while parsing): not written
                break
            if self._matcher is None:  # the grammar is complete: kept, in case the run is cut
                self._stopped = matcher
            forced.append(candidate)
        self._consumed += len(forced)
        if self.seeded is not None:
            self.seeded.skip(len(forced))
        return forced

    def take_back(self, count: int) -> None:
        """The last `count` tokens of the last forced run are not appended: the grammar and a seeded sampler's
        position go back to where they stood before them (the step's input stays read)."""
        if count <= 0:
            return
        self._filler.settle(self._row)
        if self._stopped is not None:
            self._matcher, self.phase, self._stopped = self._stopped, _Phase.CONSTRAINED, None
        if self._matcher is None or not self._matcher.rollback(count):
            raise RuntimeError(f"{self.constraint.label}: the grammar could not take back {count} forced tokens")
        self._consumed -= count
        if self.seeded is not None:
            self.seeded.position -= count

    @property
    def seeded(self) -> SeededSampler | None:
        """Its request's own seeded sampler, if it has one (a replay sets its position)."""
        return self._inner if isinstance(self._inner, SeededSampler) else None

    def process(self, context: mx.array, logits: mx.array) -> mx.array:
        """The logits processor: advance the matcher over the tokens generated since the last step.

        A context shorter than what was read is a replay after a fault that lost the last step: the grammar state
        is rebuilt from the tokens kept.
        """
        # Reading the last token waits for the step that sampled it (mlx-lm waits for it too); only then is this
        # step's forward pass set computing, so it is not queued ahead of that read and runs while the host
        # advances the grammar and fills the masks.
        tokens = self._tokens.read(context)
        mx.async_eval(logits)  # type: ignore[no-untyped-call]
        self._filler.settle(self._row)
        if len(tokens) < self._consumed:
            self._restart()
        for token in tokens[self._consumed :]:
            self._advance(token)
        self._consumed = len(tokens)
        if self.phase is _Phase.CONSTRAINED and self._matcher is not None:
            self._filler.due(self._row, self._matcher)
        return logits

    def sample(self, logprobs: mx.array) -> mx.array:
        """The sampler: the request's own, over the tokens the grammar allows (the others at -inf)."""
        if self.phase is _Phase.FREE:
            return self._inner(logprobs)
        width = logprobs.shape[-1]
        row = self._filler.row(self._row) if self.phase is _Phase.CONSTRAINED else None
        if row is None and self.phase is _Phase.CONSTRAINED:  # not ready in time: its fill still holds the matcher
            self._fail(self._filler.missing(self._row))
        elif row is not None and self._matcher is not None and (self._matcher.is_error() or not row.any()):
            self._fail(self._matcher.get_error() or "no token can continue the output")
            row = None
        bias = self._end_bias(width) if row is None else self._bias(row, width)
        masked = logprobs + bias
        if self._renormalize:
            masked = masked - mx.logsumexp(masked, axis=-1, keepdims=True)
        return self._inner(masked)

    @staticmethod
    def _bias(row: np.ndarray[Any, np.dtype[np.int32]], width: int) -> mx.array:
        """0 for the tokens the row allows, -inf for the others (built on the host: one array, one transfer)."""
        bits = np.unpackbits(row.view(np.uint8), bitorder="little")[:width]  # bit i of word w: token 32 w + i
        bias = np.full(width, -np.inf, dtype=np.float32)
        bias[: bits.size][bits.astype(bool)] = 0.0
        return mx.array(bias)

    def _end_bias(self, width: int) -> mx.array:
        if self._eos_bias is None or self._eos_bias.size != width:
            bias = np.full(width, -np.inf, dtype=np.float32)
            bias[[token for token in self._eos if token < width]] = 0.0
            self._eos_bias = mx.array(bias)
        return self._eos_bias

    def _restart(self) -> None:
        """Back to the grammar state before any token: the caller advances it again over the tokens kept."""
        self._tail, self._matcher, self.phase, self._consumed = "", None, _Phase.FREE, 0
        self._stopped, self.failure = None, ""
        if not self.constraint.trigger:
            self._start_matching()

    def _advance(self, token: int) -> None:
        if self.phase is _Phase.FREE:
            trigger = self.constraint.trigger
            self._tail = (self._tail + self._decode([token]))[-(len(trigger) + 32) :]
            at = self._tail.find(trigger) if trigger else -1
            if at >= 0:
                rest = self._tail[at + len(trigger) :]  # the token went on past the marker: the call's start
                self._tail = ""
                self._start_matching()
                for piece in self._compiler.tokenizer.tokenize_str(rest) if rest else ():
                    self._advance(piece)
            return
        if self.phase is _Phase.DONE or self._matcher is None:
            return
        if not self._matcher.consume_token(token):  # the mask allowed it: a limit met while parsing, or a bad replay
            self._fail(f"token {token} refused: {self._matcher.get_error()}")
            return
        if self._matcher.is_stopped():
            self._matcher = None
            self.phase = _Phase.FREE if self.constraint.trigger and self.constraint.repeat else _Phase.DONE

    def _start_matching(self) -> None:
        self._matcher = self._compiler.matcher(self.constraint)
        self.phase = _Phase.CONSTRAINED

    def _fail(self, why: str) -> None:
        """The grammar cannot go on: only the end of sequence may follow, and the reply is reported cut."""
        self.failure = why.strip().splitlines()[0] if why.strip() else "the grammar failed"
        logger.warning("%s: the grammar cannot go on; the output ends, cut (%s)", self.constraint.label, self.failure)
        self.phase, self._matcher, self._stopped = _Phase.DONE, None, None


def _only(bitmask: bytes, token: int) -> bool:
    """Whether a token bitmask (bit i of the little-endian words: token i) allows `token` and nothing else."""
    allowed = int.from_bytes(bitmask, "little")
    return allowed == 1 << token
