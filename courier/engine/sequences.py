"""The sequences in the batch: each one's state beside the generator, found by uid or by request.

A request runs one sequence, or `n` for `n` samples; mlx-lm's generator knows each by a uid. A `RunningSequence`
keeps what the generator does not: its request, detokenizer and stop matcher, what it generated (for a replay
after a fault), its own sampler, grammar state and logits processors, and its counts. `Sequences` is the registry;
it is also the speculative generator's `Forcing`: what a sequence's grammar forces and accepts, by uid.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from mlx_lm.sample_utils import greedy_sampler

from courier.core.stop_text import StopTextMatcher
from courier.engine.constrained import ConstrainedSequence
from courier.engine.engine_io import EngineRequest
from courier.engine.generation import RequestId
from courier.engine.sampling import Sampler
from courier.engine.shared_prefix import SharedState


@dataclass(slots=True, kw_only=True)
class RunningSequence:
    request: EngineRequest
    uid: int
    detokenizer: Any
    stop: StopTextMatcher
    cached_tokens: int = 0
    generated: int = 0
    prompt_done: bool = False  # its prompt is prefilled: it decodes (its first token may not be out yet)
    prompt_depth: int = 0  # how much of its prompt its state holds (what its next prefill chunk attends to)
    # A dense cache prefills its history and generation prompt in one segment; its boundary snapshot is then cut
    # from the state at the end of the prompt (0: none to cut).
    cut_boundary: int = 0
    shared: SharedState | None = None
    token_ids: list[int] = field(default_factory=list)  # generated so far, for a replay after a fault
    sampler: Sampler = greedy_sampler  # its request's own (a grammar's wraps it); kept for a replay
    constrained: ConstrainedSequence | None = None  # its grammar state, kept for a replay too
    processors: list[Any] = field(default_factory=list)  # penalties, bias, grammar: kept for a replay too
    snapshot_prompt_tokens: int = 0  # how much of the prompt the snapshots it took cover
    unsent_ids: list[int] = field(default_factory=list)  # generated, but in no event yet (they added no text)
    drafted: int = 0  # draft tokens verified for it, accepted of them, and tokens its grammar forced
    accepted: int = 0
    forced: int = 0

    @property
    def decoding(self) -> bool:
        """Its prompt is prefilled or it has generated: each step decodes a token of it."""
        return self.prompt_done or self.generated > 0

    @property
    def depth(self) -> int:
        """The positions its state holds: the prompt as far as prefilled, then what it generated."""
        if self.decoding:
            return len(self.request.prompt_tokens) + self.generated
        return self.prompt_depth

    def took_snapshot(self, tokens: int) -> None:
        self.snapshot_prompt_tokens = max(self.snapshot_prompt_tokens, min(tokens, len(self.request.prompt_tokens)))

    @property
    def cache_write_tokens(self) -> int:
        return max(0, self.snapshot_prompt_tokens - self.cached_tokens)

    @property
    def batch_sampler(self) -> Sampler:
        """What the generator samples it with: its grammar's sampler over its own, or its own."""
        return self.constrained.sample if self.constrained is not None else self.sampler

    def release(self) -> None:
        """It left the batch: its grammar's mask row is freed, and it no longer holds a shared prefix."""
        if self.constrained is not None:
            self.constrained.release()
            self.constrained = None
        if self.shared is not None:
            self.shared.users.discard(self.uid)


class Sequences:
    """The running sequences by uid, and each request's uids in the order its samples joined."""

    def __init__(self) -> None:
        self._by_uid: dict[int, RunningSequence] = {}
        self._uids_by_request: dict[RequestId, list[int]] = {}

    def __len__(self) -> int:
        return len(self._by_uid)

    def __iter__(self) -> Iterator[RunningSequence]:
        return iter(list(self._by_uid.values()))

    def get(self, uid: int) -> RunningSequence | None:
        return self._by_uid.get(uid)

    def add(self, sequence: RunningSequence) -> None:
        self._by_uid[sequence.uid] = sequence
        self._uids_by_request.setdefault(sequence.request.request_id, []).append(sequence.uid)
        if sequence.shared is not None:
            sequence.shared.users.add(sequence.uid)

    def of_request(self, request_id: RequestId) -> list[RunningSequence]:
        return [self._by_uid[uid] for uid in self._uids_by_request.get(request_id, [])]

    def remove(self, sequence: RunningSequence) -> None:
        """A sequence that ended leaves the registry, released."""
        self._by_uid.pop(sequence.uid, None)
        request_id = sequence.request.request_id
        uids = self._uids_by_request.get(request_id, [])
        if sequence.uid in uids:
            uids.remove(sequence.uid)
        if not uids:
            self._uids_by_request.pop(request_id, None)
        sequence.release()

    def take_request(self, request_id: RequestId) -> list[RunningSequence]:
        """All of a request's sequences, out of the registry and released."""
        taken = [self._by_uid.pop(uid) for uid in self._uids_by_request.pop(request_id, [])]
        for sequence in taken:
            sequence.release()
        return taken

    def take_all(self) -> list[RunningSequence]:
        """Every sequence, out of the registry (not released: a replay puts them back)."""
        taken = list(self._by_uid.values())
        self._by_uid.clear()
        self._uids_by_request.clear()
        return taken

    # Forcing: the speculative generator asks these by uid.

    def may_force(self, uid: int) -> bool:
        """Whether a sequence's grammar holds its output now."""
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
