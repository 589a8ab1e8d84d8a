"""The review of branch indexkernel, fixed (branch rev-index's tests, adopted): the output bound
``bound_output_tight`` is an upper bound on the measured ``||out(M_B) - out(M_full)||`` over
methods, output dtypes (float16 subnormal outputs included) and budgets, while ``bound_tight``
stays the bound before output rounding; gram_terms' working set does not scale with rows x
block; oversized chunks stay out of the reader's reused buffers; no O_DIRECT fd leaks when
fstat fails; index sidecars and pieces of another format or summation order are ignored."""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import yaml
from families import Family, _write_model, make_family, write_spec
from reference import read_tensor
from safetensors.numpy import load, save

from mergefs import cli
from mergefs.index import build as indexbuild, read as indexread
from mergefs.sources.base import Counters
from mergefs.sources.base import ReadRange
from mergefs.engine.session import Session
from mergefs.spec.load import load_spec


def _outputs(spec_path: Path, out: Path, names: list[str]) -> tuple[dict[str, np.ndarray], Any]:
    s = Session(load_spec(spec_path))
    try:
        s.engine.materialise(out)
        plan = s.plan
        totals = s.totals_record()
    finally:
        s.close()
    return {n: read_tensor(out, n).astype(np.float64) for n in names}, (plan, totals)


def _measure(tmp_path: Path, fam: Family, method: str, weights: list[float], out_dtype: str,
             budget: Any, tag: str, params: dict | None = None) -> tuple[float, Any, Any]:
    extra = {"block_size": 512, "index_dir": str(tmp_path / "idx"), "dtype": out_dtype}
    part = write_spec(tmp_path / f"{tag}b.yaml", fam, method, weights, params,
                      extra={**extra, "budget": budget})
    full = write_spec(tmp_path / f"{tag}f.yaml", fam, method, weights, params,
                      extra={**extra, "budget": "full"})
    got, (plan, totals) = _outputs(part, tmp_path / f"{tag}b", fam.tensor_names)
    want, (fplan, _) = _outputs(full, tmp_path / f"{tag}f", fam.tensor_names)
    measured = math.sqrt(sum(((got[n] - want[n]) ** 2).sum() for n in fam.tensor_names))
    assert fplan.bound_tight == fplan.bound_output_tight == 0.0
    return measured, plan, totals


