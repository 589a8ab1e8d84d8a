"""Reliability of the engine without a mount: full disks, changed sources, torn manifests,
paths a spec must not be able to clobber."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from families import forget_ctimes, make_family, write_spec
from mergefs.cli import main as cli_main
from mergefs.engine.session import Session
from mergefs.core.errors import ManifestError, MergefsError, SourceChanged
from mergefs.engine.manifest import ManifestWriter, read_manifest
from mergefs.engine.replay import replay
from mergefs.spec.load import load_spec


@pytest.fixture()
def family(tmp_path: Path):
    fam = make_family(tmp_path / "fam", n_experts=2, dtype="float32")
    spec = write_spec(tmp_path / "spec.yaml", fam, "task_arithmetic",
                      extra={"block_size": "512B", "index_dir": str(tmp_path / "idx")})
    return fam, spec


def _flip_data_byte(model_dir: Path) -> Path:
    """Change one byte of tensor data in place, keeping size; returns the file."""
    path = model_dir / "model.safetensors"
    raw = bytearray(path.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    # flip a byte near the end of the data (inside some float tensor), keep mtime changing
    pos = 8 + n + (len(raw) - 8 - n) // 2
    raw[pos] ^= 0x40
    path.write_bytes(bytes(raw))
    return path


def test_source_modified_after_indexing_is_refused(family, tmp_path: Path) -> None:
    """Same size, same header, mtime put back: the identity matches, the index is reused, and
    only the per-block hash check can notice. The merge must refuse and write nothing final."""
    fam, spec_path = family
    spec = load_spec(spec_path)
    Session(spec).close()  # build the index
    path = fam.experts[1] / "model.safetensors"
    st = os.stat(path)
    _flip_data_byte(fam.experts[1])
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    _forget_ctimes(tmp_path / "idx")  # else the moved ctime rebuilds the index (next test)
    out = tmp_path / "out"
    s = Session(spec)
    try:
        assert not s.index_built
        with pytest.raises(SourceChanged, match="expert-1"):
            s.engine.materialise(out)
        assert not list(out.glob("*.safetensors")), "no merged file under its final name"
        assert not list(out.glob(".*.partial"))
    finally:
        s.close()


def _forget_ctimes(index_dir: Path) -> None:
    """Make the stored index look as if written without ctimes: only identities are checked."""
    forget_ctimes(index_dir)


def test_source_rewritten_with_identity_kept_rebuilds_the_index(family, tmp_path: Path,
                                                                 caplog) -> None:
    """Same size, header and mtime: the status-change time still moved, so the index is rebuilt
    (saying why) and the merge holds the new bytes, bit for bit as a fresh index gives."""
    fam, spec_path = family
    spec = load_spec(spec_path)
    Session(spec).close()
    path = fam.experts[1] / "model.safetensors"
    st = os.stat(path)
    _flip_data_byte(fam.experts[1])
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    caplog.set_level("INFO", logger="mergefs")
    s = Session(spec)
    try:
        assert s.index_built
        assert f"{path} was modified since the last index" in caplog.text
        s.engine.materialise(tmp_path / "out")
    finally:
        s.close()
    shutil.rmtree(tmp_path / "idx")
    fresh = Session(spec)
    try:
        fresh.engine.materialise(tmp_path / "fresh")
    finally:
        fresh.close()
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == \
        (tmp_path / "fresh" / "model.safetensors").read_bytes()


def test_hash_check_catches_change_invisible_to_identity(family, tmp_path: Path) -> None:
    fam, spec_path = family
    spec = load_spec(spec_path)
    s = Session(spec)
    try:
        changed = _flip_data_byte(fam.experts[0])
        out = tmp_path / "out"
        # The session's checkpoints were opened before the change: identity still matches,
        # only the per-block hash can notice.
        with pytest.raises(SourceChanged, match=str(changed.parent.name)):
            s.engine.materialise(out)
        assert not list(out.glob("*.safetensors"))
    finally:
        s.close()


def test_full_disk_leaves_no_final_output(family, tmp_path: Path) -> None:
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("needs root to mount a small tmpfs")
    fam, spec_path = family
    small = tmp_path / "small"
    small.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24k", "tmpfs", str(small)],
                         capture_output=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount tmpfs: {res.stderr.decode().strip()}")
    try:
        spec = load_spec(spec_path)
        s = Session(spec)
        try:
            with pytest.raises(MergefsError, match="No space left"):
                s.engine.materialise(small / "out")
        finally:
            s.close()
        left = [p.name for p in (small / "out").iterdir()] if (small / "out").exists() else []
        assert not [n for n in left if n.endswith(".safetensors")], left
        assert not [n for n in left if n.endswith(".partial")], left
    finally:
        subprocess.run(["umount", "-l", str(small)], check=False)


def test_torn_manifest_line_is_ignored_and_reported(family, tmp_path: Path, caplog) -> None:
    fam, spec_path = family
    out = tmp_path / "out"
    assert cli_main(["merge", str(spec_path), str(out), "--manifest",
                     str(tmp_path / "m.jsonl")]) == 0
    manifest = tmp_path / "m.jsonl"
    with open(manifest, "a") as f:
        f.write('{"type": "read", "source": "base", "fi')  # a write cut short by kill -9
    contents = read_manifest(manifest)
    assert contents.torn_lines == 1
    res = replay(manifest)
    assert res.torn_lines == 1
    assert res.outputs_verified == len(contents.outputs) > 0


def test_truncated_manifest_without_totals_is_refused(family, tmp_path: Path) -> None:
    fam, spec_path = family
    manifest = tmp_path / "m.jsonl"
    assert cli_main(["merge", str(spec_path), str(tmp_path / "out"), "--manifest",
                     str(manifest)]) == 0
    lines = manifest.read_text().splitlines(keepends=True)
    assert json.loads(lines[-1])["type"] == "totals"
    manifest.write_text("".join(lines[:-1]))  # as if killed before the totals record
    assert read_manifest(manifest).totals is None
    with pytest.raises(ManifestError, match="no totals record: the run that wrote it was "
                                            "interrupted"):
        replay(manifest)  # an interrupted run never replays as OK


def test_manifest_never_clobbers_foreign_files(tmp_path: Path) -> None:
    victim = tmp_path / "important.txt"
    victim.write_text("do not overwrite\n")
    with pytest.raises(ManifestError, match="not a mergefs manifest"):
        ManifestWriter(victim)
    assert victim.read_text() == "do not overwrite\n"


def test_spec_manifest_pointing_at_foreign_file_is_refused(family, tmp_path: Path,
                                                           capsys) -> None:
    fam, spec_path = family
    victim = tmp_path / "notes.jsonl"
    victim.write_text('{"mine": true}\n')
    text = spec_path.read_text() + f"manifest: {victim}\n"
    spec_path.write_text(text)
    assert cli_main(["merge", str(spec_path), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "not a mergefs manifest" in err and err.count("\n") == 1
    assert victim.read_text() == '{"mine": true}\n'


def test_replay_refuses_changed_source_before_writing(family, tmp_path: Path) -> None:
    fam, spec_path = family
    manifest = tmp_path / "m.jsonl"
    assert cli_main(["merge", str(spec_path), str(tmp_path / "out"), "--manifest",
                     str(manifest)]) == 0
    changed = _flip_data_byte(fam.experts[0])
    with pytest.raises(SourceChanged, match=str(changed.parent)):
        replay(manifest, tmp_path / "again")
    assert not list((tmp_path / "again").glob("*.safetensors"))
