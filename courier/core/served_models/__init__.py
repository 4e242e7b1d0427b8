"""The models a server serves: their names and aliases, and which stay loaded."""
