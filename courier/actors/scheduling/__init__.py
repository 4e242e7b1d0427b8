"""The scheduler's parts: the requests it holds, their promotion into the batch, their events, and idle warm-ups."""
