"""Open client connections against the cap, for `/health` and `/metrics`; written by the connection gate and the
layer that tells a request its client has gone (`server/client_watch.py`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(slots=True, kw_only=True)
class ConnectionStats:
    limit: int  # --max-connections as applied (lowered to fit the open-file limit)
    open: int = 0
    refused: int = 0  # connections answered 503 and closed, the cap being reached
    # Requests whose client went away before their answer was written: told `http.disconnect`, their work cancelled.
    client_gone: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)
