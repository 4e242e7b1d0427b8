"""Pure cores the engine and the actors build on: no MLX, no anyio, no I/O; tested directly with tables."""
