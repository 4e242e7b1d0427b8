"""Where a prompt left the prompt cache: the store's lookups say it for a miss and for a conversation whose cached
history the prompt no longer starts with; a table of stored entries, prompts and what the lookup reports."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from courier.core.prompt_cache.divergence import CONTEXT_TOKENS, Divergence, report, token_ids
from courier.core.prompt_cache.entries import ANONYMOUS_SESSION, Bucket, Origin
from courier.core.prompt_cache.stats import StoreLimits
from courier.core.prompt_cache.store import SnapshotStore

BUCKET = Bucket(model_id="m", tenant="key-a")
SYSTEM = tuple(range(100, 140))  # a 40-token system prompt
HISTORY = (*SYSTEM, *range(200, 230))  # and a first turn: 70 tokens
REPLY = tuple(range(300, 310))
NEXT = (*HISTORY, *REPLY, *range(400, 420))  # the next turn's prompt: history, the reply re-rendered, a question


@dataclass(frozen=True, slots=True)
class Stored:
    tokens: tuple[int, ...]
    session: str = "a"
    origin: Origin = Origin.BOUNDARY


def lookup(
    stored: list[Stored], prompt: tuple[int, ...], *, session: str = "a", trimmable: bool = True
) -> Divergence | None:
    limits = StoreLimits(capacity_bytes=10_000, max_entries=100, ttl_s=60.0, min_prefix=8)
    store = SnapshotStore(limits, trimmable=trimmable, clock=lambda: 1000.0)
    for entry in stored:
        store.insert(
            bucket=BUCKET, session=entry.session, origin=entry.origin, tokens=entry.tokens, state=None, nbytes=1
        )
    found = store.lookup(BUCKET, session, prompt).divergence
    assert store.counters.divergences == (found is not None)
    return found


def changed_at(tokens: tuple[int, ...], index: int) -> tuple[int, ...]:
    """`tokens` with the one at `index` replaced (a volatile value in an otherwise stable prompt)."""
    return (*tokens[:index], 9999, *tokens[index + 1 :])


@pytest.mark.parametrize("trimmable", [True, False], ids=["dense", "hybrid"])
def test_a_volatile_token_near_the_top_is_where_a_miss_diverged(trimmable: bool) -> None:
    """The billing-header case: the whole conversation is cached, but the prompt differs at its sixth token."""
    found = lookup([Stored(HISTORY)], changed_at(NEXT, 5), trimmable=trimmable)
    assert found is not None
    assert (found.index, found.matched, found.prompt_tokens, found.closest_tokens) == (5, 0, len(NEXT), len(HISTORY))
    assert (found.session, found.tenant, found.same_session) == ("a", "key-a", True)
    assert found.before == NEXT[:5]
    assert found.prompt == (9999, *NEXT[6 : 5 + CONTEXT_TOKENS])
    assert found.cached == HISTORY[5 : 5 + CONTEXT_TOKENS]


def test_a_history_edited_deep_inside_is_reported_where_it_changed_though_a_prefix_was_reused() -> None:
    """Dense: the cache reuses the 50 tokens before the edit (trimmed); the conversation's history went further."""
    found = lookup([Stored(HISTORY)], changed_at(NEXT, 50))
    assert found is not None
    assert (found.index, found.matched, found.same_session) == (50, 50, True)
    assert found.before == NEXT[50 - CONTEXT_TOKENS : 50]


def test_on_a_hybrid_model_a_completion_left_in_its_reply_falls_back_to_the_boundary_and_says_where() -> None:
    """The turn's reply re-rendered differently from how it was generated: the boundary before it is reused."""
    completion = Stored((*HISTORY, *REPLY[:4], 777, 778), origin=Origin.COMPLETION)
    found = lookup([Stored(HISTORY), completion], NEXT, trimmable=False)
    assert found is not None
    assert (found.index, found.matched, found.closest_tokens) == (len(HISTORY) + 4, len(HISTORY), len(HISTORY) + 6)
    assert (found.prompt[:1], found.cached) == ((REPLY[4],), (777, 778))


@pytest.mark.parametrize(
    ("stored", "prompt", "session"),
    [
        ([Stored(HISTORY)], NEXT, "a"),  # the conversation's history prefixes the prompt: a plain hit
        ([Stored(HISTORY)], (1, 2, 3, *NEXT), "a"),  # nothing shared at all: no point to show
        ([Stored((*SYSTEM, 500, 501), session="b")], NEXT, "a"),  # another conversation on the same system prompt
        ([Stored(NEXT)], NEXT[:60], "a"),  # the prompt ends inside a cached entry (a regenerated turn)
        ([], NEXT, "a"),  # nothing cached
    ],
    ids=["hit", "unrelated", "shared-system-prompt", "inside-an-entry", "empty"],
)
def test_no_divergence_is_reported_when_nothing_was_lost(
    stored: list[Stored], prompt: tuple[int, ...], session: str
) -> None:
    assert lookup(stored, prompt, session=session) is None


def test_a_miss_reports_the_closest_entry_of_another_conversation() -> None:
    """A new conversation's first turn that missed: the tenant's closest entry says how far it came."""
    found = lookup([Stored(HISTORY, session="b")], changed_at(NEXT, 6), session="c")
    assert found is not None
    assert (found.index, found.matched, found.same_session) == (6, 0, False)


def test_the_anonymous_session_is_no_conversation_of_its_own() -> None:
    """Callers naming no session share it: another anonymous prompt diverging is no lost history (it reused the
    system prompt); only a miss is reported."""
    anonymous = [Stored((*SYSTEM, 500, 501), session=ANONYMOUS_SESSION)]
    assert lookup(anonymous, NEXT, session=ANONYMOUS_SESSION) is None
    missed = lookup(anonymous, changed_at(NEXT, 3), session=ANONYMOUS_SESSION)
    assert missed is not None and (missed.index, missed.same_session) == (3, False)


def test_a_report_decodes_each_side() -> None:
    found = lookup([Stored(HISTORY)], changed_at(NEXT, 5))
    assert found is not None
    shown = report(found, token_ids, at=1234.5).view()
    assert shown == {
        "at": 1234.5,
        "session": "a",
        "prompt_tokens": len(NEXT),
        "matched_tokens": 0,
        "diverged_at": 5,
        "closest_tokens": len(HISTORY),
        "closest_same_session": True,
        "before": "100 101 102 103 104",
        "prompt": token_ids(found.prompt),
        "cached": token_ids(HISTORY[5 : 5 + CONTEXT_TOKENS]),
    }
