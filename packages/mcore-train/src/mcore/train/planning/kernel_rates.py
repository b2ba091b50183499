"""The calibration's kernel rates against the kernel benchmarks' raw JSON: GEMMs (bf16 and FP8) and attention.

- GEMMs: ``benchmarks/fp8.py``'s table of the Llama-3-8B linears (qkv, out_proj, gate_up, down at 8,192 tokens;
  forward, input-gradient and weight-gradient GEMM; bf16 ``mm`` and tensor-wise ``torch._scaled_mm``), every run
  under ``benchmarks/results`` that has one. A row is one linear's three GEMMs, what one layer's training step runs,
  averaged over the runs (the same GEMM differed by up to 15% between two runs of one day), against
  ``Calibration.gemm_seconds`` for the same shapes.
- Attention: ``benchmarks/attention.py``'s single-document case (SDPA, the backend mcore's step takes for one
  causal document) against the calibration's in-step rate at that length over ``IN_STEP_RATIO`` (the profiled
  training steps ran SDPA at 0.8 of its standalone rate; ``calibrations/h200-sxm.json`` says where from).
  Packed-document cases (documents x length): mcore's Triton kernel forward and backward apart against the
  calibration's ``packed_attention`` rates for that document length (the time model's rates for a layout with
  ``document_lengths``). The curve comes from the flash sweeps' default-tile timings; the rows checked are the
  attention benchmark's own timings of the same kernel (helpers-h200-2026-12-01-s3), a separate measurement in
  the same call. The 09:43 run's packed rows ran the kernel before its backward rework: listed, not checked.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from mcore.train.planning.calibration import Calibration

FP8_RUNS = ("*/quant/fp8/fp8.json", "*/*/quant/fp8/fp8.json", "low-precision-*/fp8.json")
ATTENTION_RUNS = ("attention-h200-*/attention.json", "*/flash/attention.json")
# runs of the packed-document kernel the calibration's packed_attention describes (after the backward rework);
# attention-h200-2026-12-01 (09:43) ran the kernel before it: its packed rows are listed, not checked
PACKED_KERNEL_RUNS = ("helpers-h200-2026-12-01-s3",)
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
    """Causal attention of each benchmark case against the calibration: one document (SDPA) forward + backward at
    the ``attention`` curve; packed documents (mcore's kernel, ``auto`` where measured) forward and backward apart
    at the ``packed_attention`` rates for their length. Packed rows are checked for the runs of the calibrated
    kernel (``PACKED_KERNEL_RUNS``); earlier runs of the kernel are listed with their error."""
    rows = []
    paths = sorted({p.resolve() for pattern in ATTENTION_RUNS for p in results.glob(pattern)})
    for path in paths:
        data = json.loads(path.read_text())
        run = path.parent.name if path.parent.name != "flash" else path.parent.parent.name
        for case in data.get("cases", []):
            if case.get("window") or "sinks" in case["case"] or case["d_qk"] != case["d_v"]:
                continue
            docs, length, dim = case["docs"], case["length"], case["d_qk"]
            causal_fwd = 2.0 * docs * length**2 * data["heads"] * 2 * dim / 2
            if docs == 1:
                rate = case["impls"].get("sdpa")
                if rate and "bwd_ms" in rate:
                    predicted = calibration.attention_seconds(causal_fwd * 3.5, length) * IN_STEP_RATIO
                    measured = rate["fwd_ms"] + rate["bwd_ms"]
                    name = f"attention {case['case']} fwd+bwd (sdpa, {run})"
                    rows.append(KernelRow(name, measured, 1e3 * predicted, 1))
                continue
            impl = "auto" if "auto" in case["impls"] else "ours"
            rate = case["impls"].get(impl)
            if not rate or "bwd_ms" not in rate:
                continue
            fwd, bwd = calibration.packed_attention_seconds(causal_fwd, length)
            for part, seconds in (("fwd", fwd), ("bwd", bwd)):
                name = f"attention {case['case']} {part} ({impl}, {run})"
                checked = run in PACKED_KERNEL_RUNS
                rows.append(KernelRow(name, rate[f"{part}_ms"], 1e3 * seconds * IN_STEP_RATIO, 1, checked=checked))
    return rows


CALIBRATE_RUNS = ("calibration-h200-*/h200-sxm-measured.json",)


def gemm_run_rates(results: Path, layer: str) -> list[tuple[str, str, tuple[int, int, int], str, float]]:
    """TFLOP/s of ``layer``'s three GEMMs in every fp8.py run, and of ``--calibrate``'s point of the same shape
    where its table has one: (GEMM, implementation, (m, n, k), run, TFLOP/s), to tell a shape's effect (the
    same shape slow in every run) from the spread between runs (the same shape apart by more than the error)."""
    out, seen = [], set()
    calibrated: dict[tuple[str, float], tuple[str, float]] = {}
    for path in sorted(p for pattern in CALIBRATE_RUNS for p in results.glob(pattern)):
        curves = json.loads(path.read_text())["gemm"]
        for precision in ("bf16", "fp8"):
            for flops, rate in curves.get(precision, []):
                calibrated[(precision, flops)] = (path.parent.name, rate)
    paths = sorted({p.resolve() for pattern in FP8_RUNS for p in results.glob(pattern)})
    for path in paths:
        data = json.loads(path.read_text())
        key = json.dumps(data.get("gemms"), sort_keys=True)
        if data.get("dry_run") or not data.get("gemms") or key in seen:
            continue
        seen.add(key)
        shapes = _gemm_shapes(*data["linear_shapes"][layer])
        run = str(path.parent.relative_to(results.resolve())).split("/quant")[0]
        for g in data["gemms"]:
            if g["layer"] == layer and g["impl"] in GEMM_IMPLS and g["gemm"] in shapes:
                shape = shapes[g["gemm"]]
                out.append((g["gemm"], GEMM_IMPLS[g["impl"]], shape, run, 2.0 * math.prod(shape) / (g["ms"] * 1e9)))
    for gemm, precision, shape, _, _ in list(out):
        hit = calibrated.get((precision, 2.0 * math.prod(shape)))
        # --calibrate's table holds (8192, 14336, 4096): the input-gradient GEMM of down
        if hit and shape == (8192, 14336, 4096):
            out.append((gemm, precision, shape, f"{hit[0]} (--calibrate)", hit[1]))
    return sorted(set(out), key=lambda r: (r[1], r[0], r[3]))
