"""Recovery from a fault in the batched forward pass: the culprit fails alone, the others carry on.

When a step raises, the engine starts a fresh generator and each sequence of the failed batch is replayed into it
alone: its prompt and the tokens it generated prefilled at batch size one (from its stored snapshot, if it had
one), then its next input probed, and its sampler drawn from once. One that fails again is the culprit and fails;
the others rejoin the batch from their replayed state and carry on where they were. A second failure right after
a recovery fails the whole batch, so a fault no single sequence explains cannot loop. Either way MLX's global
random state is seeded afresh: a function compiled with that state that raised mid-trace leaves a traced array in
it, and every later unseeded draw would fail.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import mlx.core as mx

from courier.engine.admission import Admission
from courier.engine.engine_io import EngineOutput
from courier.engine.generation import GenerationFailed
from courier.engine.model_state import compact_copy, prefill, resume
from courier.engine.sampling import SeededSampler
from courier.engine.sampling import probe as sampling_probe
from courier.engine.sequences import RunningSequence, Sequences

logger = logging.getLogger(__name__)


class Recovery:
    def __init__(self, model: Any, sequences: Sequences, admission: Admission, *, stream: Any) -> None:
        self._model = model
        self._sequences = sequences
        self._admission = admission  # its image prefill, for a vision request's replay
        self._stream = stream
        self._just_recovered = False  # the last step failed and its sequences were replayed

    def step_succeeded(self) -> None:
        self._just_recovered = False

    def recover(self, error: Exception, generator: Any) -> list[EngineOutput]:
        """The failed step's sequences into `generator` (a fresh one), each replayed alone; those that fail again
        fail. All of them fail when the last step was a recovery too, or there is only one."""
        reason = f"generation failed: {type(error).__name__}: {error}"
        renew_random_state()
        sequences = self._sequences.take_all()
        if self._just_recovered or len(sequences) <= 1:
            logger.exception("generation step failed; failing %d requests", len(sequences))
            for sequence in sequences:
                sequence.release()
            return [EngineOutput(s.request.request_id, GenerationFailed(message=reason)) for s in sequences]
        logger.exception("generation step failed; replaying its %d requests one by one", len(sequences))
        outputs: list[EngineOutput] = []
        for sequence in sequences:
            sequence.shared = None
            try:
                self._replay(sequence, generator)
            except Exception as replay_error:  # this one faults on its own: the culprit
                renew_random_state()  # whatever its fault left there, the next replay starts clean
                logger.warning("request %s fails on its own: %s", sequence.request.request_id, replay_error)
                message = f"generation failed: {type(replay_error).__name__}: {replay_error}"
                sequence.release()
                failed = GenerationFailed(message=message, choice=sequence.request.choice)
                outputs.append(EngineOutput(sequence.request.request_id, failed))
        self._just_recovered = bool(len(self._sequences))  # nothing replayed: the next batch starts afresh
        return outputs

    def _replay(self, sequence: RunningSequence, generator: Any) -> None:
        """Rebuild `sequence`'s state at batch size one, probe its next input, and put it back in the batch."""
        request = sequence.request
        tokens = [*request.prompt_tokens, *sequence.token_ids]
        with mx.stream(self._stream):
            start, cache = resume(request.prefix, len(request.prompt_tokens))  # from its stored snapshot, if any
            if request.vision is not None:
                start, cache = self._admission.prefill_images(request, start, cache)
            cache = prefill(self._model, tokens[start:-1], cache) if start < len(tokens) - 1 else cache
            probe, _ = compact_copy(cache) if cache is not None else (None, 0)
            logits = self._model(mx.array([tokens[-1:]]), cache=probe)[:, -1, :]
            # Its sampler too: a fault in one sequence's sampling fails that sequence here, alone.
            sampling_probe(sequence.sampler, logits - mx.logsumexp(logits, axis=-1, keepdims=True))
        remaining = max(1, (request.sampling.max_tokens or 1) - sequence.generated)
        if isinstance(sequence.sampler, SeededSampler):  # its next draw is for the token after those it has sent
            sequence.sampler.position = len(sequence.token_ids)
        (uid,) = generator.insert_segments(
            [[tokens[-1:]]],
            max_tokens=[remaining],
            caches=[cache] if cache is not None else None,
            all_tokens=[tokens[:-1]] if cache is not None else None,
            samplers=[sequence.batch_sampler],
            logits_processors=[sequence.processors] if sequence.processors else None,
        )
        sequence.uid = uid
        sequence.cut_boundary = 0
        sequence.prompt_depth = len(tokens) - 1
        self._sequences.add(sequence)


def renew_random_state() -> None:
    """MLX's global random state, seeded afresh (Courier's samplers compile nothing with it; this keeps any other
    such fault to one step)."""
    mx.random.seed(int.from_bytes(os.urandom(8), "little"))
