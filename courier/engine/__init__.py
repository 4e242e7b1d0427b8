"""The code that runs on the MLX thread: continuous batching, model state, snapshots, warm-ups, its vocabulary."""
