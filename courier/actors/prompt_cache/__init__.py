"""The prompt cache at work: the snapshot store actor, its disk tier, the scheduler's link."""
