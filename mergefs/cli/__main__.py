"""``python -m mergefs.cli``: the ``mergefs`` command."""

import sys

from mergefs.cli import main

sys.exit(main())
