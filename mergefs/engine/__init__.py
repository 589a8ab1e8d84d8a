"""The merge engine: executes a plan unit by unit, writes outputs, records and replays manifests."""
