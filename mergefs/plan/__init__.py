"""Planning: which (expert, block) deltas to read under a budget, the bounds, and what budgets buy."""
