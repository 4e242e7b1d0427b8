"""In-batch shared prefixes: which requests admitted together can prefill their common start once.

Requests that join the batch in the same step often begin with the same tokens (the
chat template's default system prompt, a long shared system prompt, the same few-shot
examples) that no stored snapshot covers. The engine prefills such a common prefix once,
at batch size one, and starts every member from a private copy of that state, so the
batch prefills only each member's own suffix.

A shared state stays usable while a request that started from it is still in flight:
a request admitted a step later (a burst whose last arrivals missed the admission
window, steady traffic with one system prompt) starts from it too, with no prefill at
all. It is dropped with the last request using it, so it never outlives the work it
was computed for (keeping states for later is the snapshot store's business).

This module only plans: pure and synchronous, no MLX. A member's `limit` is the longest
prefix it may take from a shared state: at most all but its last prompt token (the
generator needs one token to start from), and no further than its history boundary
when a boundary snapshot is due there (so that snapshot is still taken at the boundary
and stays an exact prefix state for models whose cache cannot be trimmed).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from courier.core.token_prefix import common_prefix_length

# Shortest in-batch shared prefix worth a separate prefill.
MIN_SHARED_TOKENS = 8
# Prefilling k shared tokens once instead of in each of n batch rows saves (n - 1) * k token computations, and
# costs one more forward pass. Measured with SmolLM2-135M (float32, OpenBLAS, 2 CPU cores): prefill costs ~8-9 ms
# per token at batch one and per row-token at batch eight alike, and a forward pass has ~0.1 s of fixed cost
# (dispatching 30 layers), the price of some 12 tokens. Sharing must save more than this many tokens.
FIXED_COST_TOKENS = 16


@dataclass(frozen=True, slots=True, kw_only=True)
class Candidate:
    """One admitted request, as the planner sees it."""

    tokens: Sequence[int]
    # Tokens already covered by the request's cached prefix (0: none).
    start: int
    # Requests can share only when they start from the same state: None for none, else the cached prefix's identity.
    origin: Hashable
    # The longest prefix this request may take from a shared state.
    limit: int


@dataclass(frozen=True, slots=True, kw_only=True)
class SharedPrefix:
    """Members (indices into the candidates) whose first `length` tokens are the same, from `start` on."""

    members: tuple[int, ...]
    start: int
    length: int

    @property
    def shared_tokens(self) -> int:
        return self.length - self.start


def limit_for(prompt_length: int, start: int, boundary: int) -> int:
    """The longest shared prefix a request may take: all but its last token, and not past a pending boundary."""
    limit = prompt_length - 1
    if start < boundary < prompt_length:
        limit = min(limit, boundary)
    return limit


def plan(
    candidates: Sequence[Candidate],
    *,
    min_tokens: int = MIN_SHARED_TOKENS,
    max_tokens: int | None = None,
    fixed_cost_tokens: int = FIXED_COST_TOKENS,
) -> list[SharedPrefix]:
    """Groups of candidates that share a prefix of at least `min_tokens` new tokens, worth prefilling once.

    Candidates are grouped by where they start (same origin, same start) and by their next `min_tokens` tokens;
    a group's shared prefix is its members' longest common prefix, capped by every member's `limit` and at
    `max_tokens` new tokens. A group is kept only when the batched prefill it saves exceeds the separate prefill
    it costs.
    """
    groups: defaultdict[tuple[Hashable, int, tuple[int, ...]], list[int]] = defaultdict(list)
    for index, candidate in enumerate(candidates):
        if candidate.limit - candidate.start < min_tokens:
            continue
        head = tuple(candidate.tokens[candidate.start : candidate.start + min_tokens])
        groups[(candidate.origin, candidate.start, head)].append(index)
    plans: list[SharedPrefix] = []
    for (_, start, _), members in groups.items():
        if len(members) < 2:
            continue
        length = min(candidates[index].limit for index in members)
        if max_tokens is not None:
            length = min(length, start + max_tokens)
        first = candidates[members[0]].tokens
        for index in members[1:]:
            length = start + common_prefix_length(first[start:length], candidates[index].tokens[start:length])
        shared = length - start
        if shared < min_tokens or (len(members) - 1) * shared <= fixed_cost_tokens:
            continue
        plans.append(SharedPrefix(members=tuple(members), start=start, length=length))
    return plans


@dataclass(frozen=True, slots=True, kw_only=True)
class InFlight:
    """A shared state in use: it covers `tokens`, the first `start` of them restored from `origin`."""

    origin: Hashable
    start: int
    tokens: tuple[int, ...]


def match_in_flight(
    candidate: Candidate, in_flight: Sequence[InFlight], *, trimmable: bool, min_tokens: int = MIN_SHARED_TOKENS
) -> tuple[int, int] | None:
    """The in-flight state `candidate` can start from that covers most of its prompt: (index, tokens covered).

    It must start where the candidate does (same origin, same start) and cover at least `min_tokens` more of
    the candidate's first tokens, within the candidate's limit. Only a `trimmable` (dense KV) state may serve
    a candidate that agrees with just its first part; otherwise all of its tokens must be the candidate's.
    """
    best: tuple[int, int] | None = None
    for index, shared in enumerate(in_flight):
        if shared.origin != candidate.origin or shared.start != candidate.start:
            continue
        end = min(len(shared.tokens), candidate.limit)
        covered = shared.start + common_prefix_length(
            shared.tokens[shared.start : end], candidate.tokens[shared.start : end]
        )
        if covered < len(shared.tokens) and not trimmable:
            continue
        if covered - shared.start >= min_tokens and (best is None or covered > best[1]):
            best = (index, covered)
    return best


@dataclass(slots=True, kw_only=True)
class SharedState:
    """A prefix prefilled once for requests that share it, kept while any of them is in flight."""

    key: InFlight  # its tokens; the first `key.start` of them restored from a stored snapshot
    state: list[Any]  # compact; every request starts from its own copy
    # The stored snapshot it started from, held so that its identity (`key.origin`) cannot be reused meanwhile.
    anchor: Any
    users: set[int] = field(default_factory=set)  # uids of the sequences that started from it
