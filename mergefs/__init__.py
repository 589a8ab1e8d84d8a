"""mergefs: budgeted, lazy, verifiable merging of model checkpoints.

The Python API (``mergefs.open(spec).plan("10%")``, ``.merge(outdir)``, ``.mount(path)``,
``mergefs.replay(manifest)``) lives in :mod:`mergefs.api`; see docs/api.md. The package's map
and import order: docs/architecture.md.
"""

from mergefs.api import Merge, Mounted, open, replay
from mergefs.ops import MergeResult
from mergefs.core.errors import MergefsError
from mergefs.core.version import __version__

__all__ = ["Merge", "MergeResult", "MergefsError", "Mounted", "__version__", "open", "replay"]
