"""docs/scaling.md is what benchmarks/planner_report.py writes from the code and the committed results."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _report_module():
    spec = importlib.util.spec_from_file_location("planner_report", ROOT / "benchmarks" / "planner_report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _section(text: str, title: str) -> str:
    return text.split(title, 1)[1].split("\n## ", 1)[0]


def test_report_renders_and_the_committed_doc_is_current(tmp_path):
    assert _report_module().main(["--quick", "--out", str(tmp_path)]) == 0
    fresh = (tmp_path / "scaling.md").read_text()
    assert "{{" not in fresh and (tmp_path / "scaling" / "megatron_mfu.png").stat().st_size > 10_000
    committed = (ROOT / "docs" / "scaling.md").read_text()
    for title in ("## 1. Against our measurements", "## 2. Against Megatron-Core's published"):
        assert _section(fresh, title) == _section(committed, title), f"docs/scaling.md is stale: rerun {title}"
    for png in ("measured_vs_predicted", "megatron_mfu", "llama3_70b_layouts", "deepseek_v3_layouts"):
        assert (ROOT / "docs" / "scaling" / f"{png}.png").exists()
