"""How many tokens of each prompt being admitted a step prefills while other sequences decode.

Each step of the generator decodes one token for every running sequence, then prefills one chunk of each prompt it
is admitting; the step ends when both are done. A chunk of `--prefill-step-size` (512) tokens takes seconds on a
CPU, so every running stream waited that long for its next token while a long prompt was admitted. As vLLM's token
budget does, the chunk is sized per step instead: while sequences decode, a step's prefill is held to what fits in
`--prefill-stall-ms` (the extra wait each running stream may get), shared among the prompts being prefilled, and
never under `MIN_CHUNK` tokens (a smaller chunk mostly pays a pass's fixed cost, and the prompt would never finish).
With nothing decoding, or the budget off, a step takes the whole `--prefill-step-size`.

The cost of a token comes from the steps themselves: `StepCosts` fits seconds per step as a line in the positions
it processed (decode rows plus prefill tokens), so the budget follows the machine and the model: on a GPU a 512
token chunk fits the default budget and nothing changes; on a 2-core CPU the chunk comes down to tens of tokens.
"""

from __future__ import annotations

from courier.core.step_planning.verify_width import StepCosts

# The smallest chunk a prompt is prefilled in while others decode.
MIN_CHUNK = 32


class PrefillBudget:
    def __init__(
        self, *, stall_s: float, largest: int, smallest: int = MIN_CHUNK, costs: StepCosts | None = None
    ) -> None:
        """`stall_s`: what a step's prefill may add to a decode step (0: no budget); `largest`: the most tokens of a
        prompt a step prefills (`--prefill-step-size`); `costs`: the steps' cost line (fitted; tests pin one)."""
        self._stall_s = stall_s
        self._largest = largest
        self._smallest = min(smallest, largest)
        self._costs = costs if costs is not None else StepCosts()

    def chunk(self, *, decoding: int, prefilling: int) -> int:
        """The tokens of each of `prefilling` prompts this step prefills, while `decoding` sequences decode."""
        if self._stall_s <= 0 or decoding <= 0 or prefilling <= 0:
            return self._largest
        _, per_position = self._costs.line()
        if per_position <= 0:
            return self._largest
        each = int(self._stall_s / per_position) // prefilling
        return max(self._smallest, min(self._largest, each))

    def observe(self, *, positions: int, seconds: float) -> None:
        """A step that processed `positions` (decode rows and prefill tokens) in `seconds`."""
        self._costs.observe(positions, seconds)
