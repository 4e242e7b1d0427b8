"""The model registry's parts: the replies it holds while a model loads or unloads, and the failures it answers."""
