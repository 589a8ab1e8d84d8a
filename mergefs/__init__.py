"""mergefs: budgeted, lazy, verifiable merging of model checkpoints."""

__version__ = "0.1.0"
