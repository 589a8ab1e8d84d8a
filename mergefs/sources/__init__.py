"""Where bytes come from: one source protocol (read ranges with counters, aux files, identity) over local files, object stores, the Hub and LoRA adapters."""
