"""What one GPU model does, measured: GEMM, attention and copy rates, NVLink collective curves, host overhead.

A calibration is a JSON file (``mcore-train plan --calibrate`` writes one on the GPU at hand; see
``measure.py``). Two ship with mcore in ``calibrations/``: ``h200-sxm`` (built from the H200 numbers in
``docs/performance.md`` and DESIGN.md section 5) and ``h100-sxm`` (derived from it by datasheet ratios; its
``assumptions`` say which). Curves are lists of ``[x, rate]`` points, interpolated log-log and held flat beyond
their ends.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from mcore.train.errors import UserError

CALIBRATION_DIR = Path(__file__).parent / "calibrations"
BACKWARD_ATTENTION_RATIO = 2.5  # flash backward: dQ, dK, dV and the recomputed scores, 2.5x the forward's FLOPs
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")


def interpolate(points: Sequence[Sequence[float]], x: float) -> float:
    """Log-log interpolation of ``points`` (``[[x, y], ...]``, x increasing) at ``x``; flat beyond the ends."""
    if not points:
        raise ValueError("cannot interpolate an empty curve")
    if x <= points[0][0]:
        return float(points[0][1])
    for (x0, y0), (x1, y1) in zip(points, points[1:], strict=False):
        if x <= x1:
            t = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
            return float(math.exp(math.log(y0) + t * (math.log(y1) - math.log(y0))))
    return float(points[-1][1])


def _check_curve(name: str, points: Sequence[Sequence[float]]) -> None:
    if not points or any(len(p) != 2 or p[0] <= 0 or p[1] <= 0 for p in points):
        raise ValueError(f"calibration curve {name} must be a non-empty list of [x > 0, rate > 0], got {points!r}")
    if any(a[0] >= b[0] for a, b in zip(points, points[1:], strict=False)):
        raise ValueError(f"calibration curve {name} must have increasing x, got {[p[0] for p in points]}")


@dataclass(frozen=True)
class Calibration:
    """Rates of one GPU model (see the module docstring; units in the field names).

    ``gemm``: precision -> achieved TFLOP/s by the FLOPs of one GEMM (``2 m n k``). ``wgrad_fp32_slowdown``: the
    weight-gradient GEMM writing fp32 into the gradient buffer (gradient-accumulation fusion) takes this factor
    longer. ``attention``: document length -> achieved TFLOP/s of causal attention forward + backward (FLOPs of the
    unmasked half). ``memory_bound_efficiency``: share of ``copy_gbps`` that norms, activations, RoPE and casts
    reach; ``optimizer_efficiency``: the share the fused AdamW pass reaches. ``host_ms_per_layer``: GPU idle per
    layer and micro-batch while the host launches kernels; ``host_ms_per_step``: the same, once per step.
    ``nvlink``: collective -> bus bandwidth (GB/s) by message bytes inside one node. ``sm_count``: streaming
    multiprocessors (what communication kernels beside a GEMM take a share of; 132 on H100 / H200 SXM).
    ``reduce_overlap_slowdown``: seconds the compute beside an overlapped gradient reduction (all-reduce /
    reduce-scatter: NCCL kernels that read, add and write on the GPU's SMs and HBM) loses per second of that
    collective (all-gathers measured no such loss).
    """

    name: str
    memory_gb: float
    peak_tflops: dict[str, float]
    gemm: dict[str, list[list[float]]]
    attention: list[list[float]]
    copy_gbps: float
    nvlink: dict[str, list[list[float]]]
    wgrad_fp32_slowdown: float = 1.0
    memory_bound_efficiency: float = 0.85
    optimizer_efficiency: float = 0.85
    host_ms_per_layer: float = 0.0
    host_ms_per_step: float = 0.0
    nvlink_latency_us: float = 10.0
    pcie_gbps: float = 50.0
    cpu_adam_gparams_per_s: float = 1.0
    sm_count: int = 132
    reduce_overlap_slowdown: float = 0.0
    grouped_gemm: list[list[float]] = field(default_factory=lambda: [[1.0, 1.0]])
    moe_dispatch_gbps: float | None = None
    ssd_tflops: list[float] | None = None  # Mamba-2's chunked scan, [forward, backward] (planning/mamba_terms.py)
    conv_gbps: list[float] | None = None  # Mamba-2's depthwise causal conv, [forward, backward]
    # packed documents (cu_seqlens): [[document length, forward TFLOP/s, backward TFLOP/s], ...] in-step rates of
    # the kernel that runs them (mcore's Triton flash attention); None: the one-document ``attention`` curve
    packed_attention: list[list[float]] | None = None
    source: str = ""
    assumptions: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not 0 <= self.reduce_overlap_slowdown < 1:
            raise ValueError(
                f"calibration {self.name}: reduce_overlap_slowdown must lie in [0, 1), "
                f"got {self.reduce_overlap_slowdown}"
            )
        _check_curve("grouped_gemm", self.grouped_gemm)
        if self.moe_dispatch_gbps is not None and self.moe_dispatch_gbps <= 0:
            raise ValueError(f"calibration {self.name}: moe_dispatch_gbps must be > 0, got {self.moe_dispatch_gbps}")
        for name in ("ssd_tflops", "conv_gbps"):
            rates = getattr(self, name)
            if rates is not None and (len(rates) != 2 or min(rates) <= 0):
                raise ValueError(f"calibration {self.name}: {name} must be [forward > 0, backward > 0], got {rates}")
        if not 0 < self.optimizer_efficiency <= 1 or not 0 < self.memory_bound_efficiency <= 1:
            raise ValueError(
                f"calibration {self.name}: optimizer_efficiency and memory_bound_efficiency must lie in (0, 1], got "
                f"{self.optimizer_efficiency}, {self.memory_bound_efficiency}"
            )
        if self.memory_gb <= 0 or self.copy_gbps <= 0:
            raise ValueError(f"calibration {self.name}: memory_gb and copy_gbps must be > 0")
        if "bf16" not in self.gemm:
            raise ValueError(f"calibration {self.name}: gemm needs a 'bf16' curve, has {sorted(self.gemm)}")
        for precision, points in self.gemm.items():
            _check_curve(f"gemm.{precision}", points)
        _check_curve("attention", self.attention)
        if self.packed_attention is not None:
            if any(len(p) != 3 or min(p) <= 0 for p in self.packed_attention):
                raise ValueError(
                    f"calibration {self.name}: packed_attention points must be [length, fwd TFLOP/s, bwd TFLOP/s] "
                    f"all > 0, got {self.packed_attention}"
                )
            _check_curve("packed_attention", [p[:2] for p in self.packed_attention])
        for name in ("all_reduce", "p2p"):
            if name not in self.nvlink:
                raise ValueError(f"calibration {self.name}: nvlink needs a {name!r} curve, has {sorted(self.nvlink)}")
        for name, points in self.nvlink.items():
            if name not in COLLECTIVES:
                raise ValueError(f"calibration {self.name}: unknown collective {name!r}; known: {COLLECTIVES}")
            _check_curve(f"nvlink.{name}", points)

    # ------------------------------------------------------------------------------------------ rates
    def gemm_seconds(self, m: int, n: int, k: int, precision: str = "bf16") -> float:
        flops = 2.0 * m * n * k
        curve = self.gemm.get(precision) or self.gemm["bf16"]
        return flops / (interpolate(curve, flops) * 1e12)

    def grouped_gemm_seconds(self, groups: int, rows: float, n: int, k: int, precision: str = "bf16") -> float:
        """``groups`` experts of ``rows`` rows each in one grouped GEMM: the dense GEMM of all the rows at the
        calibrated grouped efficiency for that many rows per expert."""
        dense = self.gemm_seconds(max(1, round(groups * rows)), n, k, precision)
        return dense / interpolate(self.grouped_gemm, max(rows, 1.0))

    def attention_seconds(self, causal_flops: float, doc_length: int) -> float:
        return causal_flops / (interpolate(self.attention, doc_length) * 1e12)

    def packed_attention_seconds(self, causal_fwd_flops: float, doc_length: int) -> tuple[float, float]:
        """(forward, backward) seconds of ``causal_fwd_flops`` of documents of ``doc_length`` packed in a sequence
        (the backward computes 2.5x the forward's FLOPs), at the packed kernel's rates for that length."""
        bwd_flops = causal_fwd_flops * BACKWARD_ATTENTION_RATIO
        if self.packed_attention is None:
            total = self.attention_seconds(causal_fwd_flops + bwd_flops, doc_length)
            forward = total / (1 + BACKWARD_ATTENTION_RATIO)
            return forward, total - forward
        fwd_rate = interpolate([p[:2] for p in self.packed_attention], doc_length)
        bwd_rate = interpolate([[p[0], p[2]] for p in self.packed_attention], doc_length)
        return causal_fwd_flops / (fwd_rate * 1e12), bwd_flops / (bwd_rate * 1e12)

    def mamba_rates(self) -> tuple[list[float], list[float]]:
        """(``ssd_tflops``, ``conv_gbps``); a clear error for a calibration without them."""
        if self.ssd_tflops is None or self.conv_gbps is None:
            raise UserError(
                f"calibration {self.name} has no Mamba-2 rates (ssd_tflops, conv_gbps): add them from "
                "benchmarks/ssm_throughput.py's kernels record (planning.mamba_terms.rates_from_ssm_benchmark)"
            )
        return self.ssd_tflops, self.conv_gbps

    def memory_seconds(self, nbytes: float) -> float:
        return nbytes / (self.copy_gbps * 1e9 * self.memory_bound_efficiency)

    def dispatch_seconds(self, nbytes: float) -> float:
        if self.moe_dispatch_gbps is None:
            return self.memory_seconds(nbytes)
        return nbytes / (self.moe_dispatch_gbps * 1e9)

    def nvlink_busbw(self, collective: str, nbytes: float) -> float:
        """GB/s; all_gather / reduce_scatter / all_to_all fall back to the all_reduce curve when not measured."""
        curve = self.nvlink.get(collective) or self.nvlink["all_reduce"]
        return interpolate(curve, max(nbytes, 1.0))

    # ------------------------------------------------------------------------------------------- files
    def to_dict(self) -> dict:
        return asdict(self)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n", encoding="utf-8")

    @classmethod
    def from_dict(cls, data: dict) -> Calibration:
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise UserError(f"calibration has unknown keys {unknown}; known: {sorted(known)}")
        try:
            return cls(**data)
        except (TypeError, ValueError) as exc:
            raise UserError(f"invalid calibration: {exc}") from None


def shipped_calibrations() -> list[str]:
    return sorted(p.stem for p in CALIBRATION_DIR.glob("*.json"))


def load_calibration(name_or_path: str) -> Calibration:
    """A shipped calibration by name (``h200-sxm``, ``h100-sxm``) or a calibration JSON file."""
    path = Path(name_or_path)
    if not path.suffix:
        path = CALIBRATION_DIR / f"{name_or_path}.json"
        if not path.exists():
            raise UserError(f"unknown calibration {name_or_path!r}; shipped: {shipped_calibrations()} or a JSON file")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"calibration file not found: {path}") from None
    except json.JSONDecodeError as exc:
        raise UserError(f"calibration file {path} is not valid JSON: {exc}") from None
    return Calibration.from_dict(data)
