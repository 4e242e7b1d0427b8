"""The token counter's figures: chat renders tokenized, and how much of them came from renders kept for reuse.

One writer (the token counter, on the event loop); read by `/metrics` at scrape time.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class TokenizerStats:
    renders: int = 0  # chat renders tokenized (prompts, warm-ups, counts)
    tokens: int = 0  # their tokens
    reused_tokens: int = 0  # of those, taken from a render kept before (core/token_reuse.py)
    kept_renders: int = 0  # renders kept for reuse now
    kept_bytes: int = 0  # what they hold

    def rendered(self, tokens: int, reused: int, kept_renders: int, kept_bytes: int) -> None:
        self.renders += 1
        self.tokens += tokens
        self.reused_tokens += reused
        self.kept(kept_renders, kept_bytes)

    def kept(self, renders: int, kept_bytes: int) -> None:
        self.kept_renders, self.kept_bytes = renders, kept_bytes
