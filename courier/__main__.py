from __future__ import annotations

from courier.cli import entry_point

entry_point()
