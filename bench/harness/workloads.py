"""The texts a bench sends (system prompts, documents, prompts, extraction cases, JSON schemas), kept as data beside
the code in bench/workloads/<bench>.toml (or .json, for JSON schemas and their instances)."""

from __future__ import annotations

import json
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


@cache
def json_workload(bench: str) -> Any:
    """bench/workloads/`bench`.json, read once."""
    return json.loads((WORKLOADS_DIR / f"{bench}.json").read_text())
