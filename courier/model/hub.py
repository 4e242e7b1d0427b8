"""A hub repo's files on this machine: downloaded once into the Hugging Face cache, or found there offline."""

from __future__ import annotations

from pathlib import Path

from courier.model.loader import ModelLoadError


def fetch_repo(repo_id: str) -> Path:
    """The local snapshot of `repo_id` (the files mlx-lm would fetch: configs, tokenizer, safetensors weights).
    Blocking: call it off the event loop. `HF_HUB_OFFLINE=1` finds a cached snapshot without the network."""
    from huggingface_hub import snapshot_download  # late: a cold import of the hub client is slow
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
    from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS

    try:
        return Path(snapshot_download(repo_id, allow_patterns=DEFAULT_ALLOW_PATTERNS))
    except LocalEntryNotFoundError as error:
        raise ModelLoadError(
            f"cannot load model from {repo_id}: it is not in the Hugging Face cache and cannot be downloaded ({error})"
        ) from None
    except (HfHubHTTPError, OSError, ValueError) as error:
        raise ModelLoadError(f"cannot load model from {repo_id}: the Hugging Face hub answered {error}") from None
