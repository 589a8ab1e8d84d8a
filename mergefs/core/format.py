"""safetensors header <-> bytes, with no I/O.

The format: an 8-byte little-endian header length N, then N bytes of UTF-8 JSON (an object whose
keys are tensor names plus an optional ``__metadata__`` string->string map), then the data buffer.
Each tensor entry has ``dtype``, ``shape`` and ``data_offsets`` ``[start, end)`` relative to the
buffer. Offsets must tile the buffer exactly: sorted by start, no holes, no overlaps, and the last
end equals the buffer size.

Every validation rule has its own exception class under :class:`FormatError`, so tests can name the
rule that fired. Pure functions only; safe to call from any thread.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass

from mergefs.core.errors import MergefsError

HEADER_SIZE_CAP = 100_000_000  # bytes, as in the reference implementation
MAX_TENSORS = 1_000_000  # a header cannot describe more tensors than this
MAX_RANK = 64

# name -> (itemsize in bytes, rank used for safetensors' write ordering).
# The rank reproduces the order of safetensors' Dtype enum: it sorts tensors by dtype descending,
# then by name, when it serialises.
DTYPES: dict[str, tuple[int, int]] = {
    "BOOL": (1, 0),
    "U8": (1, 4),
    "I8": (1, 5),
    "F8_E5M2": (1, 6),
    "F8_E4M3": (1, 7),
    "I16": (2, 9),
    "U16": (2, 10),
    "F16": (2, 11),
    "BF16": (2, 12),
    "I32": (4, 13),
    "U32": (4, 14),
    "F32": (4, 15),
    "F64": (8, 17),
    "I64": (8, 18),
    "U64": (8, 19),
}
FLOAT_DTYPES = frozenset({"F8_E5M2", "F8_E4M3", "F16", "BF16", "F32", "F64"})


class FormatError(MergefsError):
    """The bytes are not a valid safetensors file."""


class HeaderTooShort(FormatError):
    """Fewer than 8 bytes: no header length."""


class HeaderTooLarge(FormatError):
    """The declared header length exceeds the 100 MB cap."""


class HeaderOutOfBounds(FormatError):
    """The declared header length runs past the end of the file."""


class HeaderNotUtf8(FormatError):
    """The header bytes are not valid UTF-8."""


class HeaderNotJson(FormatError):
    """The header is not parseable JSON."""


class HeaderNotObject(FormatError):
    """The header JSON is not an object."""


class HeaderNotStartingWithBrace(FormatError):
    """The header does not start with '{'."""


class DuplicateKey(FormatError):
    """The same key appears twice in the header object."""


class InvalidMetadata(FormatError):
    """``__metadata__`` is not a string -> string map."""


class InvalidTensorEntry(FormatError):
    """A tensor entry lacks dtype/shape/data_offsets or has extra or mistyped fields."""


class UnknownDtype(FormatError):
    """The dtype is not one the format defines."""


class InvalidShape(FormatError):
    """A shape is not a list of non-negative integers, or is too large."""


class InvalidOffsets(FormatError):
    """``data_offsets`` is not ``[start, end]`` with 0 <= start <= end."""


class SizeMismatch(FormatError):
    """``end - start`` differs from prod(shape) * itemsize."""


class OffsetsNotContiguous(FormatError):
    """Tensors leave a hole or overlap in the data buffer."""


class BufferSizeMismatch(FormatError):
    """The data buffer does not end where the last tensor ends."""


class TooManyTensors(FormatError):
    """More tensors than the cap."""


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a safetensors file; offsets are relative to the data buffer, half-open."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def size_bytes(self) -> int:
        return self.end - self.start

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype][0]


@dataclass(frozen=True)
class Header:
    """A parsed header. ``tensors`` keeps the header's own order; ``data_start`` is 8 + N."""

    tensors: tuple[TensorInfo, ...]
    metadata: Mapping[str, str] | None
    data_start: int

    @property
    def buffer_size(self) -> int:
        return max((t.end for t in self.tensors), default=0)

    def by_name(self) -> dict[str, TensorInfo]:
        return {t.name: t for t in self.tensors}


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in pairs:
        if key in out:
            raise DuplicateKey(f"duplicate key {key!r} in header")
        out[key] = value
    return out


def header_length(prefix: bytes, file_size: int | None = None) -> int:
    """Return N from the first 8 bytes, checking the cap and (if known) the file size."""
    if len(prefix) < 8:
        raise HeaderTooShort(f"file has {len(prefix)} bytes, fewer than the 8-byte header length")
    (n,) = struct.unpack("<Q", prefix[:8])
    if n > HEADER_SIZE_CAP:
        raise HeaderTooLarge(f"header length {n} exceeds the {HEADER_SIZE_CAP}-byte cap")
    if file_size is not None and 8 + n > file_size:
        raise HeaderOutOfBounds(f"header length {n} runs past the end of a {file_size}-byte file")
    return n


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _parse_entry(name: str, entry: object) -> TensorInfo:
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        raise InvalidTensorEntry(
            f"tensor {name!r}: entry must have exactly dtype, shape and data_offsets"
        )
    dtype = entry["dtype"]
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise UnknownDtype(f"tensor {name!r}: unknown dtype {dtype!r}")
    shape = entry["shape"]
    if (
        not isinstance(shape, list)
        or len(shape) > MAX_RANK
        or not all(_is_int(d) and d >= 0 for d in shape)
    ):
        raise InvalidShape(f"tensor {name!r}: shape {shape!r} is not a list of integers >= 0")
    offsets = entry["data_offsets"]
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_is_int(o) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise InvalidOffsets(f"tensor {name!r}: data_offsets {offsets!r} is not [start, end]")
    numel = math.prod(shape)
    expected = numel * DTYPES[dtype][0]
    if offsets[1] - offsets[0] != expected:
        raise SizeMismatch(
            f"tensor {name!r}: {offsets[1] - offsets[0]} bytes for shape {shape} {dtype} "
            f"(expected {expected})"
        )
    return TensorInfo(name, dtype, tuple(shape), offsets[0], offsets[1])


