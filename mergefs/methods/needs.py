"""What merging one tensor holds at its peak, per method and path: the formulas behind the
memory cap (mergefs.engine.working_set) and ``mergefs methods``' memory column. Pure.

A unit is merged on one of three paths (mergefs.engine.merger), with ``n`` the tensor's
elements, ``k`` the inputs besides the base, ``s`` and ``o`` the source's and the output's bytes
per element:

- ``blocks``: elementwise methods merge units of about ``UNIT_ELEMS`` elements;
- ``staged``: a method with a two-phase form (:class:`.base.Staged`: the GTA rows) holds, in
  phase 1, the base's float32 values and one input's whole tensor (raw, float32, its delta, the
  method's workspace) at a time; in phase 2 blocks of ``STAGED_BLOCK_ELEMS`` elements of every
  input; throughout, one bit per element per input (the masks) and at the end the output's bytes
  (twice: the blocks and their join). Both phases are counted: glibc's heap does not always
  reuse phase 1's freed buffers for phase 2's (measured);
- ``whole``: every input's whole tensor (raw and float32) plus the method's own temporaries
  (:attr:`.base.Method.workspace`) and the output.

The formulas count the buffers the engine and the method allocate (tests/engine/test_staged.py
measures the staged path's peak resident memory against them); not the interpreter, numpy and
torch themselves (~0.1 GB, ~0.4 GB with torch), a mount's caches, or the kernel's page cache.
"""

from __future__ import annotations

from dataclasses import dataclass

from mergefs.methods.base import Method

#: elements per block of the staged path's phase 2 (a multiple of 32: torch's sum groups)
STAGED_BLOCK_ELEMS = 1 << 19
#: elementwise methods' units: about this many elements
UNIT_ELEMS = 1 << 20
#: the dtypes merged (others pass through)
MERGED_DTYPES = ("F32", "BF16", "F16")


@dataclass(frozen=True)
class Need:
    """What merging one tensor holds at its peak: ``size_bytes`` on ``path``."""

    tensor: str
    size_bytes: int
    path: str  # "blocks" | "staged" | "whole"


def tensor_need(method: Method, tensor: str, n_elems: int, n_inputs: int, src_item: int,
                out_item: int, path: str, block_elems: int = STAGED_BLOCK_ELEMS) -> Need:
    """The peak bytes of merging a tensor of ``n_elems`` elements with ``n_inputs`` inputs
    besides the base (source items of ``src_item`` bytes, output items of ``out_item``) on
    ``path``."""
    n, k, s = n_elems, n_inputs, src_item
    a, b = method.workspace
    read = (k + 1) * (s + 4)  # every input's raw bytes and float32 values, the base's too
    if path == "blocks":
        unit = min(n, UNIT_ELEMS)
        return Need(tensor, unit * (read + a + b * k + 4 + 2 * out_item), path)
    if path == "staged":
        st = method.staged
        assert st is not None
        masks = k * ((n + 7) // 8)
        phase1 = n * (4 + s + 4 + 4 + st.phase1_bytes)  # base, one input raw + f32, its delta
        blk = min(n, block_elems + 63)  # (a last block takes the tail and up to 63 more)
        phase2 = blk * (read + k * st.block_bytes_per_input + st.block_bytes)
        return Need(tensor, phase1 + phase2 + masks + 2 * n * out_item, path)
    return Need(tensor, n * (read + a + b * k + 4 + 2 * out_item), path)


def formula(method: Method, blockwise: bool) -> str:
    """``method``'s need as a formula in ``n``, ``k``, ``s``, ``o`` (module docstring), for
    ``mergefs methods`` and docs/operators.md (``blockwise``: the engine may merge its units
    block by block)."""
    a, b = method.workspace
    whole = f"n((k+1)(s+4) + {a} + {b}k + 4 + 2o)"
    st = method.staged
    if st is not None:
        whole = (f"n({12 + st.phase1_bytes} + s + 2o + k/8) + "
                 f"2^19((k+1)(s+4) + {st.block_bytes_per_input}k + {st.block_bytes}) "
                 "(in two phases)")
    if blockwise:
        return f"{whole}; block-wise units: n = min(n, 2^20) in n((k+1)(s+4) + {a} + {b}k + 4 + 2o)"
    return whole
