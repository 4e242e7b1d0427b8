"""How a lookup chooses among the snapshots that share a prefix with a prompt, and which entries a new one makes
redundant: the snapshot store's matching rules, as functions over its entries (see `snapshot_store.py`).

Why a boundary supersedes a completion but never the reverse: the idle warm-up extends a conversation's boundary over
the reply just given, so that turn's completion (prompt + generated tokens) is a strict prefix of the new boundary
whenever the reply re-tokenizes into the tokens generated. When it does not, the boundary starts with the
completion's prompt (but its last token: the generation prompt's trailing newline may merge with the reply) and
diverges inside the reply: the conversation goes on from the boundary, and the completion could serve only a prompt
carrying the reply as generated, which the re-rendered history never does. Either way the next prompt starts with the
boundary and matches it further (on a trimmable cache the boundary, trimmed, serves any prompt the completion would,
up to where the two part); keeping both would double what a conversation holds. A completion never removes a
boundary: the next prompt re-renders the reply, so only the boundary is sure to be a prefix of it.

Sessions: the anonymous session is one session shared by every caller that names none, so there a boundary may also
remove another anonymous caller's completion, but only one whose whole prompt (but its last token) it repeats: a
caller that sent the same history and got another reply. That caller then prefills its reply once more, in its idle
warm-up (which starts from the prompt instead) or, when its next turn comes first and the reply re-tokenizes as
generated, in that turn. Lookup's `continues` already lets the next completion of a repeated history supersede such a
sibling, so the anonymous session keeps the rule every session has.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from courier.core.prompt_cache.divergence import Divergence, divergence
from courier.core.prompt_cache.entries import ANONYMOUS_SESSION, MISS, Bucket, EntryId, LookupResult, Origin, Snapshot
from courier.core.prompt_cache.radix_index import PathMatch


def best_match(
    entries: Mapping[EntryId, Snapshot],
    match: PathMatch[EntryId],
    session: str,
    tokens: tuple[int, ...],
    *,
    trimmable: bool,
) -> LookupResult:
    """The longest usable prefix among `match`'s entries; the session's own win ties; on a `trimmable` cache an
    entry that goes on past the shared prefix serves it trimmed."""
    # A usable prefix must leave at least one token to feed: the state after the whole prompt has no logits.
    usable = len(tokens) - 1
    own: tuple[int, Snapshot] | None = None
    other: tuple[int, Snapshot] | None = None
    for length, keys in match.prefixes:
        for key in keys:
            snapshot = entries[key]
            fits = length <= usable or trimmable
            if not fits:
                continue
            if snapshot.session == session:
                own = (length, snapshot)
            elif other is None or length > other[0]:
                other = (length, snapshot)
    best = LookupResult(snapshot=own[1], matched=min(own[0], usable)) if own else MISS
    if other is not None and other[0] > (own[0] if own else 0):
        best = LookupResult(snapshot=other[1], matched=min(other[0], usable), cross_session=True)
    if trimmable and match.shared_length > best.matched and match.keys_below_shared:
        below = diverging(entries, match.keys_below_shared, session)
        shared = min(match.shared_length, usable)
        # As long and held in memory beats one that must be read back from disk (a regenerated prompt).
        in_memory_instead = best.snapshot is not None and not best.snapshot.state_held and below.state_held
        if shared > best.matched or (shared == best.matched and in_memory_instead):
            return LookupResult(snapshot=below, matched=shared, trimmed=True, cross_session=below.session != session)
    if best.snapshot is not None and best.matched < len(best.snapshot.tokens):
        return LookupResult(
            snapshot=best.snapshot, matched=best.matched, trimmed=True, cross_session=best.cross_session
        )
    return best


def divergence_of(
    entries: Mapping[EntryId, Snapshot],
    bucket: Bucket,
    session: str,
    vector: tuple[int, ...],
    *,
    match: PathMatch[EntryId],
    matched: int,
) -> Divergence | None:
    """Where `vector` leaves the entry sharing the longest prefix with it (the session's own first), when the
    lookup missed (`matched` 0) or that entry is the session's own: its cached history no longer prefixes the
    prompt. None when every entry sharing that prefix ends there (the prompt only goes on past them), or the
    lookup reused a prefix and what diverges further is another conversation's (a shared system prompt)."""
    index = match.shared_length
    if index == 0 or index >= len(vector):
        return None
    leaving = [entries[key] for key in match.keys_below_shared if len(entries[key].tokens) > index]
    # The anonymous session is every caller that names none: its entries are no one conversation's history.
    own = [entry for entry in leaving if entry.session == session != ANONYMOUS_SESSION]
    if not leaving or (matched and not own):
        return None
    closest = max(own or leaving, key=lambda entry: entry.last_used)
    return divergence(
        prompt=vector,
        closest=closest.tokens,
        index=index,
        matched=matched,
        session=session,
        tenant=bucket.tenant,
        same_session=bool(own),
    )


def diverging(entries: Mapping[EntryId, Snapshot], keys: Sequence[EntryId], session: str) -> Snapshot:
    """The entry to trim among those going on past a shared prefix: the session's own, held in memory, latest used."""
    snapshots = [entries[key] for key in keys]
    own = [snapshot for snapshot in snapshots if snapshot.session == session]
    return max(own or snapshots, key=lambda snapshot: (snapshot.state_held, snapshot.last_used))


def covers(new: Origin, old: Origin, *, strict: bool) -> bool:
    """Whether a new snapshot of origin `new` makes an old one of origin `old`, whose tokens prefix it, redundant."""
    # A boundary extended over a turn's reply covers that turn's completion; a completion never covers a boundary.
    return new is old or (strict and new is Origin.BOUNDARY and old is Origin.COMPLETION)


def continues_prompt(vector: tuple[int, ...], completion: Snapshot) -> bool:
    """Whether `vector` starts with the completion's prompt, all but its last token: the generation prompt's trailing
    newline can merge with the start of the reply when the history is re-rendered (byte-level BPE)."""
    kept = completion.prompt_length - 1
    return kept > 0 and vector[:kept] == completion.tokens[:kept]
