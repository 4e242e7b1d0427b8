"""Where a prompt left the prompt cache: the first token at which it differs from the closest cached entry.

A lookup that misses, or whose conversation's own cached history the prompt no longer starts with, says where the
prompt first differs from the cached entry sharing the longest prefix with it (its own session's first, else
another of its tenant's), with a few tokens of each side around that point. An operator can then see why a turn
prefilled more than its new message: a volatile line in a system prompt, a reply the template re-rendered, an
edited history. Pure: the store finds the point while it walks its index (`Divergence`, token ids); its owner turns
the tokens into text (`DivergenceReport`) and keeps the last few.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

# Tokens shown on each side of the point where the prompt left the cached entry.
CONTEXT_TOKENS = 16


@dataclass(frozen=True, slots=True, kw_only=True)
class Divergence:
    """The prompt's token `index` is the first that differs from the closest cached entry's."""

    session: str
    tenant: str
    prompt_tokens: int
    matched: int  # what the lookup could reuse (0: a miss)
    index: int
    closest_tokens: int  # the closest entry's length
    same_session: bool  # the closest entry is the request's own conversation's
    before: tuple[int, ...]  # the shared tokens just before `index`
    prompt: tuple[int, ...]  # the prompt's tokens from `index`
    cached: tuple[int, ...]  # the closest entry's tokens from `index`


def divergence(
    *,
    prompt: Sequence[int],
    closest: Sequence[int],
    index: int,
    matched: int,
    session: str,
    tenant: str,
    same_session: bool,
) -> Divergence:
    """The divergence at `index` (the length of the longest prefix `prompt` and `closest` share)."""
    return Divergence(
        session=session,
        tenant=tenant,
        prompt_tokens=len(prompt),
        matched=matched,
        index=index,
        closest_tokens=len(closest),
        same_session=same_session,
        before=tuple(prompt[max(0, index - CONTEXT_TOKENS) : index]),
        prompt=tuple(prompt[index : index + CONTEXT_TOKENS]),
        cached=tuple(closest[index : index + CONTEXT_TOKENS]),
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class DivergenceReport:
    """A divergence with its tokens as text, as `/v1/cache/stats` and the lookup's span show it."""

    at: float  # seconds since the epoch
    session: str
    tenant: str
    prompt_tokens: int
    matched_tokens: int
    diverged_at: int
    closest_tokens: int
    same_session: bool
    before: str
    prompt: str
    cached: str

    def view(self) -> dict[str, object]:
        """What `/v1/cache/stats` shows (the tenant is the caller's own: not repeated)."""
        return {
            "at": round(self.at, 3),
            "session": self.session,
            "prompt_tokens": self.prompt_tokens,
            "matched_tokens": self.matched_tokens,
            "diverged_at": self.diverged_at,
            "closest_tokens": self.closest_tokens,
            "closest_same_session": self.same_session,
            "before": self.before,
            "prompt": self.prompt,
            "cached": self.cached,
        }


def report(found: Divergence, decode: Callable[[Sequence[int]], str], at: float) -> DivergenceReport:
    return DivergenceReport(
        at=at,
        session=found.session,
        tenant=found.tenant,
        prompt_tokens=found.prompt_tokens,
        matched_tokens=found.matched,
        diverged_at=found.index,
        closest_tokens=found.closest_tokens,
        same_session=found.same_session,
        before=decode(found.before),
        prompt=decode(found.prompt),
        cached=decode(found.cached),
    )


def token_ids(tokens: Sequence[int]) -> str:
    """The tokens as text where no tokenizer is at hand (a store tested on its own)."""
    return " ".join(str(token) for token in tokens)
