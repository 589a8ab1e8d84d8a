"""Delta sidecars: compressed refinement levels of one expert's delta, and their decoding.

``mergefs compress SPEC`` (:mod:`mergefs.deltas.publish`) writes, beside every expert, a safetensors file
``mergefs-delta.<base-key>.<block_size>.safetensors`` (beside a bare ``x.safetensors``:
``x.mergefs-delta....``). It holds one ``U8`` tensor ``data`` with every payload and a *range
table* (``range_start``, ``range_end`` relative to ``data``, ``range_xxh3``, ``range_resid``);
its metadata key ``mergefs_delta`` (JSON) ties it to the base key, block size and layout, the base
blocks' content hash and the expert's identity, and lists per tensor its *levels*, each a
refinement of the previous ones:

``lowrank`` (``k`` components at ``bits``: 2/3/4/8, or 16 for float16)
    ``D ~ U V``; a *shared* range per tensor holds the scales and the packed ``V`` (``k x cols``),
    and each row block's range the packed rows of ``U`` (``rows_b x k``).
``quant`` (``bits``: 1, 2 or 3)
    the residual quantised per element; a block's range holds one float32 step per row, then
    the packed codes.
``rows`` (``bits``: 1, 2 or 3)
    ``quant`` on the changed rows only (a fine-tune's word embeddings change only the rows of
    tokens it saw): a block's range holds a bitmap of the block's rows (1: changed), then one
    float32 step per changed row, then the packed codes of the changed rows; the other rows'
    residual is exactly zero.
``vq`` (``bits``: 1, ``k``: 8, the dimension; ``bits * k`` is 8: one byte per code)
    the residual vector-quantised, ``k`` consecutive elements of a row per code: a *shared*
    range (one per sidecar, used by every ``vq`` level) holds the codebook, ``2**(bits * k)``
    float16 words of ``k`` values; a block's range holds one float32 scale per row, then one
    ``bits * k``-bit code per ``k`` elements (``cols`` a multiple of ``k``).
``ulp`` (``k``: 1 for bfloat16, 2 for float16 experts over a base of the same dtype)
    the delta in units in the last place: a block's range holds a bitmap of the elements whose
    16-bit pattern moved by at most ``2**(bits-1)`` (same sign), then a code of ``bits`` bits
    per such element;
    the reconstruction there is the base's bit pattern plus that move, exactly the expert's.
``sparse``
    exact values: a block's range holds uint32 positions and the expert's float32 values there,
    which overwrite the reconstruction.

For row block ``b`` the range of level ``l`` is ``first_range[l] + (b - first_block[t])``: the
bytes of one level of one row block are one contiguous range, and the ranges of consecutive
blocks are adjacent. ``range_resid`` of a block range is ``||D_b - D_hat_b||`` after levels
``0..l``, computed by the publisher with the engine's decoder itself (``D = fl(W_i - W_0)`` as
the index computes it; ``D_hat = fl(W_hat - W_0)`` with ``W_hat`` what the engine merges), so it
is the exact error of that block, not an estimate. Shared ranges have ``range_resid`` NaN.

Versions: 1 has no ``rows`` or ``vq`` levels; 1 and 2 define the low-rank product as a float32
BLAS product ``[U_1 .. U_j] [V_1; ..; V_j]`` (their residuals are exact for a BLAS that rounds
as the publisher's did). Version 3 (same layout and kinds as 2) fixes the product's summation
order, so that a compiled decoder of many blocks at once (:mod:`mergefs.deltas.decode`) and the
numpy one here give the same bits on any machine: per element, starting from +0,
``acc += fl(u_k * v_kj)`` for the components ``k`` of every low-rank level in order, float32,
each product and sum rounded (no fused multiply-add). Version 4 (same layout and kinds) makes
the product of the quantised low-rank levels (2-8 bits) *exact*, so that any float32 matrix
product (BLAS, fused multiply-adds, any order or blocking, any thread count) gives the same
bits, at BLAS speed: with the block's ``n`` quantised components, ``Q[r, c] = 2 * (code value)``
(odd integers, at most ``2**bits - 1``) and, on a power-of-two grid ``G`` (:func:`grid_of`, a
function of those components' shared ranges only), ``W[c, e] = rint(uscale_c * V[c, e] *
2**(G-1))`` (float64, then integers in float32), chosen so that ``sum_c (2**bits_c - 1) *
max_e |W[c, e]| < 2**24``: every partial sum of ``Q W`` is an integer that float32 holds
exactly. Then ``acc = fl(fl(Q W) * 2**-G) + 0`` (never -0), float16 low-rank levels are added
component by component as in version 3, and the rest as before. Version 5 (same layout and
kinds) takes the grid coarser where needed so that also ``|W| <= 127`` (``<= 63`` on rows of
8-bit codes, which the int8 route multiplies by ``2 W``): ``W`` is int8, so the product is one
int8 matrix product with int32 sums (oneDNN's AMX/VNNI route,
:mod:`mergefs.deltas.intgemm`, one call instead of a call per base-256 digit of ``W``), still the same
float32 bits as any float32 product. :func:`reconstruct` decodes all five.

Pure decoding and a blocking reader (pread, xxh3 checked per range); never on the trio thread.
"""

