"""Courier replicas behind a front: the replicas' names and addresses, and the front's generated configuration."""
