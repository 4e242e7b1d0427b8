"""Tool calling without MLX: reading calls out of generated text, generic and custom tools."""
