"""The typed messages between actors, one module per inbox, and the two ways to use them from outside an actor."""
