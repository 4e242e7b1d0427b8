"""Process-level tuning for the machine: the CPU BLAS for MLX, glibc's malloc thresholds, MLX's buffer cache."""
