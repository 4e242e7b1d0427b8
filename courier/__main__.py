from __future__ import annotations

from courier.server.cli import entry_point

entry_point()
