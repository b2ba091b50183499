"""``mcore-bridge`` on damaged checkpoints and impossible destinations (issue #25): one line naming the file or
path, a non-zero exit, nothing written."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from mcore.bridge.cli import main
from mcore.bridge.convert import convert
from tests.bridge.factory import save_tiny_hf


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("damaged")
    hf = save_tiny_hf(root / "hf", "llama", seed=3, max_shard_size="100KB")
    convert(hf, root / "mcore", progress=False)
    return hf, root / "mcore"


def _one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mcore-bridge: error: "), err
    assert "Traceback" not in err
    return lines[0]


def test_inspect_reports_a_truncated_mcore_shard(dirs, tmp_path, capsys):
    damaged = tmp_path / "mcore"
    shutil.copytree(dirs[1], damaged)
    shard = damaged / "model" / "tp00-pp00.safetensors"
    shard.write_bytes(shard.read_bytes()[:-64])
    code = main(["inspect", str(damaged)])
    captured = capsys.readouterr()
    line = _one_error_line(captured.err)
    assert code != 0 and captured.out == ""  # no tensor table for a damaged checkpoint
    assert "damaged checkpoint" in line and "tp00-pp00.safetensors" in line and "truncated" in line


def test_inspect_reports_an_overwritten_mcore_header(dirs, tmp_path, capsys):
    damaged = tmp_path / "mcore"
    shutil.copytree(dirs[1], damaged)
    shard = damaged / "model" / "tp00-pp00.safetensors"
    data = bytearray(shard.read_bytes())
    data[8:16] = b"\x00" * 8  # the JSON header's first bytes
    shard.write_bytes(bytes(data))
    assert main(["inspect", str(damaged)]) != 0
    assert "corrupt safetensors header" in _one_error_line(capsys.readouterr().err)


def test_inspect_reports_a_truncated_hf_shard(dirs, tmp_path, capsys):
    damaged = tmp_path / "hf"
    shutil.copytree(dirs[0], damaged)
    shard = sorted(damaged.glob("*.safetensors"))[-1]
    shard.write_bytes(shard.read_bytes()[:-64])
    assert main(["inspect", str(damaged)]) != 0
    assert shard.name in _one_error_line(capsys.readouterr().err)


@pytest.fixture
def unwritable(tmp_path):
    """A directory nobody may write into: a 0o555 one, or (as root, who ignores permission bits) /sys/kernel."""
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        for candidate in (locked, Path("/sys/kernel")):
            try:
                (candidate / "mcore-probe").write_text("x")
            except OSError:
                yield candidate
                return
            (candidate / "mcore-probe").unlink()
        pytest.skip("no unwritable directory on this machine")
    finally:
        locked.chmod(0o755)


@pytest.mark.parametrize("where", ["unwritable", "below-a-file"])
def test_convert_to_an_impossible_destination_is_refused_before_reading(dirs, request, tmp_path, capsys, where):
    import mcore.bridge.convert as convert_module

    def refuse(*args, **kwargs):
        raise AssertionError("the conversion read its source before checking the destination")

    request.getfixturevalue("monkeypatch").setattr(convert_module, "resolve_source", refuse)
    if where == "unwritable":
        parent = request.getfixturevalue("unwritable")
    else:
        parent = tmp_path / "file.txt"
        parent.write_text("x")
    dst = parent / "out"
    code = main(["convert", str(dirs[0]), str(dst), "--no-progress"])
    line = _one_error_line(capsys.readouterr().err)
    assert code == 2 and f"destination {dst}" in line
    assert ("not writable" if where == "unwritable" else "is a file") in line
    assert not dst.exists()
    if parent.is_dir():
        assert not list(parent.glob(".out.tmp-*"))
