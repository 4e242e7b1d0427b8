"""The idle warm-up queue: one warm-up waits per conversation, a conversation being a tenant's session."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anyio
import pytest

from courier.actors.prompt_cache.store_link import PromptCaching, StoreLink
from courier.actors.scheduling.warm_ups import WarmUps
from courier.core.prompt_cache.entries import Bucket
from courier.messages.scheduler import QueueWarmUp
from courier.messages.snapshot_store import SnapshotStoreMessage
from courier.status.scheduler_stats import SchedulerStats


@pytest.fixture
def queue() -> Iterator[tuple[WarmUps, SchedulerStats]]:
    """A queue whose store link is enabled; nothing runs (the MLX thread is never asked)."""
    send, receive = anyio.create_memory_object_stream[SnapshotStoreMessage](1)
    stats = SchedulerStats(max_batch=1, max_queue=1)
    link = StoreLink(PromptCaching(store=send, bucket=Bucket(model_id="m")), stats, lookup_timeout_s=1.0)
    mlx: Any = None
    with send, receive:
        yield WarmUps(link, stats, mlx), stats


def test_a_newer_warm_up_replaces_its_conversations_own_and_no_other_keys(
    queue: tuple[WarmUps, SchedulerStats],
) -> None:
    """Another key's caller naming the same session neither replaces the first key's warm-up (its next turn would
    prefill its reply) nor learns from `warmups_skipped` (in /v1/cache/stats) that such a session just had a turn."""
    warm_ups, stats = queue
    assert warm_ups.queue(QueueWarmUp(session="alice@corp", tokens=(1, 2, 3), tenant="a"))
    warm_ups.queue(QueueWarmUp(session="alice@corp", tokens=(4, 5), tenant="b"))
    assert (stats.warmups_skipped, stats.warmups_pending) == (0, 2)
    warm_ups.queue(QueueWarmUp(session="alice@corp", tokens=(1, 2, 3, 4), tenant="a"))
    assert (stats.warmups_skipped, stats.warmups_pending) == (1, 2)  # its own conversation's older one
