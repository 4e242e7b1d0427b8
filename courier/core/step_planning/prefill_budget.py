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

What a chunk costs comes from the steps themselves, at the depth it is prefilled at: `DepthCosts`
(`depth_costs.py`) fits seconds per step to the positions it processed and the pairs of positions they attended,
so a chunk deep into a long prompt, where each token attends to thousands before it, is smaller than one at the
start (on a 2-core CPU with SmolLM2, 55-75 tokens near the start and the `MIN_CHUNK` floor from about 2,000 deep,
where a positions-only line gave 50 tokens 6K deep that took 1.3-1.8 s; the floor binds there, 32 tokens 4-6K deep
still take about 1.2 s). The chunk is the largest whose added seconds fit the
budget: `k` tokens of each of `n` prompts add `n * k * per_position + n * k * (d + k / 2) * per_attended` (`d` the
deepest of them), solved for `k`. On a GPU a 512-token chunk fits the default budget and nothing changes.
"""

from __future__ import annotations

import math

from courier.core.step_planning.depth_costs import CostModel, DepthCosts, StepWork

# The smallest chunk a prompt is prefilled in.
MIN_CHUNK = 32


class PrefillBudget:
    def __init__(
        self, *, stall_s: float, largest: int, smallest: int = MIN_CHUNK, costs: DepthCosts | None = None
    ) -> None:
        """`stall_s`: what a step's prefill may take (0: no budget); `largest`: the most tokens of a prompt a step
        prefills (`--prefill-step-size`); `costs`: the steps' cost model (fitted; tests pin one)."""
        self._stall_s = stall_s
        self._largest = largest
        self._smallest = min(smallest, largest)
        self._costs = costs if costs is not None else DepthCosts()

    @property
    def costs(self) -> CostModel:
        """The cost model the chunks are sized by now."""
        return self._costs.model()

    @property
    def latest_costs(self) -> CostModel:
        """The cost model fitted last, read without fitting (safe off the MLX thread; see `DepthCosts.latest`)."""
        return self._costs.latest()

    def chunk(self, work: StepWork, model: CostModel | None = None) -> int:
        """The tokens of each prompt of `work.prefill_depths` this step prefills (sized with `model`, by default
        the costs as fitted now)."""
        prompts = len(work.prefill_depths)
        if self._stall_s <= 0 or prompts <= 0:
            return self._largest
        model = model if model is not None else self._costs.model()
        # n * k * (per_position + per_attended * d) + n * per_attended * k^2 / 2 <= stall
        linear = prompts * (model.per_position + model.per_attended * max(work.prefill_depths))
        quadratic = prompts * model.per_attended / 2
        if quadratic > 0:
            each = (math.sqrt(linear**2 + 4 * quadratic * self._stall_s) - linear) / (2 * quadratic)
        elif linear > 0:
            each = self._stall_s / linear
        else:
            return self._largest
        return max(self._smallest, min(self._largest, int(each + 1e-9)))

    def observe(self, work: StepWork, *, chunk: int, prompt_tokens: int, seconds: float) -> None:
        """A step that did `work` with prefill chunks of at most `chunk` tokens, `prompt_tokens` of them in all, in
        `seconds`."""
        prefill_depths = work.prefill_depths if prompt_tokens > 0 else ()
        if prefill_depths:
            chunk = min(chunk, math.ceil(prompt_tokens / len(prefill_depths)))
        done = StepWork(decode_depths=work.decode_depths, prefill_depths=prefill_depths)
        positions = len(work.decode_depths) + prompt_tokens
        self._costs.observe(positions, done.attended(chunk), seconds)
        if prompt_tokens > 0:  # fitted now, so `latest_costs` (read off this thread) has the prefill just timed
            self._costs.model()
