"""The composition root: the CLI and the supervisor, the one package that imports both actors and HTTP layer."""
