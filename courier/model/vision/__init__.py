"""Vision-language models: images reach the model as embeddings in its first prefill.

Optional: needs mlx-vlm (`pip install 'courier[vision]'`). Only `model_dir` may be
imported without it.
"""
