"""The prompt cache's pure core: the snapshot store and what it is made of."""
