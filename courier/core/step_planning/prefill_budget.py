"""How many tokens of each prompt being admitted a step prefills.

Each step of the generator decodes one token for every running sequence, then prefills one chunk of each prompt it
is admitting; the step ends when both are done, and a request that arrives meanwhile joins the batch only at the
next step. A chunk of `--prefill-step-size` (512) tokens takes seconds on a CPU (more deep into a long prompt), so
every running stream waited that long for its next token while a long prompt was admitted, and a request arriving
beside a long prompt alone waited for a whole chunk, then shared the next one's step. As vLLM's per-step token
budget does, the chunk is sized per step instead, always: a step's prefill is held to what fits in
`--prefill-stall-ms`, shared among the prompts being prefilled, and never under `MIN_CHUNK` tokens (a smaller chunk
mostly pays a pass's fixed cost, and the prompt would never finish). That budget is both the extra wait each running
stream may get for its next token and, with nothing decoding, about the longest a new request waits for the step
under way before it joins. With the budget off (0), a step takes the whole `--prefill-step-size`.

The cost of a token comes from the steps themselves: `StepCosts` fits seconds per step as a line in the positions
it processed (decode rows plus prefill tokens), so the budget follows the machine and the model: on a GPU a 512
token chunk fits the default budget and nothing changes; on a 2-core CPU the chunk comes down to tens of tokens.
"""

from __future__ import annotations

from courier.core.step_planning.verify_width import StepCosts

# The smallest chunk a prompt is prefilled in.
MIN_CHUNK = 32


class PrefillBudget:
    def __init__(
        self, *, stall_s: float, largest: int, smallest: int = MIN_CHUNK, costs: StepCosts | None = None
    ) -> None:
        """`stall_s`: what a step's prefill may take (0: no budget); `largest`: the most tokens of a prompt a step
        prefills (`--prefill-step-size`); `costs`: the steps' cost line (fitted; tests pin one)."""
        self._stall_s = stall_s
        self._largest = largest
        self._smallest = min(smallest, largest)
        self._costs = costs if costs is not None else StepCosts()

    def chunk(self, *, prefilling: int) -> int:
        """The tokens of each of `prefilling` prompts this step prefills."""
        if self._stall_s <= 0 or prefilling <= 0:
            return self._largest
        _, per_position = self._costs.line()
        if per_position <= 0:
            return self._largest
        each = int(self._stall_s / per_position) // prefilling
        return max(self._smallest, min(self._largest, each))

    def observe(self, *, positions: int, seconds: float) -> None:
        """A step that processed `positions` (decode rows and prefill tokens) in `seconds`."""
        self._costs.observe(positions, seconds)
