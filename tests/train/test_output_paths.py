"""Refused starts (issue #25): unwritable outputs, a broken ``checkpoints/latest``, a corrupt ``--load``,
``--nproc-per-node 0``. Each gives one line naming the path and exit code 2, before any work, writing nothing."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

import mcore.train.runtime
from mcore.train.checkpoint import CheckpointReader
from mcore.train.cli import main
from mcore.train.output_paths import CreatedDirs, output_dir_problem
from tests.train.tiny import TINY, train


def _writable(path: Path) -> bool:
    """Independent of the code under test: can a file really be created in ``path``?"""
    probe = path / "probe"
    try:
        probe.write_text("x")
    except OSError:
        return False
    probe.unlink()
    return True


@pytest.fixture
def unwritable(tmp_path):
    """A directory nobody may write into: a 0o555 one, or (as root, who ignores permission bits) /sys/kernel."""
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        if not _writable(locked):
            yield locked
            return
        fallback = Path("/sys/kernel")
        if not fallback.is_dir() or _writable(fallback):
            pytest.skip("no unwritable directory on this machine")
        yield fallback
    finally:
        locked.chmod(0o755)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A run of 4 steps with checkpoints at steps 2 and 4."""
    run_dir = tmp_path_factory.mktemp("paths") / "run"
    train(run_dir, "train.steps=4", "checkpoint.save_interval=2")
    return run_dir


@pytest.fixture
def no_work(monkeypatch):
    """Fail the test if the command gets as far as joining the job (i.e. before building anything)."""

    def refuse(*args, **kwargs):
        raise AssertionError("the command started work before refusing its output location")

    monkeypatch.setattr(mcore.train.runtime, "init_runtime", refuse)


def _tree(path: Path) -> dict[str, str]:
    return {
        str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
        for p in path.rglob("*")
    }


def _one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mcore-train: error: "), err
    assert "Traceback" not in err
    return lines[0]


