"""mergefs' reproducible random masks: a counter-based uniform per (seed, tensor, model, element).

mergekit draws DARE and DELLA masks with ``torch.bernoulli`` (not reproducible without
``--random-seed``, and dependent on the order tensors are merged in). mergefs keeps element
``j`` of model ``i``'s delta in tensor ``name`` iff ``u(seed, name, i, j) < p_j`` (float64
comparison of the float32 keep probability ``p_j``), so a mask depends on neither block size nor
read order. Pure numpy; runs on any thread.
"""

from __future__ import annotations

import numpy as np
import xxhash

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def uniform(seed: int, tensor: str, model: int, start: int, count: int) -> np.ndarray:
    """``u(seed, tensor, model, j)`` in [0, 1) for flat indices ``j`` in ``[start, start+count)``."""
    key = np.uint64(xxhash.xxh3_64_intdigest(f"{seed}\x00{tensor}\x00{model}".encode()))
    x = np.arange(start, start + count, dtype=np.uint64)
    x *= _GOLDEN
    x += key
    x ^= x >> np.uint64(30)
    x *= _M1
    x ^= x >> np.uint64(27)
    x *= _M2
    x ^= x >> np.uint64(31)
    return (x >> np.uint64(11)).astype(np.float64) * (2.0**-53)


def keep_mask(seed: int, tensor: str, model: int, start: int, prob: np.ndarray | float
              ) -> np.ndarray:
    """float32 mask (1 kept, 0 dropped) of ``np.size(prob)`` elements from flat index ``start``."""
    p = np.asarray(prob, dtype=np.float32)
    count = int(p.size) if p.ndim else 1
    u = uniform(seed, tensor, model, start, count)
    return (u < p.astype(np.float64).ravel()).astype(np.float32)
