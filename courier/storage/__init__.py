"""Stored responses and conversations: the storage protocol and its SQLite backend."""