def parse_header(header_bytes: bytes, data_start: int | None = None) -> Header:
    """Parse the N header bytes (without the 8-byte length). Checks everything but file size."""
    if data_start is None:
        data_start = 8 + len(header_bytes)
    try:
        text = header_bytes.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise HeaderNotUtf8(f"header is not valid UTF-8 ({exc.reason} at byte {exc.start})")
    if not text.startswith("{"):
        raise HeaderNotStartingWithBrace("header does not start with '{'")
    try:
        obj = json.loads(text, object_pairs_hook=_no_duplicates)
    except DuplicateKey:
        raise
    except (ValueError, RecursionError) as exc:
        raise HeaderNotJson(f"header is not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise HeaderNotObject("header JSON is not an object")
    if len(obj) - ("__metadata__" in obj) > MAX_TENSORS:
        raise TooManyTensors(f"header lists {len(obj)} entries, more than {MAX_TENSORS}")
    metadata = obj.pop("__metadata__", None)
    if metadata is not None and (
        not isinstance(metadata, dict)
        or not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())
    ):
        raise InvalidMetadata("__metadata__ must map strings to strings")
    tensors = tuple(_parse_entry(name, entry) for name, entry in obj.items())
    expected_start = 0
    for info in sorted(tensors, key=lambda t: (t.start, t.end)):
        if info.start != expected_start:
            kind = "hole before" if info.start > expected_start else "overlap at"
            raise OffsetsNotContiguous(
                f"{kind} tensor {info.name!r}: starts at {info.start}, expected {expected_start}"
            )
        expected_start = info.end
    return Header(tensors, metadata, data_start)


def parse_file_prefix(prefix: bytes, file_size: int) -> Header:
    """Parse a header from the first bytes of a file of ``file_size`` bytes.

    ``prefix`` must hold at least 8 + N bytes. Also checks that the buffer ends at the file end.
    """
    n = header_length(prefix, file_size)
    if len(prefix) < 8 + n:
        raise HeaderOutOfBounds(f"need {8 + n} bytes of header, got {len(prefix)}")
    header = parse_header(prefix[8 : 8 + n], 8 + n)
    if header.data_start + header.buffer_size != file_size:
        raise BufferSizeMismatch(
            f"data buffer holds {file_size - header.data_start} bytes but tensors "
            f"cover {header.buffer_size}"
        )
    return header


def parse_bytes(data: bytes) -> Header:
    """Parse a whole safetensors file held in memory."""
    return parse_file_prefix(data, len(data))


def write_order(tensors: Mapping[str, tuple[str, tuple[int, ...]]]) -> list[str]:
    """Names in the order safetensors writes them: dtype rank descending, then name."""
    for name, (dtype, _shape) in tensors.items():
        if dtype not in DTYPES:
            raise UnknownDtype(f"tensor {name!r}: unknown dtype {dtype!r}")
    return sorted(tensors, key=lambda n: (-DTYPES[tensors[n][0]][1], n))


def build_header(
    tensors: Mapping[str, tuple[str, tuple[int, ...]]],
    metadata: Mapping[str, str] | None = None,
) -> tuple[bytes, dict[str, TensorInfo]]:
    """Lay out tensors as safetensors does and return (8-byte length + padded header, layout).

    ``tensors`` maps name -> (dtype, shape). The header starts with '{', is padded with spaces to
    a multiple of 8, and offsets follow :func:`write_order`. The layout's offsets are relative to
    the data buffer, which starts right after the returned bytes.
    """
    if metadata is not None and not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise InvalidMetadata("__metadata__ must map strings to strings")
    layout: dict[str, TensorInfo] = {}
    obj: dict[str, object] = {}
    if metadata is not None:
        obj["__metadata__"] = dict(metadata)
    offset = 0
    for name in write_order(tensors):
        dtype, shape = tensors[name]
        if name == "__metadata__":
            raise InvalidTensorEntry("a tensor cannot be named __metadata__")
        if not all(_is_int(d) and d >= 0 for d in shape) or len(shape) > MAX_RANK:
            raise InvalidShape(f"tensor {name!r}: shape {list(shape)!r} is not valid")
        size = math.prod(shape) * DTYPES[dtype][0]
        layout[name] = TensorInfo(name, dtype, tuple(shape), offset, offset + size)
        obj[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, layout
