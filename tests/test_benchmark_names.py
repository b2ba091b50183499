"""Benchmark scripts must not shadow installed packages.

A script runs with ``benchmarks/`` first on ``sys.path``, so a file named like a library's top-level module
replaces that library for every import inside the run. ``benchmarks/kernels.py`` did exactly that once
transformers began importing Hugging Face's ``kernels`` package: every HF model import in a benchmark failed.
"""

from __future__ import annotations

import importlib.metadata
import pathlib

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


def test_no_benchmark_script_shadows_an_installed_top_level_module():
    installed = importlib.metadata.packages_distributions()
    stems = sorted(p.stem for p in BENCHMARKS.glob("*.py"))
    assert stems, f"no scripts found under {BENCHMARKS}"
    clashes = {stem: installed[stem] for stem in stems if stem in installed}
    assert not clashes, f"rename these benchmarks/ scripts, they shadow installed packages: {clashes}"
