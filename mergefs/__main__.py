"""``python -m mergefs``: the ``mergefs`` command."""

import sys

from mergefs.cli import main

sys.exit(main())
