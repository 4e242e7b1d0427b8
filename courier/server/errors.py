"""Why the server could not start or keep running, for the CLI to report and exit on."""

from __future__ import annotations


class ServerFailed(RuntimeError):
    """The server could not start (the model did not load, a key file is unreadable); the message says why."""
