"""The package rule: each package imports only packages on lower layers (docs/architecture.md, "Packages").

Read with `ast`, so every import counts: module level, inside functions (the CLI's late imports) and under
`TYPE_CHECKING`. A package that is not on a layer fails too, so a new package has to be placed on purpose.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE_ROOT = Path(__file__).resolve().parents[1] / "courier"

# Top to bottom. Packages on one layer do not import each other.
LAYERS: tuple[frozenset[str], ...] = (
    frozenset({"__main__"}),
    frozenset({"server"}),
    frozenset({"actors", "http", "cluster"}),
    frozenset({"conversation"}),
    frozenset({"messages", "status"}),
    frozenset({"engine"}),
    frozenset({"model"}),
    frozenset({"core"}),
    frozenset({"runtime", "platform", "media", "storage", "grammar", "settings", "__init__"}),
)
LAYER_OF = {package: depth for depth, layer in enumerate(LAYERS) for package in layer}


def package_of(path: Path) -> str:
    """`courier/http/app.py` -> "http"; a top-level module is its own package (`courier/settings.py` -> "settings")."""
    parts = path.relative_to(PACKAGE_ROOT).parts
    return parts[0] if len(parts) > 1 else parts[0].removesuffix(".py")


def imported_packages(source: str, own: tuple[str, ...]) -> Iterator[tuple[int, str]]:
    """(line, package) for every `courier` package a module imports; `own`: its path parts under courier/."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "courier":
                    yield node.lineno, parts[1] if len(parts) > 1 else "__init__"
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the module's own package
                base = list(own[: len(own) - node.level])
                parts = ["courier", *base, *(node.module.split(".") if node.module else [])]
            else:
                parts = (node.module or "").split(".")
            if parts[0] != "courier":
                continue
            if len(parts) > 1:
                yield node.lineno, parts[1]
            else:  # `from courier import X`: X is a top-level module or a name from courier/__init__.py
                for alias in node.names:
                    name = alias.name
                    exists = (PACKAGE_ROOT / name).is_dir() or (PACKAGE_ROOT / f"{name}.py").is_file()
                    yield node.lineno, name if exists else "__init__"


def modules() -> list[Path]:
    return sorted(PACKAGE_ROOT.rglob("*.py"))


def test_every_package_is_on_a_layer() -> None:
    unplaced = {package_of(path) for path in modules()} - LAYER_OF.keys()
    assert not unplaced, f"place these packages on a layer in tests/test_layers.py and docs/architecture.md: {unplaced}"


@pytest.mark.parametrize("path", modules(), ids=lambda path: str(path.relative_to(PACKAGE_ROOT)))
def test_imports_only_go_down(path: Path) -> None:
    package = package_of(path)
    depth = LAYER_OF[package]
    upward = [
        f"line {line}: {package} (layer {depth}) imports {target} (layer {LAYER_OF.get(target, '?')})"
        for line, target in imported_packages(path.read_text(), path.relative_to(PACKAGE_ROOT).with_suffix("").parts)
        if target != package and LAYER_OF.get(target, -1) <= depth
    ]
    assert not upward, "\n".join(upward)


@pytest.mark.parametrize(
    ("source", "own", "expected"),
    [
        ("from courier.http.errors import ApiError", ("core", "stop_text"), "http"),
        ("import courier.actors.ingress", ("engine", "batch_engine"), "actors"),
        ("def late():\n    from courier.server import cli", ("runtime", "actor"), "server"),
        ("from ..messages import base", ("core", "stop_text"), "messages"),
        ("from courier import settings", ("core", "stop_text"), "settings"),
        ("from courier import __version__", ("server", "cli"), "__init__"),
    ],
)
def test_the_checker_sees_every_import_form(source: str, own: tuple[str, ...], expected: str) -> None:
    assert [target for _, target in imported_packages(source, own)] == [expected]
