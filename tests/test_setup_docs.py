"""What a new user copies first (issue #25): the README's install commands, ``nox -s demo``'s dependencies and
the throughput label of a CPU run."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from mcore.train.metrics import format_train_line

ROOT = Path(__file__).resolve().parents[1]
TEST_ONLY = {"pytest", "pytest-timeout", "transformers", "megatron-core", "matplotlib"}


def _pip_install_commands(text: str) -> list[list[str]]:
    """The ``pip install`` commands of the bash blocks of a Markdown text, continuation lines joined."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line.split("#", 1)[0]) if line.strip() else []
            if "install" in words and any(w.endswith("pip") for w in words):
                commands.append(words)
    return commands


@pytest.mark.parametrize("doc", ["README.md", "CONTRIBUTING.md"])
def test_editable_installs_give_each_package_its_own_flag(doc):
    commands = _pip_install_commands((ROOT / doc).read_text(encoding="utf-8"))
    editable = [c for c in commands if "-e" in c]
    assert editable, f"{doc} shows no editable install"
    for words in editable:
        for i, word in enumerate(words):
            if word.startswith("packages/"):
                assert "*" not in word, f"{doc}: a glob after -e makes only its first match editable: {word}"
                assert words[i - 1] == "-e", f"{doc}: {word} is installed without its own -e"
    # torch comes first and from the CPU index, else pip brings the multi-GB CUDA build to a CPU machine
    first_torch = next(c for c in commands if any(w.startswith("torch") for w in c))
    assert commands.index(first_torch) < commands.index(editable[0])
    assert "https://download.pytorch.org/whl/cpu" in first_torch


class _Session:
    """Records what a nox session installs and runs."""

    posargs: list[str] = []

    def __init__(self) -> None:
        self.installed: list[str] = []

    def install(self, *args: str) -> None:
        self.installed += args

    def run(self, *args: str, **kwargs: object) -> None:
        pass


def _run_session(noxfile_session, session: _Session) -> None:
    getattr(noxfile_session, "func", noxfile_session)(session)  # nox wraps each session function


def test_nox_demo_installs_no_test_only_dependency():
    noxfile = pytest.importorskip("noxfile", reason="nox is not installed")
    session = _Session()
    _run_session(noxfile.demo, session)
    names = {re.split(r"[<>=\[ ]", arg)[0] for arg in session.installed}
    assert not names & TEST_ONLY, names & TEST_ONLY
    assert any(arg.endswith("packages/mcore-train") for arg in session.installed)
    tests_session = _Session()
    _run_session(noxfile.tests, tests_session)
    assert {"pytest>=8", "transformers"} <= set(tests_session.installed)  # the test sessions keep theirs


@pytest.mark.parametrize("device,label", [("cpu", "TFLOP/s/rank"), ("cuda", "TFLOP/s/gpu")])
def test_throughput_label_names_what_it_is_per(device, label):
    record = {"step": 3, "loss": 2.5, "lr": 1e-3, "tflops_per_gpu": 0.01, "device": device}
    line = format_train_line(record, 10)
    assert label in line and ("gpu" not in line if device == "cpu" else True)
