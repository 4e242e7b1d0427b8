"""The actor framework: the actor base and the ask pattern, side tasks, the MLX thread, trace context on messages."""
