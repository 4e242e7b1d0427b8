"""Courier: an OpenAI-compatible LLM server for MLX models, built as an actor system."""

from __future__ import annotations

__version__ = "0.1.0"
