"""mergefs: budgeted, lazy, verifiable merging of model checkpoints.

The Python API (``mergefs.open(spec).plan("10%")``, ``.merge(outdir)``, ``.mount(path)``,
``mergefs.replay(manifest)``) lives in :mod:`mergefs.api`; see docs/api.md.
"""

__version__ = "0.2.0"

from mergefs.api import Merge, Mounted, open, replay
from mergefs.ops import MergeResult

__all__ = ["Merge", "MergeResult", "Mounted", "__version__", "open", "replay"]