from __future__ import annotations
import json
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
import numpy as np
import xxhash
from mergefs.core import format as fmt
from mergefs.sources.base import AuxFile, GapAllowance
from mergefs.core.errors import SourceChanged
from mergefs.deltas.codes import DeltaError, Level, META_KEY, READABLE_VERSIONS, TensorLevels
from mergefs.deltas.reconstruct import shared_value


def delta_name(sidecar_name: str) -> str:
    """The delta sidecar's name from the index sidecar's (``mergefs-index.`` ->
    ``mergefs-delta.``)."""
    return sidecar_name.replace("mergefs-index.", "mergefs-delta.")


@dataclass(eq=False)
class DeltaSidecar:
    """One expert's delta sidecar, opened: the range table in memory, payloads read on demand.

    ``bytes_read`` counts payload bytes fetched (pread or ranged GET; the range table and header
    are read once at open and counted in ``header_bytes``), ``reads`` the fetches, and
    ``gap_bytes`` the part of ``bytes_read`` between the ranges :meth:`read_spans` coalesced
    (fetched and dropped). Shared ranges are cached after the first read (a few KiB per
    tensor), so each is read and counted once (a thread reading one makes the others wait,
    :meth:`claim_shared`). Thread-safe.
    """

    path: Path | str  # a local path, or the URL of a sidecar beside a remote expert
    meta: dict[str, Any]
    tensors: dict[str, TensorLevels]  # by tensor name
    data_offset: int  # absolute offset of ``data`` in the file
    range_start: np.ndarray
    range_end: np.ndarray
    range_xxh3: np.ndarray
    range_resid: np.ndarray
    header_bytes: int
    bytes_read: int = 0
    reads: int = 0
    gap_bytes: int = 0
    #: :meth:`read_spans`: spans at most this many bytes apart share one fetch (a remote
    #: sidecar: its source's ``coalesce_gap``); local sidecars read each span by one pread
    coalesce_gap_bytes: int = 0
    #: where :meth:`read_spans` takes the gaps it fetches from (the engine's, shared with the
    #: experts' exact reads: :class:`mergefs.sources.base.GapAllowance`); None: no limit
    gap_allowance: GapAllowance | None = None
    #: called as ``recorder(tensor, start, end, buf)`` for every span read (absolute file
    #: offsets), after its checksums: the engine's manifest hook. A fetch that coalesced
    #: spans records each span, not the gaps between them (as the exact path records the
    #: ranges it asked for), so the records do not depend on ``coalesce_gap_bytes``
    recorder: Any = None
    #: ``fetch(start, end)``: bytes of the file (a remote sidecar: ranged GETs); None: pread
    fetch: Callable[[int, int], bytes] | None = None
    _fd: int = -1
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _shared: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    _shared_lock: threading.Lock = field(default_factory=threading.Lock)
    #: shared range ids a thread is reading (:meth:`claim_shared`); others wait on _shared_cv
    _shared_pending: set[int] = field(default_factory=set)
    _shared_cv: threading.Condition = field(init=False)
    #: :mod:`mergefs.deltas.decode`'s packed shared values, by (tensor, depth), and (tensor, -1): the
    #: tensor's exact grids; under _shared_lock
    _packed: dict[tuple[str, int], Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._shared_cv = threading.Condition(self._shared_lock)

    @property
    def name(self) -> str:
        return str(self.path).rsplit("/", 1)[-1]

    def range_bytes(self) -> np.ndarray:
        return self.range_end - self.range_start

    def read(self, r0: int, r1: int, tensor: str = "") -> memoryview:
        """Bytes of the adjacent ranges ``r0 .. r1 - 1`` (one pread), checksums verified."""
        start, end = int(self.range_start[r0]), int(self.range_end[r1 - 1])
        if end == start:
            return memoryview(b"")
        view = self._fetch(start, end)
        self._verify(r0, r1, view, start, tensor)
        return view

    def read_spans(self, spans: Sequence[tuple[int, int]], tensor: str = ""
                   ) -> list[memoryview]:
        """:meth:`read` of each span ``(r0, r1)`` of adjacent ranges (range ids), each
        verified and recorded as :meth:`read` does; for a remote sidecar, spans whose bytes lie
        at most ``coalesce_gap_bytes`` apart share one fetch while the gap can be taken from
        ``gap_allowance`` (the bytes between them are fetched, counted in ``bytes_read`` and
        ``gap_bytes``, and dropped, as :mod:`mergefs.sources.remote` does for exact blocks). A local
        sidecar reads span by span."""
        if self.fetch is None:
            return [self.read(r0, r1, tensor) for r0, r1 in spans]
        out: list[memoryview] = [memoryview(b"")] * len(spans)
        byte_spans = [(int(self.range_start[r0]), int(self.range_end[r1 - 1]))
                      for r0, r1 in spans]
        todo = sorted((k for k, (a, b) in enumerate(byte_spans) if b > a),
                      key=lambda k: byte_spans[k][0])
        g = 0
        while g < len(todo):
            e, end = g, byte_spans[todo[g]][1]
            while e + 1 < len(todo) and self._may_join(byte_spans[todo[e + 1]][0] - end):
                e += 1
                end = max(end, byte_spans[todo[e]][1])
            start = byte_spans[todo[g]][0]
            view = self._fetch(start, end)
            used = 0
            for k in todo[g:e + 1]:
                a, b = byte_spans[k]
                out[k] = view[a - start:b - start]
                self._verify(spans[k][0], spans[k][1], out[k], a, tensor)
                used += b - a
            if used < end - start:
                with self._lock:
                    self.gap_bytes += end - start - used
            g = e + 1
        return out

    def _may_join(self, gap: int) -> bool:
        """Whether a span ``gap`` bytes past the current fetch's end joins it (taking a
        positive gap from the allowance)."""
        if gap > self.coalesce_gap_bytes:
            return False
        return gap <= 0 or self.gap_allowance is None or self.gap_allowance.take(gap)

    def _fetch(self, start: int, end: int) -> memoryview:
        """Bytes ``[start, end)`` of ``data`` by one fetch or pread, counted."""
        if self.fetch is not None:
            buf = self.fetch(self.data_offset + start, self.data_offset + end)
        else:
            with self._lock:
                if self._fd < 0:
                    self._fd = os.open(self.path, os.O_RDONLY)
                fd = self._fd
            buf = os.pread(fd, end - start, self.data_offset + start)
        if len(buf) != end - start:
            raise SourceChanged(f"{self.path}: truncated (delta sidecar changed while open)")
        with self._lock:
            self.bytes_read += len(buf)
            self.reads += 1
        return memoryview(buf)

    def _verify(self, r0: int, r1: int, view: memoryview, start: int, tensor: str) -> None:
        """Check the checksums of ranges ``r0 .. r1 - 1`` in ``view`` (which starts at byte
        ``start`` of ``data``) and record the span."""
        for r in range(r0, r1):
            lo, hi = int(self.range_start[r]) - start, int(self.range_end[r]) - start
            if xxhash.xxh3_64_intdigest(view[lo:hi]) != int(self.range_xxh3[r]):
                raise SourceChanged(f"{self.path}: checksum of range {r} differs (delta sidecar "
                                    "corrupt or changed since it was published)")
        if self.recorder is not None:
            self.recorder(tensor, self.data_offset + start, self.data_offset + start + len(view),
                          view)

    def read_runs(self, first: int, js: Sequence[int], tensor: str = "") -> dict[int, memoryview]:
        """Block ranges ``first + j`` for ``j`` in ``js`` (ascending), one pread per adjacent
        run; returns {j: bytes}."""
        out: dict[int, memoryview] = {}
        k = 0
        while k < len(js):
            e = k
            while e + 1 < len(js) and js[e + 1] == js[e] + 1:
                e += 1
            buf = self.read(first + js[k], first + js[e] + 1, tensor)
            base = int(self.range_start[first + js[k]])
            for j in js[k:e + 1]:
                r = first + j
                out[j] = buf[int(self.range_start[r]) - base:int(self.range_end[r]) - base]
            k = e + 1
        return out

    def abs_range(self, r0: int, r1: int) -> tuple[int, int]:
        """Absolute file offsets ``[start, end)`` of ranges ``r0 .. r1 - 1``."""
        return (self.data_offset + int(self.range_start[r0]),
                self.data_offset + int(self.range_end[r1 - 1]))

    def shared(self, level: Level, cols: int, tensor: str = ""
               ) -> tuple[np.ndarray, np.ndarray] | None:
        if level.shared < 0:
            return None
        with self._shared_cv:  # read (and counted, and recorded) once
            while level.shared in self._shared_pending:  # another thread's claim
                self._shared_cv.wait()
            got = self._shared.get(level.shared)
            if got is None:
                got = shared_value(level, self.read(level.shared, level.shared + 1, tensor),
                                   cols)
                self._shared[level.shared] = got
        return got

    def claim_shared(self, levels: Sequence[Level]) -> list[int]:
        """The shared range ids of ``levels`` neither cached nor claimed yet (ascending), now
        claimed by the caller, who reads them (:meth:`read_spans`: verified, counted,
        recorded), then passes each to :meth:`keep_shared` and finally all to
        :meth:`release_shared`; meanwhile :meth:`shared` of them waits."""
        with self._shared_cv:
            ids = sorted({lv.shared for lv in levels if lv.shared >= 0
                          and lv.shared not in self._shared
                          and lv.shared not in self._shared_pending})
            self._shared_pending.update(ids)
        return ids

    def keep_shared(self, level: Level, cols: int, buf: memoryview) -> None:
        """Cache the shared value of ``level`` from its range's bytes (claimed and read)."""
        value = shared_value(level, buf, cols)
        with self._shared_cv:
            self._shared[level.shared] = value

    def release_shared(self, ids: Sequence[int]) -> None:
        with self._shared_cv:
            self._shared_pending.difference_update(ids)
            self._shared_cv.notify_all()

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


def open_sidecar(path: Path) -> DeltaSidecar:
    """Parse a delta sidecar's header and range table (payloads stay on disk)."""
    with open(path, "rb") as f:
        def fetch(start: int, end: int) -> bytes:
            f.seek(start)
            return f.read(end - start)

        return _parse(path, fetch)


def open_remote_sidecar(url: str, fetch: Callable[[int, int], bytes],
                        coalesce_gap_bytes: int) -> DeltaSidecar:
    """A sidecar beside a remote expert: header and range table fetched by two or three
    ranged reads, payload ranges on demand through ``fetch(start, end)``; ranges at most
    ``coalesce_gap_bytes`` apart share one fetch (:meth:`DeltaSidecar.read_spans`)."""
    sc = _parse(url, fetch)
    sc.fetch = fetch
    sc.coalesce_gap_bytes = coalesce_gap_bytes
    return sc


def open_beside(aux: AuxFile) -> DeltaSidecar:
    """A sidecar found beside a source (``Checkpoint.aux_reader``): a local file is read by
    pread (:func:`open_sidecar`), a remote one by its ranged fetch (:func:`open_remote_sidecar`)."""
    if aux.path is not None:
        return open_sidecar(aux.path)
    assert aux.fetch is not None
    return open_remote_sidecar(aux.where, aux.fetch, aux.coalesce_gap_bytes)


def _parse(path: Path | str, fetch: Callable[[int, int], bytes]) -> DeltaSidecar:
    head = fetch(0, 8)
    if len(head) != 8:
        raise DeltaError(f"{path}: not a safetensors file")
    n = int.from_bytes(head, "little")
    if n > fmt.HEADER_SIZE_CAP:
        raise DeltaError(f"{path}: header too large")
    try:
        hdr = json.loads(fetch(8, 8 + n))
    except ValueError:
        raise DeltaError(f"{path}: header is not JSON") from None
    if not isinstance(hdr, dict):
        raise DeltaError(f"{path}: header is not a JSON object")
    meta = json.loads(hdr.get("__metadata__", {}).get(META_KEY, "null") or "null")
    if not isinstance(meta, dict) or "version" not in meta:
        raise DeltaError(f"{path}: not a mergefs delta sidecar")
    if meta["version"] not in READABLE_VERSIONS:
        raise DeltaError(f"{path}: delta sidecar of version {meta['version']}, this mergefs reads "
                         f"versions {', '.join(READABLE_VERSIONS)}: re-run `mergefs compress`")
    table: dict[str, np.ndarray] = {}
    kinds = {"range_start": "<i8", "range_end": "<i8", "range_xxh3": "<u8",
             "range_resid": "<f8"}
    spans = {key: hdr[key]["data_offsets"] for key in kinds}
    lo, hi = min(v[0] for v in spans.values()), max(v[1] for v in spans.values())
    blob = fetch(8 + n + lo, 8 + n + hi)  # the tables are adjacent: one read
    if len(blob) != hi - lo:
        raise DeltaError(f"{path}: truncated range table")
    for key, dt in kinds.items():
        s, e = spans[key]
        table[key] = np.frombuffer(blob[s - lo:e - lo], dtype=dt).copy()
    data_offset = 8 + n + int(hdr["data"]["data_offsets"][0])
    why = _table_problem(table, int(hdr["data"]["data_offsets"][1])
                         - int(hdr["data"]["data_offsets"][0]))
    if why:
        raise DeltaError(f"{path}: range table: {why}")
    tensors = {}
    n_ranges = len(table["range_start"])
    for tj in meta["tensors"]:
        if not isinstance(tj.get("name"), str) or not all(
                type(tj.get(key)) is int for key in ("t", "rows", "cols")):
            raise DeltaError(f"{path}: tensor entry {str(tj)[:80]}: name, t, rows or cols "
                             "missing or not of its type")
        levels = tuple(Level(lv["kind"], lv["bits"], lv["k"], lv["shared"], lv["first_range"])
                       for lv in tj["levels"])
        for level in levels:
            why = _level_problem(level, meta["version"], n_ranges)
            if why:
                raise DeltaError(f"{path}: tensor {tj['name']}: level {level.to_json()}: {why}")
        tensors[tj["name"]] = TensorLevels(tj["name"], tj["t"], tj["rows"], tj["cols"], levels)
    table_bytes = sum(a.nbytes for a in table.values())
    return DeltaSidecar(path, meta, tensors, data_offset, table["range_start"],
                        table["range_end"], table["range_xxh3"], table["range_resid"],
                        8 + n + table_bytes)


def _table_problem(table: dict[str, np.ndarray], data_bytes: int) -> str:
    """Why the range table does not describe ranges of the data tensor ("" if it does): the
    ranges must lie in it, in order, without overlap (a run is read as one span, and the
    compiled decoder trusts the offsets)."""
    start, end = table["range_start"], table["range_end"]
    if len({len(a) for a in table.values()}) != 1:
        return "its columns have different lengths"
    if len(start) and (int(start[0]) < 0 or int(end[-1]) > data_bytes):
        return f"a range lies outside the data tensor ({data_bytes} bytes)"
    if np.any(end < start) or np.any(start[1:] < end[:-1]):
        return "ranges out of order or overlapping"
    return ""


#: level kinds each sidecar version may hold, and the (bits, k) each kind decodes
KINDS_BY_VERSION = {"1": ("lowrank", "quant", "ulp", "sparse"),
                    "2": ("lowrank", "quant", "ulp", "sparse", "rows", "vq"),
                    "3": ("lowrank", "quant", "ulp", "sparse", "rows", "vq"),
                    "4": ("lowrank", "quant", "ulp", "sparse", "rows", "vq"),
                    "5": ("lowrank", "quant", "ulp", "sparse", "rows", "vq")}


def _level_problem(level: Level, version: str, n_ranges: int) -> str:
    """Why this level cannot be decoded by this reader ("" if it can)."""
    if not all(type(v) is int for v in (level.bits, level.k, level.shared, level.first_range)):
        return "bits, k, shared and first_range must be integers"
    if level.kind not in KINDS_BY_VERSION.get(version, ()):
        return (f"kind {level.kind!r} is not one of a version-{version} sidecar "
                f"({', '.join(KINDS_BY_VERSION.get(version, ()))}): re-run `mergefs compress`")
    ok = {"lowrank": level.bits in (2, 3, 4, 8, 16) and level.k >= 1,
          "quant": level.bits in (1, 2, 3, 4),
          "rows": level.bits in (1, 2, 3, 4),
          "vq": level.bits >= 1 and level.k >= 1 and level.bits * level.k == 8,
          "ulp": level.k in (1, 2) and 1 <= level.bits <= 8,
          "sparse": True}[level.kind]
    if not ok:
        return f"bits {level.bits} and k {level.k} are not valid for a {level.kind} level"
    needs_shared = level.kind in ("lowrank", "vq")
    if needs_shared and not 0 <= level.shared < n_ranges:
        return f"shared range {level.shared} is not in the range table ({n_ranges} ranges)"
    if not 0 <= level.first_range < n_ranges:
        return f"first range {level.first_range} is not in the range table ({n_ranges} ranges)"
    return ""
