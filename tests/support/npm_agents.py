"""The agent binaries the end-to-end tests run (Claude Code, Codex CLI, opencode), from `.npm-agents/`.

`scripts/dev.sh test` installs them with npm beside the tests rather than before them: it names a file in
INSTALLED_VARIABLE and creates it once npm is done, and a test that needs an agent waits for that file before it
looks for the binary. Without the variable (pytest run by hand) the binary is looked for at once.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest

from tests.support.polling import attempts

ROOT = Path(__file__).resolve().parents[2]
BINARIES = ROOT / ".npm-agents" / "node_modules" / ".bin"
INSTALLED_VARIABLE = "COURIER_TEST_AGENTS_INSTALLED"
# npm downloads the three (opencode is a 185 MB binary) while the tests run: ~20-30 s on the CI machines.
INSTALL_DEADLINE_S = 600.0


def agent_binary(name: str, package: str) -> Path:
    """The agent's binary, once dev.sh's install is done; the test is skipped where it is not installed."""
    if not _install_done():
        pytest.skip(f"scripts/dev.sh did not finish installing the agents within {INSTALL_DEADLINE_S:g} s")
    binary = BINARIES / name
    if not binary.exists():
        pytest.skip(
            f"{package} is not installed at {binary.relative_to(ROOT)}: scripts/dev.sh test installs it there when "
            f"npm is found (npm install --prefix .npm-agents {package}@<version in scripts/dev.sh>)"
        )
    return binary


@functools.cache
def _install_done() -> bool:
    """Whether dev.sh's install is over (at once without INSTALLED_VARIABLE); waited for once per process."""
    marker = os.environ.get(INSTALLED_VARIABLE)
    return marker is None or any(Path(marker).exists() for _ in attempts(INSTALL_DEADLINE_S))
