"""One module per actor: each owns its state and changes it only while handling a message from its inbox."""
