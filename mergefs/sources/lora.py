"""LoRA experts: a PEFT LoRA adapter applied to a model, computed block by block.

A ``model+lora`` reference (``hub.join_lora``), or a bare PEFT adapter directory listed as a
model (applied to the merge's base), opens as a :class:`LoraCheckpoint`: the model's tensor map,
in which every tensor the adapter targets reads as ``W + scale * B @ A``, as PEFT's
``merge_and_unload`` (which mergekit runs) computes it: ``scale = lora_alpha / r`` (``/ sqrt(r)``
with rsLoRA; ``rank_pattern`` and ``alpha_pattern`` per module), transposed for embeddings and
``fan_in_fan_out``, the sum ``W + delta`` made in float32 and rounded once to the weight's dtype.
Every full tensor the adapter saves (``modules_to_save``, saved embedding layers)
replaces the model's, read from the adapter file by range.

Only the factors (read once, at open) and the rows of ``W`` a block needs are read; when the
model is the merge's base those rows are the base's bytes (counted on the base), so a LoRA expert
costs its adapter's bytes, not a model's. A block's delta is computed elementwise in float32 in a
fixed order (``sum_k B[:, k] * A[k, :]``, k ascending), so its bytes do not depend on the range
that asked for it (the index hashes blocks, the engine verifies them). PEFT multiplies with a BLAS
matmul: the two agree to float32 rounding of that sum, not always bit for bit.

Refused, naming the adapter (not supported yet): DoRA, PEFT types other than LoRA,
``layer_replication``, ``trainable_token_indices``, ``target_parameters``, LoRA biases,
convolution LoRA, pickle adapters. Reads block on disk: worker threads only, never the trio
thread.
"""

from __future__ import annotations

import bisect
import json
import logging
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from mergefs.sources.local import Checkpoint
from mergefs.sources.base import GapAllowance, ReadRange, TensorLoc
from mergefs.core.dtypes import decode_f32, encode
from mergefs.core.errors import SourceChanged, SourceError
from mergefs.core.format import DTYPES, FLOAT_DTYPES
from mergefs.spec.refs import split_lora
from mergefs.sources.local import open_local
from mergefs.spec.options import RemoteOptions


log = logging.getLogger(__name__)

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
#: The adapter's weight file among a LoraCheckpoint's files (beside the model's own names).
ADAPTER_KEY = "adapter/" + ADAPTER_WEIGHTS
_PREFIX = "base_model.model."
_FACTOR_RE = re.compile(r"(?P<module>.+)\.(?P<kind>lora_A|lora_B)\.weight|"
                        r"(?P<emodule>.+)\.(?P<ekind>lora_embedding_A|lora_embedding_B)")
_REFUSED_TRUE = ("use_dora", "lora_bias", "use_qalora", "use_bdlora")
_REFUSED_SET = ("layer_replication", "trainable_token_indices", "target_parameters",
                "alora_invocation_tokens")


@dataclass(frozen=True, eq=False)
class Factor:
    """One adapted tensor: ``delta = scale * B @ A`` (``transpose``: its transpose), float32."""

    a: np.ndarray  # (r, in)
    b: np.ndarray  # (out, r)
    scale: float
    transpose: bool

    def rows(self, r0: int, r1: int) -> np.ndarray:
        """Rows ``[r0, r1)`` of the delta, float32, in a fixed elementwise order."""
        if self.transpose:  # (B @ A).T = A.T @ B.T: row j is sum_k A[k, j] * B[:, k]
            lhs, rhs = self.a[:, r0:r1].T, self.b.T
        else:
            lhs, rhs = self.b[r0:r1], self.a
        out = np.zeros((r1 - r0, rhs.shape[1]), dtype=np.float32)
        for k in range(rhs.shape[0]):
            out += lhs[:, k : k + 1] * rhs[k][None, :]
        out *= np.float32(self.scale)
        return out


def is_adapter_dir(path: str) -> bool:
    """A PEFT adapter directory (``adapter_config.json``, no model weights of its own)."""
    p = Path(path)
    return (p / ADAPTER_CONFIG).is_file() and not (p / "model.safetensors").exists() and not (
        p / "model.safetensors.index.json").exists()


