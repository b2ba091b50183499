"""``train_throughput.py``'s packed-documents variant and attention-backend choice: the CPU dry run end to end
(mcore-train's packed data path, two backends, the Hugging Face packed baseline on the same rows), and the pieces
(document lengths, rows, effective FLOPs, Hugging Face's packing check) against numbers computed here."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
TINY = {"hidden": 64, "layers": 2, "heads": 4, "kv": 2, "ffn": 176, "vocab": 300, "seq": 64, "mbs": 2}


@pytest.fixture(scope="module")
def bench():
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(BENCH))
        import hf_packed_baseline
        import packed_documents
        import train_throughput

        yield {"docs": packed_documents, "hf": hf_packed_baseline, "throughput": train_throughput}


@pytest.fixture(scope="module")
def packed_run(tmp_path_factory):
    out, runs = tmp_path_factory.mktemp("packed"), tmp_path_factory.mktemp("runs")
    args = ["--dry-run", "--variants", "packed", "--attention-backend", "auto,sdpa", "--warmup", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, str(BENCH / "train_throughput.py"), *args, "--json-dir", str(out), "--runs-dir", str(runs)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, runs


def _attention_flops_per_token_unit(s: dict[str, int]) -> int:
    """12 x layers x q_size: the attention FLOPs per token per unit of sequence length (hf_baseline.py's term)."""
    return 12 * s["layers"] * s["hidden"]


def test_dry_run_trains_on_packed_rows_with_each_backend_beside_hf(packed_run):
    out, runs = packed_run
    assert sorted(p.name for p in out.iterdir()) == ["summary.json", "throughput.log"]  # per-run JSON elsewhere
    assert sorted(p.name for p in runs.iterdir()) == [
        "hf_tiny-packed.json",
        "mcore-auto_tiny-packed.json",
        "mcore-sdpa_tiny-packed.json",
    ]
    names = ("mcore-auto", "mcore-sdpa", "hf")
    auto, sdpa, hf = (json.loads((runs / f"{n}_tiny-packed.json").read_text()) for n in names)
    # The backend asked for is the one the dispatcher used (on CPU, auto takes the reference for documents).
    assert auto["attention_backend"] == "auto" and sdpa["attention_backend"] == "sdpa"
    assert any("using the reference backend" in line for line in auto["attention_backends_used"])
    assert any("using the sdpa backend (requested" in line for line in sdpa["attention_backends_used"])
    # Same documents, same weights, fp32: the two backends train alike.
    assert max(abs(a - b) / abs(a) for a, b in zip(auto["losses"], sdpa["losses"])) < 1e-5
    assert auto["variant"] == "packed" and all(math.isfinite(x) for x in auto["losses"])
    # Rows hold several documents, and ours and Hugging Face's timed steps saw the same ones.
    assert auto["documents_per_row"] > 1 and 0 < auto["attention_work_vs_unpacked"] < 1
    for key in ("documents_per_row", "mean_segment_tokens", "attention_work_vs_unpacked"):
        assert hf[key] == pytest.approx(auto[key], rel=1e-12), key
    # Effective FLOPs: the attention term scaled by sum n_i^2 / s^2 (the matmul term unchanged).
    unit, s = _attention_flops_per_token_unit(TINY), TINY["seq"]
    matmul = auto["flops_per_token_unpacked"] - unit * s
    assert auto["flops_per_token"] == pytest.approx(matmul + unit * s * auto["attention_work_vs_unpacked"], rel=1e-12)
    assert auto["tflops_per_gpu"] == pytest.approx(auto["flops_per_token"] * auto["tokens_per_s"] / 1e12, rel=1e-12)
    assert auto["mfu"] == pytest.approx(auto["tflops_per_gpu"] * 1e12 / 989.4e12, rel=1e-12)
    assert hf["impl"] == "hf-transformers-packed" and hf["tokens_per_s"] > 0 and "unsupported" not in hf

    summary = json.loads((out / "summary.json").read_text())
    entry = summary["shapes"]["tiny-packed"]
    assert summary["failures"] == [] and "not the cited" in entry["document_lengths"]  # 4990 x 64 / 4096
    assert entry["results"]["mcore-sdpa"] == sdpa and entry["results"]["hf"] == hf
    r = entry["ratios_by_impl"]["mcore-sdpa"]["tokens_per_s_vs_hf"]
    assert r == pytest.approx(sdpa["tokens_per_s"] / hf["tokens_per_s"])
    assert entry["ratios"] == entry["ratios_by_impl"]["mcore-auto"]
    assert "docs/row" in summary["markdown"] and "tiny-packed mcore-sdpa:" in summary["markdown"]
    assert "| tiny-packed | mcore-dryrun [sdpa] |" in summary["markdown"]


def test_segments_and_effective_flops_of_hand_made_rows(bench):
    docs = bench["docs"]
    pos = np.array([[0, 1, 2, 0, 1, 0, 1, 2], [0, 1, 2, 3, 4, 5, 6, 7], [3, 4, 0, 1, 2, 3, 0, 1]])
    pos[2, :2] = [0, 1]  # a row continuing a document starts at 0 too (build_sample's layout)
    assert docs.segment_lengths(pos) == [[3, 2, 3], [8], [2, 4, 2]]
    with pytest.raises(ValueError, match="start every row at 0"):
        docs.segment_lengths(np.array([[1, 2, 0, 1]]))

    def f(n):  # 6 W + 12 L q n with W = 100, 12 L q = 10
        return 600.0 + 10.0 * n

    assert docs.row_flops([8], f) == 8 * f(8)  # one document: the standard count
    rec = docs.packed_record(pos, 1, range(1, 4), f, tokens_per_s=1000.0, peak_flops=1e6)
    squares = 9 + 4 + 9 + 64 + 4 + 16 + 4
    assert rec["flops_per_token"] == pytest.approx(600.0 + 10.0 * squares / 24)
    assert rec["attention_work_vs_unpacked"] == pytest.approx(squares / (3 * 64))
    assert rec["documents_per_row"] == pytest.approx(7 / 3) and rec["mean_segment_tokens"] == pytest.approx(24 / 7)
    assert rec["mfu"] == pytest.approx(rec["flops_per_token"] * 1000.0 / 1e6)
    assert docs.packed_record(pos, 1, range(2, 3), f, 1.0, 1.0)["attention_work_vs_unpacked"] == 1.0  # step 2 only
    with pytest.raises(ValueError, match="missing"):
        docs.packed_record(pos, 2, range(1, 3), f, 1.0, 1.0)


def test_lengths_from_a_file_an_index_or_the_cited_log_normal(bench, tmp_path):
    docs = bench["docs"]
    (tmp_path / "lengths.txt").write_text("5\n0\n17\n")
    source = docs.LengthSource(path=tmp_path / "lengths.txt")
    drawn = source.draw(seed=3, total=200)
    assert set(drawn) <= {5, 17} and sum(drawn) >= 200 and sum(drawn) - max(drawn) < 200
    assert source.draw(seed=3, total=200) == drawn  # seeded
    docs.write_corpus(tmp_path / "corpus", [4, 9, 2], vocab_size=300, seed=0)
    assert sorted(docs.read_lengths(tmp_path / "corpus")) == [2, 4, 9]  # a .bin/.idx prefix's documents
    (tmp_path / "bad.txt").write_text("5\nx\n")
    with pytest.raises(ValueError, match="one integer document length per line"):
        docs.read_lengths(tmp_path / "bad.txt")
    with pytest.raises(ValueError, match="neither a lengths file nor the prefix"):
        docs.read_lengths(tmp_path / "missing")
    cited = docs.LengthSource()
    assert cited.mean == 4990 and "FinePDFs-Edu" in cited.describe()
    lengths = cited.draw(seed=0, total=2_000_000)
    assert all(n % 16 == 0 and n >= 16 for n in lengths)
    assert 0.8 * 4990 < sum(lengths) / len(lengths) < 1.2 * 4990  # the cited mean (a long tail: loose)


def test_rows_come_through_mcore_trains_packed_data_path(bench, tmp_path):
    docs, tt = bench["docs"], bench["throughput"]
    docs.write_corpus(tmp_path / "corpus", [5] * 40, vocab_size=300, seed=1)
    spec = tt.build_spec("tiny", iters=1, warmup=0, dry_run=True, corpus=tmp_path / "corpus")
    assert spec.name == "mcore_tiny-packed" and "data.packing=true" in spec.overrides
    config = tt.check_spec(spec)
    rows = docs.run_rows(config, 4)
    assert rows["tokens"].shape == (4, 64) and rows["tokens"].max() < 300
    for segments in docs.segment_lengths(rows["position_ids"]):
        assert sum(segments) == 64 and max(segments) <= 5 and all(n == 5 for n in segments[1:-1])


def test_hf_baseline_refuses_to_time_when_its_packing_does_not_separate_documents(bench, tmp_path, monkeypatch):
    import transformers.masking_utils as masking

    hf = bench["hf"]
    monkeypatch.setattr(masking, "find_packed_sequence_indices", lambda position_ids: None)
    argv = ["--shape", "tiny", "--dry-run", "--rows", str(tmp_path / "absent.npz"), "--json", str(tmp_path / "hf.json")]
    assert hf.main(argv) == 0
    record = json.loads((tmp_path / "hf.json").read_text())
    assert "do not separate documents" in record["unsupported"] and "tokens_per_s" not in record
    summary = {"shapes": {"tiny-packed": {"results": {"hf": record}, "ratios": bench["throughput"].ratios({})}}}
    assert "unsupported: position_ids restarts" in bench["throughput"].render(summary)


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--attention-backend", "flash"], "--attention-backend: 'flash' is not a comma-separated list"),
        (["--variants", "packed,packed"], "--variants"),
        (["--shape", "all,1b"], "'all' stands alone"),
        (["--doc-lengths", "x.txt", "--doc-sigma", "1.0"], "--doc-lengths draws from a file"),
        (["--doc-mean", "4"], "mean must be >= 16"),
    ],
)
def test_bad_options_name_themselves(bench, argv, match, capsys):
    with pytest.raises(SystemExit):
        bench["throughput"].parse_args(argv)
    assert match in capsys.readouterr().err


@pytest.mark.gpu
def test_gpu_hf_packing_separates_documents_on_cuda(bench):
    """Whether the device's transformers takes packed documents with SDPA (else the packed baseline reports none)."""
    import torch

    assert bench["hf"].packing_problem(torch.device("cuda")) is None
