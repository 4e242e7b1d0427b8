"""Constrained decoding: what a request asks generation to follow (a JSON schema, a tool call), as an llguidance
grammar, and the compiled grammars' bounded cache. The engine applies the token masks; this package knows nothing
of MLX."""