@pytest.mark.parametrize("src_dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("out_dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("method,params", [("task_arithmetic", None),
                                           ("linear", {"normalize": False})])
@pytest.mark.parametrize("budget", [0, "30%"])
def test_bound_is_an_upper_bound(tmp_path: Path, src_dtype: str, out_dtype: str, method: str,
                                 params: dict | None, budget: Any) -> None:
    fam = make_family(tmp_path / "fam", n_experts=3, dtype=src_dtype, seed=3)  # type: ignore
    measured, plan, totals = _measure(tmp_path, fam, method, [0.5, -0.3, 0.9], out_dtype,
                                      budget, "a", params)
    assert plan.bound_tight is not None and plan.bound_output_tight is not None
    assert measured <= plan.bound_output_tight <= plan.bound_output_loose
    assert plan.bound_tight <= plan.bound_output_tight  # the rounding term only adds
    assert plan.bound_tight <= plan.bound_loose
    rep = plan.report()
    assert rep["bound_relative_to_update"] == pytest.approx(plan.bound_tight / plan.update_norm)
    for key in ("bound_tight", "bound_loose", "bound_output_tight", "bound_output_loose"):
        assert totals[key] == rep[key] == getattr(plan, key)  # engine stats (manifest totals)


def tiny_family(root: Path) -> Family:
    """fp32 weights around 1e-6 (subnormal in float16: below 2^-14 ~ 6.1e-5, spacing 2^-24),
    deltas ~2e-8 (a third of float16's subnormal spacing)."""
    rng = np.random.default_rng(1)
    shapes = {"a.weight": (64, 32), "b.weight": (64, 32)}
    base = {n: (rng.standard_normal(s) * 1e-6).astype(np.float32) for n, s in shapes.items()}
    ex = {n: (w + (rng.standard_normal(w.shape) * 2e-8).astype(np.float32))
          for n, w in base.items()}
    root.mkdir(parents=True)
    _write_model(root / "base", base, list(base), "single", "float32")
    _write_model(root / "expert-0", ex, list(ex), "single", "float32")
    return Family(root / "base", [root / "expert-0"], root, "float32", list(base))


@pytest.mark.parametrize("budget", [0, "50%"])
def test_bound_holds_for_float16_subnormal_outputs(tmp_path: Path, budget: Any) -> None:
    """float16's subnormal spacing is 2^-24: the relative term u (||M_B|| + ||M_full||) alone
    does not bound these blocks' rounding; the absolute term 2 eta sqrt(n_b) does."""
    fam = tiny_family(tmp_path / "fam")
    measured, plan, _ = _measure(tmp_path, fam, "task_arithmetic", [1.0], "float16", budget,
                                 "t")
    assert measured > 0
    assert measured <= plan.bound_output_tight, (measured, plan.bound_output_tight)
    assert plan.bound_output_tight < 10 * measured  # and not vacuous


def test_plan_cli_shows_both_bounds(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fam = make_family(tmp_path / "fam", n_experts=2, dtype="bfloat16", seed=4)
    spec = write_spec(tmp_path / "s.yaml", fam, "task_arithmetic", [0.5, 0.5],
                      extra={"block_size": 512, "index_dir": str(tmp_path / "idx"),
                             "budget": "30%"})
    assert cli.main(["plan", str(spec)]) == 0
    out = capsys.readouterr().out
    assert "before output rounding" in out and "of the output bytes" in out


# -- gram_terms and the reader: bounded memory ---------------------------------------------------

def test_gram_terms_memory_does_not_scale_with_rows_times_block() -> None:
    """With large blocks the working set was (experts + 1) x block x 4 bytes (88 MiB here);
    column tiles keep it near one tile per row."""
    import tracemalloc

    from mergefs.index.stats import gram_terms

    n, rows = 4 << 20, 4  # one 8 MiB bf16 block, four experts
    rng = np.random.default_rng(0)
    base = rng.standard_normal(n).astype(ml_dtypes.bfloat16)
    experts = [[(base.astype(np.float32) + np.float32(1e-3) * rng.standard_normal(n)
                 .astype(np.float32)).astype(ml_dtypes.bfloat16).tobytes()] for _ in range(rows)]
    pairs = [(i, j) for i in range(rows) for j in range(i, rows)]
    gram_terms([64], [base[:64].tobytes()], "BF16", [[e[0][:128]] for e in experts],
               ["BF16"] * rows, pairs)  # compile and warm the thread's scratch alone
    tracemalloc.start()
    try:
        gram_terms([n], [base.tobytes()], "BF16", experts, ["BF16"] * rows, pairs)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak <= 2 * n * 4, f"peak {peak >> 20} MiB for a {n * 2 >> 20} MiB block"


def test_oversized_chunks_stay_out_of_the_reader_buffers(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks above CHUNK_BYTES: the reader's reused buffers stay at about CHUNK_BYTES, and the
    index has the same bits as one built with a chunk size above the blocks."""
    from mergefs.sources import open_source
    from mergefs.index.blocks import load_or_build

    fam = make_family(tmp_path / "fam", n_experts=2, dtype="bfloat16", seed=6)
    srcs = [open_source(fam.base), *(open_source(p) for p in fam.experts)]
    try:
        want, _ = load_or_build(srcs[0], srcs[1:], 8192, tmp_path / "want")
        sizes: list[int] = []
        real = indexread.Reader._buffer

        def spy(self: Any, slot: int, size: int) -> memoryview:
            sizes.append(size)
            return real(self, slot, size)

        monkeypatch.setattr(indexread.Reader, "_buffer", spy)
        monkeypatch.setattr(indexbuild, "CHUNK_BYTES", 4096)  # every 8 KiB block is oversized
        got, _ = load_or_build(srcs[0], srcs[1:], 8192, tmp_path / "got")
    finally:
        for c in srcs:
            c.close()
    assert all(s <= 4096 + 2 * indexread.ALIGN for s in sizes), max(sizes)
    for name in ("norms", "gram", "base_norms", "zero", "expert_hash"):
        assert np.array_equal(np.asarray(getattr(got, name)), np.asarray(getattr(want, name)))


# -- the O_DIRECT fd ---------------------------------------------------------------------------

class _Src:
    def __init__(self, p: Path) -> None:
        self.p, self.fd, self.counters = p, os.open(p, os.O_RDONLY), Counters()

    def fds(self) -> dict[str, int]:
        return {"f": self.fd}

    def path_of(self, f: str) -> Path:
        return self.p


def _evict(p: Path) -> None:
    fd = os.open(p, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _open_fds() -> set[str]:
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.add(f"{fd} -> {os.readlink(f'/proc/self/fd/{fd}')}")
        except OSError:
            pass  # the listing's own, closed by now
    return out


def test_reader_fd_not_leaked_when_fstat_fails(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    p = tmp_path / "f.bin"
    p.write_bytes(b"x" * 10000)
    _evict(p)
    src, rd = _Src(p), indexbuild.Reader()
    real = os.fstat
    calls = []

    def failing(fd: int) -> os.stat_result:
        calls.append(fd)
        if len(calls) == 1:
            raise OSError(5, "Input/output error")
        return real(fd)

    before = _open_fds()
    monkeypatch.setattr(indexread.os, "fstat", failing)
    try:
        with pytest.raises(Exception, match="Input/output error"):
            rd.read(src, ReadRange("f", 0, 5000), 0)
    finally:
        monkeypatch.undo()
        rd.close()
    leaked = _open_fds() - before
    os.close(src.fd)
    assert calls and not leaked, f"fds left open: {leaked}"


# -- sidecars and pieces of another format or summation order ---------------------------------

def _rewrite_meta(path: Path, **changes: str | None) -> None:
    from mergefs.core import format as fmt

    data = path.read_bytes()
    meta = dict(fmt.parse_bytes(data).metadata or {})
    for k, v in changes.items():
        if v is None:
            meta.pop(k, None)
        else:
            meta[k] = v
    path.write_bytes(save(load(data), metadata=meta))


@pytest.mark.parametrize("change", [{"mergefs_sidecar_version": "1",
                                     "summation_order": None},  # as the old code wrote them
                                    {"summation_order": "pairwise"}])
def test_old_index_sidecars_are_ignored_naming_the_file(
        tmp_path: Path, change: dict[str, str | None],
        caplog: pytest.LogCaptureFixture) -> None:
    fam = make_family(tmp_path / "fam", n_experts=1, dtype="bfloat16", seed=8)
    doc = {"merge_method": "task_arithmetic", "base_model": str(fam.base),
           "models": [{"model": f"file://{fam.experts[0]}", "parameters": {"weight": 0.5}}],
           "block_size": 4096}
    pub = tmp_path / "pub.yaml"
    pub.write_text(yaml.safe_dump({**doc, "index_dir": str(tmp_path / "i1")}))
    assert cli.main(["index", str(pub), "--publish"]) == 0
    (path,) = fam.experts[0].glob("mergefs-index.*.safetensors")
    caplog.set_level(logging.INFO, logger="mergefs")
    use = tmp_path / "use.yaml"
    use.write_text(yaml.safe_dump({**doc, "index_dir": str(tmp_path / "i2")}))
    s = Session(load_spec(use))
    s.close()
    assert "1 of 1 experts from published sidecars" in caplog.text  # taken as is
    _rewrite_meta(path, **change)
    caplog.clear()
    use.write_text(yaml.safe_dump({**doc, "index_dir": str(tmp_path / "i3")}))
    s = Session(load_spec(use))
    s.close()
    assert "ignoring stale index sidecar" in caplog.text and path.name in caplog.text
    assert "republish" in caplog.text
    assert "1 of 1 experts from published sidecars" not in caplog.text  # read in full instead


def test_index_pieces_of_another_summation_order_are_rebuilt(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from mergefs.sources import open_source
    from mergefs.index.blocks import load_or_build
    from mergefs.index.build import BuildReport

    fam = make_family(tmp_path / "fam", n_experts=1, dtype="bfloat16", seed=9)
    srcs = [open_source(fam.base), open_source(fam.experts[0])]
    try:
        load_or_build(srcs[0], srcs[1:], 4096, tmp_path / "idx")
        pieces = sorted((tmp_path / "idx").rglob("*.safetensors"))
        assert pieces
        for p in pieces:
            _rewrite_meta(p, summation_order="pairwise")
        caplog.set_level(logging.INFO, logger="mergefs")
        report = BuildReport()
        _, built = load_or_build(srcs[0], srcs[1:], 4096, tmp_path / "idx", report=report)
    finally:
        for c in srcs:
            c.close()
    assert "summation order 'pairwise'" in caplog.text
    assert built and report.base_built and report.experts_built


def test_sweep_rows_carry_both_bounds(tmp_path: Path) -> None:
    from mergefs.plan.report import run_sweep

    fam = make_family(tmp_path / "fam", n_experts=2, dtype="bfloat16", seed=4)
    spec = write_spec(tmp_path / "s.yaml", fam, "task_arithmetic", [0.5, 0.5],
                      extra={"block_size": 512, "index_dir": str(tmp_path / "idx"),
                             "dtype": "bfloat16", "budget": "30%"})
    (row,) = run_sweep(spec, ["30%"], progress=False)
    s = Session(load_spec(spec))
    s.close()
    p = s.plan
    assert row.bound_tight == pytest.approx(p.bound_tight, rel=1e-12)
    assert row.bound_output_tight == pytest.approx(p.bound_output_tight, rel=1e-12)
    assert row.bound_output_tight > row.bound_tight  # bf16 output: the rounding term counts
    assert row.bound_share == pytest.approx(p.bound_tight / p.update_norm, rel=1e-12)
