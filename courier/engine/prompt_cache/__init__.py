"""The prompt cache's snapshots as files: codec, layout, format, key, directory, budgets."""
