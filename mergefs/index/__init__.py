"""The block index: per (expert, block) delta norms, hashes and zero flags, built once and reused."""