def open_lora_ref(path: str, options: RemoteOptions | None, base: Checkpoint | None
                  ) -> LoraCheckpoint | None:
    """A ``model+lora`` reference, or a bare adapter directory (applied to ``base``), as a
    :class:`LoraCheckpoint`; None when ``path`` names no adapter."""
    parts = split_lora(path)
    if parts is not None:
        model_path, adapter = parts
        if "://" in model_path:
            raise SourceError(f"{path}: a LoRA adapter on a remote model is not supported yet "
                              "(the model must be local or cached)")
        if base is not None and model_path == str(base.root):
            return open_lora(base, adapter, own_model=False, name=path)
        return open_lora(open_local(model_path), adapter, own_model=True, name=path)
    if "://" not in path and is_adapter_dir(path):
        if base is None or base.is_remote:
            raise SourceError(f"{path}: a bare LoRA adapter needs a local base model to apply "
                              "to (a remote base is not supported yet)")
        return open_lora(base, path, own_model=False, name=path)
    return None


def open_lora(model: Checkpoint, adapter_dir: str, *, own_model: bool, name: str
              ) -> LoraCheckpoint:
    root = Path(adapter_dir)
    config = _read_config(root)
    if not (root / ADAPTER_WEIGHTS).is_file():
        if any(root.glob("adapter_model.bin")):
            raise SourceError(f"{root / 'adapter_model.bin'}: pickle adapters are not read "
                              "(mergefs reads safetensors only); save it with "
                              "safe_serialization=True")
        raise SourceError(f"{root}: no {ADAPTER_WEIGHTS} found")
    adapter = open_local(root / ADAPTER_WEIGHTS)
    factors, replaced = _map_tensors(root, config, adapter, model)
    return LoraCheckpoint(name, model, adapter, root, factors, replaced, own_model,
                          xxhash.xxh3_64_hexdigest((root / ADAPTER_CONFIG).read_bytes()))


