"""The prompt cache's default budgets: sized from the state as the model computes it, so quantized snapshots fill the
same bytes with proportionally more conversations."""

from __future__ import annotations

import pytest

from courier.engine.prompt_cache.budget import StateFootprint, conversations_held, default_budget, default_disk_budget

# SmolLM2 on the CPU: 46,080 B/token as computed (float32); stored at 8-bit/64, 72/256 of it.
COMPUTED = StateFootprint(per_token_bytes=46_080, fixed_bytes=0)
STORED_8 = StateFootprint(per_token_bytes=46_080 * 72 // 256, fixed_bytes=0)
STORED_4 = StateFootprint(per_token_bytes=46_080 * 40 // 256, fixed_bytes=0)


@pytest.mark.parametrize(("stored", "held", "disk_held"), [(None, 8, 32), (STORED_8, 28, 113), (STORED_4, 51, 204)])
def test_the_default_budget_is_sized_as_computed_and_holds_more_stored_quantized(
    stored: StateFootprint | None, held: int, disk_held: int
) -> None:
    plenty = 1 << 40
    budget = default_budget(COMPUTED, plenty, stored)
    assert budget.capacity_bytes == 8 * 46_080 * 4096  # the same bytes, quantized or not
    assert conversations_held(budget.capacity_bytes, stored or COMPUTED) == held
    assert ("holds" in budget.explanation) == (stored is not None)
    disk = default_disk_budget(COMPUTED, budget.capacity_bytes, plenty, stored)
    assert disk.capacity_bytes == 32 * 46_080 * 4096
    assert conversations_held(disk.capacity_bytes, stored or COMPUTED) == disk_held


def test_a_hybrid_models_fixed_state_counts_once_per_conversation() -> None:
    footprint = StateFootprint(per_token_bytes=100, fixed_bytes=10_000)
    assert conversations_held(100 * 4096 * 3 + 30_000, footprint) == 3
    assert conversations_held(1 << 20, StateFootprint(per_token_bytes=0, fixed_bytes=0)) == 0
