"""What every bench shares, one module per idea: `servers` (start, wait, stop, logs), `models` (the embedded SmolLM2,
its float32 directory, the tiny models, mlx-lm in process), `clients` (timed streams), `stats` (percentiles,
shares), `report` (Markdown, JSON, progress) and `cli` (arguments). `support` is bench/'s one door to tests/support.

How each bench is run and what it measures: docs/benchmarks.md.
"""