def _main(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_run_dir_below_a_regular_file_is_refused_before_any_work(capsys, tmp_path, no_work):
    (tmp_path / "notes.txt").write_text("a file")
    code, _, err = _main(capsys, *TINY, f"log.run_dir={tmp_path / 'notes.txt' / 'run'}")
    line = _one_error_line(err)
    assert code == 2
    assert "log.run_dir" in line and "notes.txt is a file" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


@pytest.mark.parametrize("key", ["log.run_dir", "checkpoint.dir"])
def test_unwritable_output_directory_is_refused_before_any_work(capsys, tmp_path, unwritable, no_work, key):
    target = unwritable / "mcore-test-out"
    overrides = [f"log.run_dir={tmp_path / 'run'}"] if key == "checkpoint.dir" else []
    code, _, err = _main(capsys, *TINY, *overrides, f"{key}={target}")
    line = _one_error_line(err)
    assert code == 2
    assert f"{key} {target}" in line and "not writable" in line
    assert not target.exists() and not (tmp_path / "run").exists()


def test_output_dir_problem_leaves_nothing_behind(tmp_path):
    assert output_dir_problem(tmp_path / "a" / "b") is None
    assert output_dir_problem(tmp_path) is None
    assert list(tmp_path.iterdir()) == []  # the write probe is gone
    (tmp_path / "f").write_text("x")
    assert "is a file, not a directory" in output_dir_problem(tmp_path / "f")


def test_created_dirs_removes_only_what_it_made_and_only_when_empty(tmp_path):
    (tmp_path / "kept").mkdir()
    with pytest.raises(RuntimeError), CreatedDirs() as made:
        made.make(tmp_path / "kept" / "new" / "deeper")
        raise RuntimeError("failed start")
    assert [p.name for p in tmp_path.iterdir()] == ["kept"] and list((tmp_path / "kept").iterdir()) == []
    with CreatedDirs() as made:
        made.make(tmp_path / "ok")
    assert (tmp_path / "ok").is_dir()  # a successful block keeps its directories


def test_preprocess_into_an_unwritable_directory_is_refused(capsys, tmp_path, unwritable):
    source = tmp_path / "in.jsonl"
    source.write_text('{"text": "hello"}\n', encoding="utf-8")
    prefix = unwritable / "mcore-test-out" / "corpus"
    code, _, err = _main(capsys, "preprocess", "--input", str(source), "--output-prefix", str(prefix))
    line = _one_error_line(err)
    assert code == 2 and "--output-prefix" in line and str(prefix) in line and "not writable" in line
    assert not prefix.parent.exists()


def test_failed_preprocess_leaves_no_empty_output_folder(capsys, tmp_path):
    source = tmp_path / "in.jsonl"
    source.write_text('{"body": "no text key"}\n', encoding="utf-8")
    prefix = tmp_path / "out" / "sub" / "corpus"
    code, _, err = _main(capsys, "preprocess", "--input", str(source), "--output-prefix", str(prefix), "--no-progress")
    assert code == 2 and "no key 'text'" in _one_error_line(err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]


def _copy(trained: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(trained, copy)
    return copy


def test_latest_naming_a_missing_checkpoint_refuses_to_start_from_random_weights(capsys, tmp_path, trained):
    run = _copy(trained, tmp_path)
    shutil.rmtree(run / "checkpoints" / "iter_0000004")  # latest still names it
    before = _tree(run)
    code, out, err = _main(capsys, *TINY, "train.steps=8", f"log.run_dir={run}")
    line = _one_error_line(err)
    assert code == 2 and "random weights" not in out
    assert "iter_0000004, which does not exist" in line
    assert "complete checkpoints in" in line and "iter_0000002" in line  # what is there to resume from
    assert "log.run_dir=" in line  # the override that starts fresh on purpose
    assert _tree(run) == before


def test_the_launcher_refuses_a_broken_latest_before_starting_workers(capsys, tmp_path, trained, no_work):
    run = _copy(trained, tmp_path)
    shutil.rmtree(run / "checkpoints" / "iter_0000004")
    code, out, err = _main(capsys, "--nproc-per-node", "2", *TINY, "train.steps=8", f"log.run_dir={run}")
    assert code == 2 and "iter_0000004, which does not exist" in _one_error_line(err)
    assert "launching" not in out


@pytest.mark.parametrize(
    "damage,expected",
    [
        (lambda latest: latest.write_bytes(b"\xff\xfe\x00garbage"), "cannot be read"),
        (lambda latest: (latest.unlink(), latest.mkdir()), "cannot be read"),
        (lambda latest: latest.write_text("../../elsewhere\n"), "not a checkpoint name"),
    ],
    ids=["not-utf8", "a-directory", "not-a-name"],
)
def test_unreadable_latest_is_refused(capsys, tmp_path, trained, damage, expected):
    run = _copy(trained, tmp_path)
    damage(run / "checkpoints" / "latest")
    before = _tree(run)
    code, _, err = _main(capsys, *TINY, "train.steps=8", f"log.run_dir={run}")
    line = _one_error_line(err)
    assert code == 2 and expected in line and "iter_0000004" in line
    assert _tree(run) == before


def test_corrupt_load_checkpoint_leaves_no_empty_run_directory(capsys, tmp_path, trained):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(trained / "checkpoints" / "iter_0000004", ckpt)
    shard = ckpt / "model" / "tp00-pp00.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    run = tmp_path / "new-run"
    code, _, err = _main(capsys, *TINY, "train.steps=8", f"--load={ckpt}", f"log.run_dir={run}")
    assert code == 2 and "corrupt or truncated" in _one_error_line(err)
    assert not run.exists()


def test_the_documented_latest_path_is_accepted_as_a_checkpoint(capsys, trained):
    latest = trained / "checkpoints" / "latest"
    with CheckpointReader(latest) as reader:
        assert reader.path == trained / "checkpoints" / "iter_0000004"
    code, out, err = _main(capsys, "evaluate", "--load", str(latest), "train.eval_steps=1")
    assert code == 0, err
    assert json.loads(out.strip().splitlines()[-1])["iteration"] == 4


def test_nproc_per_node_zero_is_refused(capsys, tmp_path, no_work):
    code, _, err = _main(capsys, "--nproc-per-node", "0", *TINY, f"log.run_dir={tmp_path / 'run'}")
    line = _one_error_line(err)
    assert code == 2 and "--nproc-per-node must be >= 1, got 0" in line
    assert not (tmp_path / "run").exists()


def test_a_finished_run_releases_its_lock(capsys, tmp_path):
    code, _, err = _main(capsys, *TINY, "train.steps=2", f"log.run_dir={tmp_path / 'run'}")
    assert code == 0, err
    names = sorted(os.listdir(tmp_path / "run"))
    assert "checkpoints" in names and "mcore-run.lock" not in names