def _read_config(root: Path) -> dict[str, Any]:
    where = root / ADAPTER_CONFIG
    try:
        config = json.loads(where.read_text())
    except OSError as exc:
        raise SourceError(f"{where}: cannot read: {exc.strerror}") from None
    except ValueError as exc:
        raise SourceError(f"{where}: not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise SourceError(f"{where}: expected a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise SourceError(f"{where}: peft_type {config.get('peft_type')!r} is not supported yet "
                          "(only LORA)")
    for key in _REFUSED_TRUE:
        if config.get(key):
            raise SourceError(f"{where}: {key} is not supported yet")
    for key in _REFUSED_SET:
        if config.get(key):
            raise SourceError(f"{where}: {key} is not supported yet")
    if not isinstance(config.get("r", 8), int) or not isinstance(
            config.get("lora_alpha", 8), (int, float)):
        raise SourceError(f"{where}: r must be an integer and lora_alpha a number")
    return config


def _pattern_value(patterns: Mapping[str, Any], module: str, default: Any) -> Any:
    """PEFT's ``get_pattern_key``: the first pattern matching the end of the module name."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _map_tensors(root: Path, config: Mapping[str, Any], adapter: Checkpoint, model: Checkpoint
                 ) -> tuple[dict[str, Factor], dict[str, TensorLoc]]:
    """The adapter's factors by model tensor name, and its full tensors replacing the model's."""
    pairs: dict[str, dict[str, np.ndarray]] = {}
    embedding: set[str] = set()
    replaced: dict[str, TensorLoc] = {}
    for key, loc in adapter.tensors.items():
        name = key.removeprefix(_PREFIX)
        m = _FACTOR_RE.fullmatch(name)
        if m is None:
            if "lora_" in name:
                raise SourceError(f"{root / ADAPTER_WEIGHTS}: tensor {key!r} is not supported "
                                  "yet")
            target = name.replace(".base_layer.", ".")  # saved embedding layers
            _check_target(root, key, target, loc.shape, model)
            replaced[target] = TensorLoc(target, ADAPTER_KEY, loc.start, loc.end, loc.dtype,
                                         loc.shape)
            continue
        module = m.group("module") or m.group("emodule")
        kind = (m.group("kind") or m.group("ekind"))[-1]  # "A" or "B"
        if m.group("emodule"):
            embedding.add(module)
        if loc.dtype not in FLOAT_DTYPES or len(loc.shape) != 2:
            raise SourceError(f"{root / ADAPTER_WEIGHTS}: {key}: only 2-D floating LoRA "
                              f"factors are supported yet (got {loc.dtype}{list(loc.shape)})")
        pairs.setdefault(module, {})[kind] = decode_f32(adapter.read_tensor(key),
                                                        loc.dtype).reshape(loc.shape)
    factors: dict[str, Factor] = {}
    rank_pattern = config.get("rank_pattern") or {}
    alpha_pattern = config.get("alpha_pattern") or {}
    for module, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise SourceError(f"{root / ADAPTER_WEIGHTS}: {module} has lora_{set(ab).pop()} "
                              "but not its other factor")
        a, b = ab["A"], ab["B"]
        transpose = module in embedding or bool(config.get("fan_in_fan_out"))
        r = a.shape[0]  # embeddings: lora_embedding_A (r, vocab), lora_embedding_B (dim, r)
        if b.shape[1] != r:
            raise SourceError(f"{root / ADAPTER_WEIGHTS}: {module}: factor shapes "
                              f"{list(a.shape)} and {list(b.shape)} do not multiply")
        want_r = _pattern_value(rank_pattern, module, config.get("r", 8))
        if want_r != r:
            raise SourceError(f"{root / ADAPTER_WEIGHTS}: {module}: rank {r} but the config "
                              f"says {want_r}")
        alpha = _pattern_value(alpha_pattern, module, config.get("lora_alpha", 8))
        scale = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
        target = f"{module}.weight"
        shape = (a.shape[1], b.shape[0]) if transpose else (b.shape[0], a.shape[1])
        _check_target(root, module, target, shape, model)
        factors[target] = Factor(a, b, float(scale), transpose)
    return factors, replaced


def _check_target(root: Path, key: str, target: str, shape: tuple[int, ...],
                  model: Checkpoint) -> None:
    loc = model.tensors.get(target)
    if loc is None:
        raise SourceError(f"{root}: adapter tensor {key!r} targets {target!r}, which the model "
                          f"{model.root} does not have")
    if tuple(loc.shape) != tuple(shape):
        raise SourceError(f"{root}: adapter tensor {key!r} has shape {list(shape)}, the model's "
                          f"{target!r} {list(loc.shape)}")
    if loc.dtype not in FLOAT_DTYPES:
        raise SourceError(f"{root}: adapter tensor {key!r} targets the non-floating {target!r}")


class LoraCheckpoint(Checkpoint):
    """A model with a LoRA adapter applied; the interface of :class:`Checkpoint`.

    ``root`` is the adapter directory; ``files`` are the model's weight files and the adapter's
    (:data:`ADAPTER_KEY`). ``counters`` count the adapter's bytes read, and the model's when the
    model is not the merge's base (``own_model``).
    """

    def __init__(self, name: str, model: Checkpoint, adapter: Checkpoint, root: Path,
                 factors: dict[str, Factor], replaced: dict[str, TensorLoc], own_model: bool,
                 config_xxh3: str) -> None:
        tensors = {**model.tensors, **replaced}
        super().__init__(root, [*model.files, ADAPTER_KEY], tensors,
                         {**model.headers, ADAPTER_KEY: adapter.headers[ADAPTER_WEIGHTS]},
                         {**model.identities, ADAPTER_KEY: adapter.identities[ADAPTER_WEIGHTS]},
                         model.extra_files, model.index_json)
        self.model, self.adapter = model, adapter
        self.factors, self.own_model = factors, own_model
        self._name, self._config_xxh3 = name, config_xxh3
        self._starts: dict[str, tuple[list[int], list[TensorLoc]]] = {}
        for loc in sorted(tensors.values(), key=lambda t: (t.file, t.start)):
            starts, locs = self._starts.setdefault(loc.file, ([], []))
            starts.append(loc.start)
            locs.append(loc)

    @property
    def name(self) -> str:
        return self._name

    @property
    def is_dir(self) -> bool:
        return True

    def path_of(self, file: str) -> Path:
        if file == ADAPTER_KEY:
            return self.root / ADAPTER_WEIGHTS
        return self.model.path_of(file)  # type: ignore[return-value]

    def read_extra(self, rel: str) -> bytes:
        return self.model.read_extra(rel)

    def copy_extra(self, rel: str, dst: Path) -> None:
        self.model.copy_extra(rel, dst)

    def extra_dir(self) -> Path | None:
        return self.model.extra_dir()  # the non-weight files are the model's

    def local_files(self) -> list[tuple[str, Path]]:
        """The model's files and the adapter's (its weights and its config)."""
        return [*self.model.local_files(), (str(self.root), self.root / ADAPTER_WEIGHTS),
                (str(self.root), self.root / ADAPTER_CONFIG)]

    def identity_json(self) -> dict[str, object]:
        return {"root": self._name, "files": [self.identities[f].to_json() for f in self.files],
                "adapter_config_xxh3": self._config_xxh3}

    def check_unchanged(self) -> None:
        self.model.check_unchanged()
        self.adapter.check_unchanged()

    def fds(self) -> dict[str, int]:
        return {**self.model.fds(), ADAPTER_KEY: self.adapter.fds()[ADAPTER_WEIGHTS]}

    def close(self) -> None:
        self.adapter.close()
        if self.own_model:
            self.model.close()

    def read_itemsize(self, name: str) -> int:
        """0 for an adapted tensor of the merge's base (its rows are the base's bytes, counted
        on the base); the stored itemsize otherwise."""
        if name in self.factors and not self.own_model:
            return 0
        return super().read_itemsize(name)

    def _pread(self, file: str, start: int, end: int) -> bytes:
        return bytes(self.read_ranges([ReadRange(file, start, end)])[0])

    def _tensor_at(self, rng: ReadRange) -> TensorLoc:
        starts, locs = self._starts.get(rng.file, ([], []))
        k = bisect.bisect_right(starts, rng.start) - 1
        if k < 0 or rng.end > locs[k].end:
            raise SourceError(f"{self.path_of(rng.file)}: range [{rng.start}, {rng.end}) is not "
                              "inside one tensor")
        return locs[k]

    def read_ranges(self, ranges: Iterable[ReadRange],
                    gap_allowance: GapAllowance | None = None) -> list[memoryview]:
        """Each range's bytes: the model's, the adapter's full tensors', or computed rows of
        ``W + delta`` for adapted tensors (whole rows are read and computed, then cut); the
        model's ranges take their coalesced gaps from ``gap_allowance``."""
        ranges = list(ranges)
        out: list[memoryview | None] = [None] * len(ranges)
        plain: list[int] = []
        for k, rng in enumerate(ranges):
            if rng.file == ADAPTER_KEY:
                data = self.adapter.read_ranges([ReadRange(ADAPTER_WEIGHTS, rng.start,
                                                           rng.end)])[0]
                self.counters.add(len(data))
                out[k] = data
            elif (loc := self._tensor_at(rng)).name in self.factors:
                out[k] = memoryview(self._adapted(loc, rng))
            else:
                plain.append(k)
        if plain:
            got = self.model.read_ranges([ranges[k] for k in plain], gap_allowance=gap_allowance)
            if self.own_model:
                self.counters.add(sum(len(v) for v in got))
            for k, view in zip(plain, got):
                out[k] = view
        return [v for v in out if v is not None]

    def _adapted(self, loc: TensorLoc, rng: ReadRange) -> bytes:
        item = DTYPES[loc.dtype][0]
        cols = math.prod(loc.shape[1:])
        e0, e1 = (rng.start - loc.start) // item, -(-(rng.end - loc.start) // item)
        r0, r1 = e0 // cols, -(-e1 // cols)
        w = self.model.read_ranges([ReadRange(loc.file, loc.start + r0 * cols * item,
                                              loc.start + r1 * cols * item)])[0]
        if self.own_model:
            self.counters.add(len(w))
        values = decode_f32(w, loc.dtype).reshape(r1 - r0, cols)
        # W + delta in float32, rounded once to the weight's dtype (as PEFT merges on CPU)
        data = encode(values + self.factors[loc.name].rows(r0, r1), loc.dtype)
        lo = rng.start - loc.start - r0 * cols * item
        if len(data) < lo + (rng.end - rng.start):
            raise SourceChanged(f"{self.path_of(loc.file)}: short read of {loc.name!r}")
        return data[lo : lo + rng.end - rng.start]

