"""Setting up the prompt cache: both tiers' budgets, the disk tier's directory, and what an earlier run left there.

The memory budget is configured or sized from the model's state and the device's
memory; the disk budget is configured (0: no disk tier) or sized from the model's
state and the free disk space. The disk tier lives in a private subdirectory named
by the model's identity (`model/identity.py`), so another model, or the same name
with other weights, never even opens these files. A directory another server holds,
or one that cannot be created, leaves the cache memory-only, with a warning: a cache
never stops a server from starting, but for one setting: quantized snapshots
(`--prompt-cache-bits`) with a group size that does not divide the model's attention
head dimension, which the operator asked for and cannot have.
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import anyio.to_thread

from courier.actors.prompt_cache.snapshot_disk import DiskTierConfig, SnapshotDisk
from courier.core.prompt_cache.entries import Bucket
from courier.core.prompt_cache.quantization import (
    KvQuantization,
    QuantizationRefused,
    check_head_dims,
    quantization_from_settings,
)
from courier.core.prompt_cache.rejections import FileRejection
from courier.core.prompt_cache.stats import StoreLimits
from courier.core.prompt_cache.store import SnapshotStore
from courier.engine.model_state import attention_head_dims
from courier.engine.prompt_cache.budget import available_memory, default_budget, default_disk_budget, measure_footprint
from courier.engine.prompt_cache.directory import SnapshotDirectory, free_bytes, open_directory
from courier.engine.prompt_cache.layout import measure_layout
from courier.model.identity import model_identity
from courier.model.loader import LoadedModel, ModelLoadError
from courier.runtime.mlx_thread import MlxThread
from courier.settings import Settings

logger = logging.getLogger(__name__)

PROMPT_CACHE_SUBDIRECTORY = "prompt-cache"
# The disk writer may hold state for unfinished writes up to this share of the memory budget (most of it is
# state memory holds anyway: only entries evicted from memory before their write is done cost more).
PENDING_WRITE_SHARE = 1


@dataclass(frozen=True, slots=True, kw_only=True)
class PromptCache:
    store: SnapshotStore
    disk: SnapshotDisk | None
    bucket: Bucket


async def snapshot_quantization(settings: Settings, loaded: LoadedModel, mlx: MlxThread) -> KvQuantization | None:
    """How the prompt cache stores attention KV (None: as computed). Raises `ModelLoadError` when the group size
    does not divide the model's attention head dimension: the operator asked for what this model cannot do (the one
    model served does not start; one of several fails its load, saying why)."""
    quantization = quantization_from_settings(settings.prompt_cache_bits, settings.prompt_cache_group_size)
    if quantization is None or not settings.prompt_cache:
        return None
    if loaded.vision is not None:
        logger.info("prompt cache: snapshots stored as computed: a vision model's cache layers are mlx-vlm's")
        return None
    head_dims = await mlx.call(partial(attention_head_dims, loaded.model))
    try:
        check_head_dims(head_dims, quantization)
    except QuantizationRefused as refused:
        raise ModelLoadError(str(refused)) from refused
    if not head_dims:
        logger.info("prompt cache: the model has no attention KV to quantize; snapshots stored as computed")
        return None
    dims = ", ".join(map(str, head_dims))
    logger.info("prompt cache: attention KV stored %s (attention head dimension %s)", quantization.label, dims)
    return quantization


async def open_prompt_cache(
    settings: Settings, loaded: LoadedModel, mlx: MlxThread, quantization: KvQuantization | None = None
) -> PromptCache:
    """Both tiers, their budgets sized from the state as computed (`quantization`: how snapshots are stored, which
    then hold more conversations)."""
    footprint = await mlx.call(partial(measure_footprint, loaded.model))
    stored = await mlx.call(partial(measure_footprint, loaded.model, quantization)) if quantization else None
    capacity = settings.prompt_cache_snapshot_capacity_bytes
    if capacity is None:
        budget = default_budget(footprint, available_memory(), stored)
        capacity = budget.capacity_bytes
        logger.info("prompt cache budget %d bytes: %s", capacity, budget.explanation)
    else:
        logger.info("prompt cache budget %d bytes (configured)", capacity)
    template = str(getattr(loaded.tokenizer, "chat_template", None) or "")
    signature = hashlib.sha256(template.encode()).hexdigest()[:16]
    bucket = Bucket(model_id=loaded.info.model_id, template_signature=signature)
    directory = await _open_disk_directory(settings, loaded, mlx, signature, quantization)
    disk_capacity = 0
    if directory is not None:
        disk_capacity = settings.prompt_cache_disk_bytes or 0
        if settings.prompt_cache_disk_bytes is None:
            held = sum(found.size for found in directory.found)
            disk_budget = default_disk_budget(footprint, capacity, free_bytes(directory.path) + held, stored)
            disk_capacity = disk_budget.capacity_bytes
            logger.info("prompt cache disk budget %d bytes: %s", disk_capacity, disk_budget.explanation)
        else:
            logger.info("prompt cache disk budget %d bytes (configured)", disk_capacity)
        if disk_capacity <= 0:
            logger.warning("prompt cache: no disk tier: no free space under %s", directory.path)
            directory.release()
            directory = None
    limits = StoreLimits(
        capacity_bytes=capacity,
        max_entries=settings.prompt_cache_snapshot_max_entries,
        ttl_s=settings.prompt_cache_snapshot_ttl,
        min_prefix=settings.prompt_cache_min_prefix,
        disk_capacity_bytes=disk_capacity,
        quantization=quantization,
    )
    store = SnapshotStore(limits, trimmable=loaded.info.prompt_cache_trimmable, clock=time.monotonic)
    if directory is None:
        return PromptCache(store=store, disk=None, bucket=bucket)
    config = DiskTierConfig(max_pending_write_bytes=capacity // PENDING_WRITE_SHARE)
    disk = SnapshotDisk(directory, config, mlx)
    found, unreadable = len(directory.found), directory.unreadable
    skipped = directory.rejected[FileRejection.NOT_A_FILE]
    adopted = disk.adopt(store, bucket)
    disk.dispatch(store)  # files of turns that adopted ones supersede: deleted once the writer runs
    logger.info(
        "prompt cache disk tier %s: %d snapshots kept from earlier runs (%d bytes); %d no longer fit or were served "
        "under another name or template, %d unreadable files deleted, %d entries that are not regular files skipped",
        directory.path,
        adopted,
        store.disk_nbytes,
        found - adopted,
        unreadable,
        skipped,
    )
    return PromptCache(store=store, disk=disk, bucket=bucket)


async def _open_disk_directory(
    settings: Settings, loaded: LoadedModel, mlx: MlxThread, signature: str, quantization: KvQuantization | None
) -> SnapshotDirectory | None:
    if settings.prompt_cache_disk_bytes == 0:
        logger.info("prompt cache disk tier off (--prompt-cache-disk-bytes 0)")
        return None
    info = loaded.info
    if loaded.vision is not None:
        logger.info("prompt cache disk tier off: a vision model's cache layers are mlx-vlm's, not written to disk")
        return None
    if not Path(info.path).exists():
        # A hub id: its weights' identity cannot be read from local files, and a new revision must never load the
        # state another one computed.
        logger.info("prompt cache disk tier off: %s is not a local model directory or file", info.path)
        return None
    root = settings.prompt_cache_dir or settings.cache_dir / PROMPT_CACHE_SUBDIRECTORY
    try:
        # The state every file must hold, measured once: a declared array the model does not have never reaches MLX.
        layout = await mlx.call(partial(measure_layout, loaded.model, quantization))
    except ValueError as error:
        logger.warning("prompt cache: no disk tier: the model's state cannot be checked on reading (%s)", error)
        return None
    try:
        stored_as = quantization.label if quantization is not None else ""
        identity = await anyio.to_thread.run_sync(
            partial(
                model_identity,
                info.path,
                weight_format=info.weight_format,
                template_signature=signature,
                stored_as=stored_as,
                # One directory per served name: the same files declared twice (`--model chat=X --model pooled=X`)
                # are two models whose files must never meet (loading one used to delete the other's).
                served_as=info.model_id,
            )
        )
        return await anyio.to_thread.run_sync(open_directory, root, identity, layout, quantization)
    except OSError as error:
        logger.warning("prompt cache: no disk tier (%s); conversations stay warm in memory only", error)
        return None
