"""The merge spec: a mergekit YAML config plus mergefs' keys, parsed and validated once, at the edge."""
