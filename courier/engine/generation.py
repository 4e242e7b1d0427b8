"""The engine's vocabulary: what a generation is asked for, and the events it streams back.

The engine owns these types (as vLLM's engine owns its request type); the actors'
messages carry them. Events flow on a per-request stream the ingress creates: zero
or more `TokensGenerated`, then exactly one of `GenerationFinished` or
`GenerationFailed`, then the stream closes. A consumer that closes its end cancels
the generation.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any, NewType, TypeAlias

from courier.core.failure_codes import FailureCode
from courier.grammar.constraint import Constraint

RequestId = NewType("RequestId", str)


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0
    constraint: Constraint | None = None  # a grammar the output follows (JSON schema, tool call)
    top_k: int = 0  # 0: off
    min_p: float = 0.0  # 0: off
    presence_penalty: float = 0.0  # OpenAI's: over the generated tokens
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # vLLM's and HF's: over the prompt and the generated tokens; 1: off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)

    @property
    def penalised(self) -> bool:
        """Whether the logits are changed before sampling (penalties, bias): a logits processor per sequence."""
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0 or self.logit_bias
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class TokenLogprob:
    token_id: int
    token: str
    logprob: float
    top: tuple[tuple[int, str, float], ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class TokensGenerated:
    """New text (stop strings and end-of-sequence tokens removed) and the tokens behind it."""

    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] = ()
    choice: int = 0  # which of a request's `n` samples (0 for a request of one)


class FinishReason(Enum):
    STOP = "stop"
    LENGTH = "length"


@dataclass(frozen=True, slots=True, kw_only=True)
class GenerationFinished:
    reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    choice: int = 0  # a request of `n` samples finishes once per sample
    # Prompt tokens beyond `cached_tokens` whose state this request handed to the snapshot store (0 without caching).
    cache_write_tokens: int = 0
    # Multi-token decode steps: draft tokens verified, how many of them were kept, tokens a grammar forced.
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    forced_tokens: int = 0
    # Cut by the request's deadline (`--request-timeout`) rather than its token limit: a LENGTH cut all the same.
    deadline: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class GenerationFailed:
    """The generation failed inside the engine (the server keeps serving), or was cut by a shutdown."""

    message: str
    # SHUTTING_DOWN when the server stopped it (retry elsewhere); DEADLINE_EXCEEDED when its deadline came before
    # its first token (a 504).
    code: FailureCode = FailureCode.GENERATION_FAILED
    choice: int = 0  # the sample that failed; the request fails as one


@dataclass(frozen=True, slots=True, kw_only=True)
class VisionInputs:
    """A prompt's images as the model's processor prepared them, for the engine's prefill.

    `arrays` are the keyword arguments of the vision model's `get_input_embeddings` (pixel values, masks),
    as MLX arrays; `digest` joins the prompt cache's bucket, so state is never reused across images.
    """

    arrays: Mapping[str, Any]
    digest: str


GenerationEvent: TypeAlias = TokensGenerated | GenerationFinished | GenerationFailed
