"""mergefs's cut of the output into shards against mergekit's TensorWriter, in-process."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("mergekit")

from mergekit.io.tensor_writer import TensorWriter
from safetensors import safe_open

from mergefs.engine.layout import mergekit_shards

#: (tensor sizes in float32 elements, in write order; shard size in bytes)
CASES = [
    ([0, 10], 20),        # an empty tensor opens a shard: the next one does not join it
    ([5, 5, 5], 40),      # exact boundary: 20 + 20 = 40 stays in one shard
    ([5, 20, 1], 40),     # a tensor larger than a shard: alone in its own
    ([0, 0, 3], 8),
    ([3, 3], 0),          # <= 0: one file
]


@pytest.mark.parametrize(("sizes", "shard_bytes"), CASES)
def test_shards_are_mergekits(tmp_path: Path, sizes: list[int], shard_bytes: int) -> None:
    tensors = {f"t{k}": torch.zeros(n) for k, n in enumerate(sizes)}
    writer = TensorWriter(str(tmp_path), max_shard_size=shard_bytes)
    for name in sorted(tensors):
        writer.save_tensor(name, tensors[name])
    writer.finalize()
    files, index = mergekit_shards({n: ("F32", tuple(t.shape), None)
                                    for n, t in tensors.items()}, shard_bytes)
    ours = {f.name: sorted(t.name for t in f.tensors) for f in files}
    theirs = {n: sorted(torch_keys(tmp_path / n)) for n in os.listdir(tmp_path)
              if n.endswith(".safetensors")}
    assert ours == theirs
    assert (index is None) == (len(theirs) == 1)


def torch_keys(path: Path) -> list[str]:
    with safe_open(path, "pt") as f:
        return list(f.keys())
