"""Delta sidecars: compressed refinement levels of each expert's delta, how they are published and decoded."""
