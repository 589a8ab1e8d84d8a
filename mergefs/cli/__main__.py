"""``python -m mergefs.cli``: the ``mergefs`` command."""

from mergefs.cli import entry

entry()
