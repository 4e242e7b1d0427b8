"""Finding, converting and loading the served model (text or vision), and what is known about it."""
