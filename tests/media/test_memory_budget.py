"""The image memory budget: the pure ledger by tables, then the anyio shell's waiting, cancelling and threads."""

from __future__ import annotations

import anyio
import anyio.to_thread
import pytest

from courier.media.memory_budget import ByteLedger, ImageMemoryBudget, first_over


@pytest.mark.parametrize(
    ("needs", "capacity", "crossing"),
    [
        ([], 10, None),
        ([10], 10, None),
        ([11], 10, 0),
        ([4, 4, 2], 10, None),
        ([4, 4, 3], 10, 2),
        ([4, 7, 0], 10, 1),
        ([0, 0, 0], 0, None),
        ([196_000_000] * 6, 1024**3, 5),  # six 7000x7000 images: the sixth crosses 1 GiB
    ],
)
def test_first_over_names_the_need_that_crosses(needs: list[int], capacity: int, crossing: int | None) -> None:
    assert first_over(needs, capacity) == crossing


# Each step: (operation, waiter, bytes) -> (granted waiters, held after, waiting after).
Step = tuple[str, str, int, list[str], int, int]


@pytest.mark.parametrize(
    "steps",
    [
        pytest.param(
            [
                ("request", "a", 6, ["a"], 6, 0),
                ("request", "b", 4, ["b"], 10, 0),
                ("release", "a", 6, [], 4, 0),
            ],
            id="fits-at-once",
        ),
        pytest.param(
            [
                ("request", "a", 8, ["a"], 8, 0),
                ("request", "big", 6, [], 8, 1),
                ("request", "small", 1, [], 8, 2),  # it would fit, but must not overtake the big one
                ("release", "a", 8, ["big", "small"], 7, 0),
            ],
            id="first-come-first-served",
        ),
        pytest.param(
            [
                ("request", "a", 8, ["a"], 8, 0),
                ("request", "big", 6, [], 8, 1),
                ("request", "small", 1, [], 8, 2),
                ("withdraw", "big", 0, [], 8, 1),
                ("release", "a", 2, ["small"], 7, 0),
            ],
            id="a-waiter-that-gives-up-lets-the-next-through",
        ),
        pytest.param(
            [
                ("request", "a", 10, ["a"], 10, 0),
                ("request", "b", 6, [], 10, 1),
                ("release", "a", 3, [], 7, 1),
                ("release", "a", 7, ["b"], 6, 0),
            ],
            id="granted-only-once-it-fits",
        ),
        pytest.param(
            [
                ("request", "a", 10, ["a"], 10, 0),
                ("request", "nothing", 0, ["nothing"], 10, 0),
            ],
            id="zero-bytes-never-wait",
        ),
    ],
)
def test_the_ledger_grants_in_order(steps: list[Step]) -> None:
    ledger: ByteLedger[str] = ByteLedger(10)
    for operation, waiter, nbytes, granted, held, waiting in steps:
        if operation == "request":
            assert ledger.request(waiter, nbytes) == (waiter in granted)
        elif operation == "withdraw":
            assert ledger.withdraw(waiter)
        else:
            assert ledger.release(nbytes) == granted
        assert (ledger.held, ledger.waiting) == (held, waiting)


def test_the_ledger_refuses_what_can_never_fit_and_overdrawn_releases() -> None:
    ledger: ByteLedger[str] = ByteLedger(10)
    with pytest.raises(ValueError, match="never fit"):
        ledger.request("huge", 11)
    assert not ledger.withdraw("unknown")
    with pytest.raises(ValueError, match="only 0 are held"):
        ledger.release(1)


@pytest.mark.anyio
async def test_a_request_that_would_overrun_waits_for_the_others() -> None:
    budget = ImageMemoryBudget(100)
    await budget.acquire(80)
    order: list[str] = []

    async def claim(name: str, nbytes: int) -> None:
        async with budget.reserved(nbytes, wait_s=30):
            order.append(name)

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(claim, "big", 50)
        await anyio.wait_all_tasks_blocked()
        tasks.start_soon(claim, "small", 10)
        await anyio.wait_all_tasks_blocked()
        assert (order, budget.waiting) == ([], 2)  # the small one fits, but waits its turn
        budget.release(80)
    assert order == ["big", "small"]
    assert (budget.held, budget.waiting) == (0, 0)


@pytest.mark.anyio
async def test_a_wait_past_its_deadline_takes_nothing() -> None:
    budget = ImageMemoryBudget(100)
    await budget.acquire(100)
    with pytest.raises(TimeoutError):
        async with budget.reserved(1, wait_s=0.01):
            pytest.fail("granted while everything was held")
    assert (budget.held, budget.waiting) == (100, 0)
    budget.release(100)
    async with budget.reserved(100, wait_s=0):
        assert budget.held == 100
    assert budget.held == 0


@pytest.mark.anyio
async def test_a_worker_thread_waits_for_its_share_and_gives_it_back() -> None:
    budget = ImageMemoryBudget(100)
    await budget.acquire(60)
    seen: list[int] = []

    def render() -> None:
        with budget.held_in_worker_thread(50):
            seen.append(budget.held)
        with budget.held_in_worker_thread(1000):  # more than the whole budget: takes it all, never waits forever
            seen.append(budget.held)

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(anyio.to_thread.run_sync, render)
        while budget.waiting == 0:
            await anyio.sleep(0.001)
        assert seen == []
        budget.release(60)
    assert seen == [50, 100]
    assert budget.held == 0
