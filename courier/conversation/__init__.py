"""What a conversation is made of and how a turn is prepared: items, renders, capsules, compaction, turns."""
