"""The ``mergefs`` command line."""
