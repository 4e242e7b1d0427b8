"""The Anthropic Messages API: a pair of translations at the edge of the one generation (docs/api.md)."""
