"""The model states a step hands to the snapshot store: at the end of a prefill segment, and at a completion.

A boundary snapshot is the state after a conversation's history (and after the prompt but its last token), taken
where a prefill segment ends; with a dense cache the history's state is cut from the prompt's instead, which saves
a segment. A completion snapshot is the state after a reply that ended by itself, so the next turn starts past it.
With `--prompt-cache-bits` every one is quantized as it is copied (attention KV only): the store holds, charges and
writes the quantized form.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from courier.core.prompt_cache.entries import Origin
from courier.core.prompt_cache.quantization import KvQuantization
from courier.engine.engine_io import EngineOutput, SnapshotTaken
from courier.engine.model_state import compact_copy
from courier.engine.sequences import RunningSequence, Sequences


def snapshot(
    origin: Origin,
    tokens: Sequence[int],
    cache: list[Any],
    length: int | None = None,
    *,
    quantization: KvQuantization | None = None,
) -> SnapshotTaken:
    """A private, compact copy of `cache` (its first `length` positions: the state after `tokens`), its attention KV
    quantized with `quantization`."""
    state, nbytes = compact_copy(cache, length, quantization=quantization)
    return SnapshotTaken(origin=origin, tokens=tuple(tokens), state=state, nbytes=nbytes)


def boundary_snapshots(
    prompt_responses: Sequence[Any], sequences: Sequences, generator: Any, quantization: KvQuantization | None = None
) -> list[EngineOutput]:
    """The states at the end of a prefill segment: a conversation's history, and the prompt but its last token.

    With a dense cache the history's state is cut from the prompt's (its first `boundary` positions), in the
    order a two-segment prefill would give them: history first.
    """
    wanted = [
        r.uid
        for r in prompt_responses
        if r.end_of_segment and not r.end_of_prompt and (s := sequences.get(r.uid)) and s.request.snapshots
    ]
    if not wanted:
        return []
    outputs: list[EngineOutput] = []
    for uid, (cache, tokens) in generator.extract_cache(wanted).items():
        sequence = sequences.get(uid)
        assert sequence is not None
        request_id = sequence.request.request_id
        cut = sequence.cut_boundary
        if 0 < cut < len(tokens):
            history = snapshot(Origin.BOUNDARY, tokens[:cut], cache, length=cut, quantization=quantization)
            outputs.append(EngineOutput(request_id, history))
        outputs.append(EngineOutput(request_id, snapshot(Origin.BOUNDARY, tokens, cache, quantization=quantization)))
        sequence.took_snapshot(len(tokens))
    return outputs


def completion_snapshot(
    sequence: RunningSequence, response: Any, quantization: KvQuantization | None = None
) -> SnapshotTaken | None:
    """The state after a reply that the generator ended (None: the response carries none)."""
    if not (response.prompt_cache and response.all_tokens):
        return None
    prefix = sequence.request.prefix
    prompt_length = len(sequence.request.prompt_tokens)
    taken = snapshot(Origin.COMPLETION, response.all_tokens, response.prompt_cache, quantization=quantization)
    sequence.took_snapshot(prompt_length)
    return replace(taken, continues=prefix.continues if prefix is not None else None, prompt_length=prompt_length)
