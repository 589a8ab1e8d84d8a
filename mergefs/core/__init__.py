"""Leaves: errors, the safetensors format, dtypes, sizes, progress, memory, the unit cache; import nothing of mergefs above them."""
