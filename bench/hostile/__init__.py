"""Hand-made hostile requests for the fuzz bench's second phase: the input no OpenAPI document describes, as
seeded `Case`s, each one request and the answer it may get (`Expect`). Families and expectations: docs/benchmarks.md.
"""

from __future__ import annotations

from collections.abc import Callable

from bench.hostile.cases import Case, family_rng
from bench.hostile.fields import sampling_cases
from bench.hostile.media import image_cases, url_cases
from bench.hostile.shapes import shape_cases
from bench.hostile.strings import capsule_cases, json_string_cases
from bench.hostile.tenants import tenant_cases


def all_families(model: str, seed: int, *, vision: bool, keyed: bool = False) -> dict[str, Callable[[], list[Case]]]:
    """Each family's generator for a server of `model` (`vision`: one that takes images; `keyed`: one with API keys,
    which gets the tenants family alone)."""
    if keyed:
        return {"tenants": lambda: tenant_cases(model)}
    if vision:
        return {
            "urls": lambda: url_cases(model, family_rng(seed, "urls"), vision=True),
            "image-bytes": lambda: image_cases(model, family_rng(seed, "image-bytes")),
        }
    return {
        "json-strings": lambda: json_string_cases(model, family_rng(seed, "json-strings")),
        "capsules": lambda: capsule_cases(model, family_rng(seed, "capsules")),
        "urls": lambda: url_cases(model, family_rng(seed, "urls"), vision=False),
        "shapes": lambda: shape_cases(model, family_rng(seed, "shapes")),
        "sampling": lambda: sampling_cases(model),
    }
