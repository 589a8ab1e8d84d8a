"""``python -m mergefs``: the ``mergefs`` command."""

from mergefs.cli import entry

entry()
