"""The calibration's kernel rates against the kernel benchmarks' raw JSON: GEMMs (bf16 and FP8) and attention.

- GEMMs: ``benchmarks/fp8.py``'s table of the Llama-3-8B linears (qkv, out_proj, gate_up, down at 8,192 tokens;
  forward, input-gradient and weight-gradient GEMM; bf16 ``mm`` and tensor-wise ``torch._scaled_mm``), every run
  under ``benchmarks/results`` that has one. A row is one linear's three GEMMs, what one layer's training step runs,
  averaged over the runs (the same GEMM differed by up to 15% between two runs of one day), against
  ``Calibration.gemm_seconds`` for the same shapes.
- Attention: ``benchmarks/attention.py``'s single-document case (SDPA, the backend mcore's step takes for one
  causal document) against the calibration's in-step rate at that length over ``IN_STEP_RATIO`` (the profiled
  training steps ran SDPA at 0.8 of its standalone rate; ``calibrations/h200-sxm.json`` says where from).
  Packed-document cases are listed with the rate the calibration assumes, not checked: the step's time model
  takes one document per sequence, and the Triton kernel that runs packed documents is being rewritten.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from mcore.train.planning.calibration import Calibration

FP8_RUNS = ("*/quant/fp8/fp8.json", "*/*/quant/fp8/fp8.json", "low-precision-*/fp8.json")
ATTENTION_RUNS = ("attention-h200-*/attention.json",)
GEMM_IMPLS = {"bf16": "bf16", "tensorwise": "fp8"}
IN_STEP_RATIO = 0.8


@dataclass(frozen=True)
class KernelRow:
    """One kernel case: measured and predicted milliseconds (``checked``: within the validation's 10%)."""

    name: str
    measured_ms: float
    predicted_ms: float
    runs: int
    checked: bool = True

    @property
    def error(self) -> float:
        return self.predicted_ms / self.measured_ms - 1


def _gemm_shapes(m: int, n: int, k: int) -> dict[str, tuple[int, int, int]]:
    """fp8.py's (tokens, out, in) linear as its three GEMMs (rows, columns, inner)."""
    return {"fwd": (m, n, k), "dgrad": (m, k, n), "wgrad": (n, k, m)}


def gemm_rows(results: Path, calibration: Calibration) -> list[KernelRow]:
    """Per linear and implementation: the three GEMMs' measured milliseconds (mean over runs) and predicted."""
    measured: dict[tuple[str, str], list[float]] = {}
    shapes: dict[str, tuple[int, int, int]] = {}
    paths = sorted({p.resolve() for pattern in FP8_RUNS for p in results.glob(pattern)})
    seen_runs = set()
    for path in paths:
        data = json.loads(path.read_text())
        if data.get("dry_run") or not data.get("gemms"):
            continue
        key = json.dumps(data["gemms"], sort_keys=True)
        if key in seen_runs:  # the same run copied under two directories
            continue
        seen_runs.add(key)
        shapes.update({name: tuple(s) for name, s in data["linear_shapes"].items()})
        per_run: dict[tuple[str, str], float] = {}
        for g in data["gemms"]:
            if g["impl"] in GEMM_IMPLS and g["gemm"] in ("fwd", "dgrad", "wgrad"):
                per_run[(g["layer"], g["impl"])] = per_run.get((g["layer"], g["impl"]), 0.0) + g["ms"]
        for k, v in per_run.items():
            measured.setdefault(k, []).append(v)
    rows = []
    for (layer, impl), times in sorted(measured.items()):
        precision = GEMM_IMPLS[impl]
        predicted = sum(calibration.gemm_seconds(*s, precision) for s in _gemm_shapes(*shapes[layer]).values())
        name = f"{layer} {list(shapes[layer])} fwd+dgrad+wgrad, {impl}"
        rows.append(KernelRow(name, sum(times) / len(times), 1e3 * predicted, len(times)))
    return rows


def attention_rows(results: Path, calibration: Calibration) -> list[KernelRow]:
    """Causal forward + backward of each attention benchmark case (SDPA for one document, else mcore's Triton
    kernel as measured) against the calibration's rate for its document length."""
    rows = []
    for path in sorted(p for pattern in ATTENTION_RUNS for p in results.glob(pattern)):
        data = json.loads(path.read_text())
        heads = data["heads"]
        for case in data["cases"]:
            if case.get("window") or "sinks" in case["case"] or case["d_qk"] != case["d_v"]:
                continue
            impl = "sdpa" if case["docs"] == 1 else "ours"
            rate = case["impls"].get(impl)
            if not rate or "bwd_ms" not in rate:
                continue
            docs, length, dim = case["docs"], case["length"], case["d_qk"]
            causal_fwd = 2.0 * docs * length**2 * heads * 2 * dim / 2
            total = causal_fwd * 3.5  # backward 2.5x the forward, as the time model counts it
            predicted = calibration.attention_seconds(total, length) * IN_STEP_RATIO
            rows.append(
                KernelRow(
                    f"attention {case['case']} ({impl}, {path.parent.name})",
                    rate["fwd_ms"] + rate["bwd_ms"],
                    1e3 * predicted,
                    1,
                    checked=docs == 1,
                )  # fmt: skip
            )
    return rows
