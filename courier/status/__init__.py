"""What the server reports about itself: its phase, the actors' counters, and Prometheus metrics."""
