"""The texts a bench sends (system prompts, documents, prompts, extraction cases), kept as data beside the code in
bench/workloads/<bench>.toml."""

from __future__ import annotations

import tomllib
from functools import cache
from pathlib import Path
from typing import Any

WORKLOADS_DIR = Path(__file__).resolve().parent.parent / "workloads"


@cache
def workload(bench: str) -> dict[str, Any]:
    """bench/workloads/`bench`.toml, read once."""
    with (WORKLOADS_DIR / f"{bench}.toml").open("rb") as file:
        return tomllib.load(file)
