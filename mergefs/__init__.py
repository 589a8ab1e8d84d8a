"""mergefs."""
