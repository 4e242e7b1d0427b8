"""What every bench shares, one module per idea: `servers` (start, wait, stop, logs), `models` (the embedded SmolLM2,
its float32 directory, the tiny models, mlx-lm in process), `clients` (timed streams), `conversations` (turns, cached
shares, Courier's cache stats), `stats` (percentiles, shares), `report` (Markdown, JSON, progress), `cli`
(arguments) and `workloads` (the texts in bench/workloads/). `support` is bench/'s one door to tests/support.

How each bench is run and what it measures: docs/benchmarks.md.
"""
