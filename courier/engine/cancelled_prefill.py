"""What a request cancelled in the middle of its prefill leaves behind: the state it had prefilled, for the store.

An agent whose client gives up on a long prefill (its connection closed, `server/client_watch.py`, so its generation
is cancelled) resends the same request. Without this, the resend would prefill from zero again. With it, the state
at the end of the last chunk the cancelled sequence prefilled is handed to the snapshot store as a boundary snapshot
of the request's own session and tenant (the scheduler inserts it as it inserts the request's other snapshots), and
the resend's lookup starts from there. The scheduler holds back an identical request that arrives while the first
still prefills until this snapshot (or the first's end-of-prompt one) is in the store
(`actors/scheduling/promotion.py`).

Only a single sequence still prefilling its prompt, whose request takes snapshots, and that got at least
`MIN_KEPT_TOKENS` further than what it started from or already handed over. Runs on the MLX thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from courier.core.prompt_cache.entries import Origin
from courier.core.prompt_cache.quantization import KvQuantization
from courier.engine.engine_io import EngineOutput
from courier.engine.sequences import RunningSequence
from courier.engine.step_snapshots import snapshot

# Less progress than this is not worth a store entry (the store's default `--prompt-cache-min-prefix`).
MIN_KEPT_TOKENS = 16


def prefilled_so_far(
    taken: Sequence[RunningSequence], generator: Any, quantization: KvQuantization | None = None
) -> list[EngineOutput]:
    """Boundary snapshots of the `taken` sequences (cancelled, still in `generator`) that were prefilling, each the
    state after the prompt tokens it had prefilled. Call before the generator lets go of them."""
    prefilling = {
        sequence.uid: sequence
        for sequence in taken
        if sequence.request.snapshots and sequence.request.n == 1 and not sequence.prompt_done
    }
    if not prefilling:
        return []
    outputs: list[EngineOutput] = []
    for uid, (cache, tokens) in generator.extract_cache(list(prefilling)).items():
        sequence = prefilling[uid]
        kept_before = max(sequence.cached_tokens, sequence.snapshot_prompt_tokens)
        if len(tokens) - kept_before < MIN_KEPT_TOKENS:
            continue  # not yet prefilled (still waiting in the generator), or too little of it
        state = snapshot(Origin.BOUNDARY, tokens, cache, quantization=quantization)
        outputs.append(EngineOutput(sequence.request.request_id, state))
    return outputs
