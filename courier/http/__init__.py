"""The OpenAI-compatible HTTP surface: body validation, routes, SSE framing, and failures turned into status codes."""
