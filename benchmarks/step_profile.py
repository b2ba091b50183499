"""Where a training step's GPU time goes: a CUDA-profiler breakdown of ``Trainer.train_step``.

``profile_steps`` runs a few steps under ``torch.profiler`` (CUDA activity), writes the Chrome trace to a
temporary file and reads the kernels back from it. Every kernel, copy and memset is put into one category by
its name (first match of ``CATEGORIES``, in order: attention kernels also contain "sm90", so they come before
the GEMMs). Per step: the GPU window runs from the step's host-side start to its last kernel's end (steps are
synchronised, so kernels never spill into the next step); ``busy`` is the union of kernel intervals on all
streams; ``idle`` = window - busy (the GPU waiting for the host: launch latency, host syncs, Python).
Communication that runs beside compute is reported twice: its total, and the part not hidden under compute
kernels (``exposed``), which is what costs time. Implicit host syncs inside the step (``.item()``, ``.cpu()``, ...)
are counted with CUDA's sync debug mode, by the Python line that caused them.

Scopes: a kernel launched inside one of ``SCOPES``' ``record_function`` ranges (the MoE layer marks its router,
permute, experts and unpermute) is put in that scope's category, in forward and in backward. Backward kernels are
found through autograd's sequence numbers: the backward node that launched a kernel carries the sequence number of
the forward op that recorded it, and that op lay inside the scope. In a scope, GEMM and communication kernels keep
their kind (``"moe experts: gemm"``: the grouped GEMMs); the others take the scope's name alone.

FP8: torch's fp8 GEMM ops (``aten::_scaled_mm``, ``_scaled_mm_v2``) are scopes too, so their cuBLAS kernels (named
like any GEMM's) count as ``fp8 gemm`` and ``gemm`` keeps the other (bf16) GEMMs; mcore's Triton fp8 casts and its
block-scaled GEMM are known by name (``fp8 cast``, ``fp8 gemm``).
"""

from __future__ import annotations

import bisect
import json
import re
import tempfile
import warnings
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

# (category, kernel-name pattern), first match wins.
CATEGORIES: tuple[tuple[str, str], ...] = (
    ("communication", r"nccl|all_?reduce|all_?gather|reduce_?scatter|sendrecv|cross_device"),
    # mcore.kernels' Triton fp8 quantizers (triton/quantization.py, triton/quant_fused.py) and block-scaled GEMM
    ("fp8 cast", r"^_(dual_cast|amax|block_dual|block_quant|tiled_cast|jagged_column_amax)_kernel"),
    ("fp8 gemm", r"^_block_scaled_mm_kernel"),
    # mcore's own Triton flash kernels carry their Python names (flash_attention.py, flash_backward*.py)
    ("attention", r"flash|fmha|sdpa|attention|attn|flex|^_fwd_kernel$|^_bwd_(kv|q)_kernel$|^_preprocess_kernel$"),
    (
        "ssm",
        r"_intra_(fwd|dx|dcb)_|_state_(fwd|bwd)_kernel|_inter_(fwd|bwd)_|_conv_(fwd|bwd|dpre|dx)_|ssd|"
        r"causal_conv|mamba",
    ),
    ("gemm", r"gemm|cutlass|xmma|nvjet|cublas|wgmma|sm90_|sm80_|splitk|matmul|_mm_"),
    ("optimizer", r"adam|multi_tensor|foreach|_amp_|lerp|l2norm|norm_kernel_cuda|clip"),
    ("loss", r"cross_entropy|_ce_|logsumexp|nll|_row_stats_kernel|^_grad_kernel"),
    ("norm", r"rms_?norm|layer_?norm|_norm_"),
    ("rope", r"rotary|rope"),
    ("activation", r"swiglu|geglu|_glu_|silu|gelu"),
    ("copy/cast", r"memcpy|memset|copy|cast|convert|to_copy|cat_|fill"),
    ("embedding", r"embedding|index_select|indexselect|index_put|scatter|gather"),
)
OTHER = "other elementwise/reduction"
# record_function range -> category (the ranges mcore.parallel.expert_parallel opens)
SCOPES: dict[str, str] = {
    "mcore.moe.router": "moe router",
    "mcore.moe.permute": "moe permute",
    "mcore.moe.experts": "moe experts",
    "mcore.moe.unpermute": "moe unpermute",
    "aten::_scaled_mm": "fp8 gemm",  # torch's fp8 GEMMs (cuBLAS kernels whose names do not say fp8)
    "aten::_scaled_mm_v2": "fp8 gemm",
}
_KEPT_IN_SCOPE = ("gemm", "communication")
_BACKWARD_NODE = "autograd::engine::evaluate_function:"
_COMPILED = [(name, re.compile(pat, re.IGNORECASE)) for name, pat in CATEGORIES]
_DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
STEP_MARK = "mcore_profiled_step"


def categorize(kernel_name: str) -> str:
    for name, pattern in _COMPILED:
        if pattern.search(kernel_name):
            return name
    return OTHER


def _union_length(intervals: Sequence[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def _exposed(comm: Sequence[tuple[float, float]], compute: Sequence[tuple[float, float]]) -> float:
    """Length of the union of ``comm`` not covered by the union of ``compute``."""
    return _union_length([*comm, *compute]) - _union_length(compute)


class _Ranges:
    """Labelled time ranges of one host thread; ``at(ts)`` is the label of the innermost range holding ``ts``."""

    def __init__(self, ranges: list[tuple[float, float, str]]) -> None:
        self.ranges = sorted(ranges)
        self.starts = [r[0] for r in self.ranges]
        self.max_end: list[float] = []
        for _, end, _ in self.ranges:
            self.max_end.append(max(end, self.max_end[-1]) if self.max_end else end)

    def at(self, ts: float) -> str | None:
        i = bisect.bisect_right(self.starts, ts) - 1
        while i >= 0 and self.max_end[i] >= ts:  # nested ranges: the latest start that still holds ts is innermost
            if self.ranges[i][1] >= ts:
                return self.ranges[i][2]
            i -= 1
        return None


def _by_thread(ranges: list[tuple[Any, float, float, str]]) -> dict[Any, _Ranges]:
    grouped: dict[Any, list[tuple[float, float, str]]] = defaultdict(list)
    for tid, start, end, label in ranges:
        grouped[tid].append((start, end, label))
    return {tid: _Ranges(r) for tid, r in grouped.items()}


def scope_labeller(events: Sequence[dict[str, Any]], scopes: dict[str, str]) -> Callable[[dict[str, Any]], str | None]:
    """A function giving each GPU kernel event the category of the ``scopes`` range it was launched in (forward:
    the range around the launching op; backward: the range around the forward op whose autograd node launched
    it), or ``None``. Kernels are matched to their host launch by ``correlation``, else by ``External id``."""
    host = [e for e in events if e.get("cat") in ("cpu_op", "user_annotation", "cuda_runtime") and "dur" in e]
    forward = _by_thread(
        [(e.get("tid"), e["ts"], e["ts"] + e["dur"], scopes[e["name"]]) for e in host if e["name"] in scopes]
    )
    seq_scope: dict[int, str] = {}
    for e in host:
        seq = e.get("args", {}).get("Sequence number")
        if seq is not None and e["cat"] == "cpu_op" and not e["name"].startswith(_BACKWARD_NODE):
            label = forward[e.get("tid")].at(e["ts"]) if e.get("tid") in forward else None
            if label is not None:
                seq_scope.setdefault(seq, label)
    backward = _by_thread(
        [
            (e.get("tid"), e["ts"], e["ts"] + e["dur"], seq_scope[e["args"]["Sequence number"]])
            for e in host
            if e["name"].startswith(_BACKWARD_NODE) and e.get("args", {}).get("Sequence number") in seq_scope
        ]
    )
    launches: dict[tuple[str, Any], dict[str, Any]] = {}
    for e in host:
        args = e.get("args", {})
        if e["cat"] == "cuda_runtime" and "correlation" in args:
            launches[("correlation", args["correlation"])] = e
        elif e["cat"] == "cpu_op" and "External id" in args:
            launches.setdefault(("External id", args["External id"]), e)

    def label(kernel: dict[str, Any]) -> str | None:
        args = kernel.get("args", {})
        launch = launches.get(("correlation", args.get("correlation"))) or launches.get(
            ("External id", args.get("External id"))
        )
        if launch is None:
            return None
        tid, ts = launch.get("tid"), launch["ts"]
        for ranges in (forward, backward):  # a recomputed forward inside a backward node: its scope wins
            found = ranges[tid].at(ts) if tid in ranges else None
            if found is not None:
                return found
        return None

    return label


def _category(kernel: dict[str, Any], label: Callable[[dict[str, Any]], str | None]) -> str:
    kind = categorize(kernel["name"])
    scope = label(kernel)
    if scope is None:
        return kind
    if scope.endswith(kind):  # "fp8 gemm" already says it is a GEMM
        return scope
    return f"{scope}: {kind}" if kind in _KEPT_IN_SCOPE else scope


def breakdown_from_trace(trace: dict[str, Any], top: int = 25) -> dict[str, Any]:
    """The per-category breakdown of a Chrome trace holding steps marked with ``STEP_MARK`` (times in ms, averaged
    over the marked steps)."""
    events = trace.get("traceEvents", [])
    marks = sorted(
        (e["ts"], e["ts"] + e.get("dur", 0))
        for e in events
        if e.get("name") == STEP_MARK and e.get("cat") == "user_annotation"
    )
    if not marks:
        raise ValueError(f"the trace has no '{STEP_MARK}' annotations; were the steps run under profile_steps?")
    kernels = [e for e in events if e.get("cat") in _DEVICE_CATS and "dur" in e]
    label = scope_labeller(events, SCOPES)
    if not kernels:
        raise ValueError("the trace has no GPU kernels (was the profiler given ProfilerActivity.CUDA?)")
    starts = [m[0] for m in marks] + [float("inf")]
    per_step: list[list[dict[str, Any]]] = [[] for _ in marks]
    for k in kernels:
        for i in range(len(marks)):
            if starts[i] <= k["ts"] < starts[i + 1]:
                per_step[i].append(k)
                break
    n = len(marks)
    cat_us: dict[str, float] = defaultdict(float)
    by_name: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0])
    window_us = busy_us = exposed_comm_us = 0.0
    for (mark_start, _), ks in zip(marks, per_step):
        if not ks:
            continue
        window_us += max(k["ts"] + k["dur"] for k in ks) - mark_start
        intervals = [(k["ts"], k["ts"] + k["dur"]) for k in ks]
        busy_us += _union_length(intervals)
        comm, compute = [], []
        for k, iv in zip(ks, intervals):
            cat = _category(k, label)
            cat_us[cat] += k["dur"]
            by_name[(k["name"], cat)][0] += k["dur"]  # one kernel may run in several scopes
            by_name[(k["name"], cat)][1] += 1
            (comm if cat.endswith("communication") else compute).append(iv)
        exposed_comm_us += _exposed(comm, compute)
    window_ms = window_us / n / 1e3
    nonempty = [(mark, ks) for mark, ks in zip(marks, per_step) if ks]
    gaps = idle_gaps(nonempty[0][0][0], nonempty[0][1]) if nonempty else []
    categories = {c: cat_us[c] / n / 1e3 for c in sorted(cat_us, key=cat_us.get, reverse=True)}
    top_kernels = sorted(by_name.items(), key=lambda kv: kv[1][0], reverse=True)[:top]
    return {
        "steps": n,
        "step_window_ms": window_ms,
        "busy_ms": busy_us / n / 1e3,
        "idle_ms": (window_us - busy_us) / n / 1e3,
        "categories_ms": categories,
        "categories_percent_of_window": {c: 100 * v / window_ms for c, v in categories.items()},
        "exposed_communication_ms": exposed_comm_us / n / 1e3,
        # where the first profiled step's GPU waited (the host behind): the start, then the longest gaps
        "idle_gaps": gaps,
        "top_kernels": [
            {"name": name[:160], "category": cat, "ms_per_step": t / n / 1e3, "calls_per_step": c / n}
            for (name, cat), (t, c) in top_kernels
        ],
    }


def idle_gaps(mark_start: float, kernels: Sequence[dict[str, Any]], top: int = 8) -> list[dict[str, Any]]:
    """The step's GPU idle as gaps: from the step's host-side start to its first kernel (``"(step start)"``), then
    the ``top`` longest gaps between busy intervals (any stream), each with its offset from the step's start (ms),
    its length (ms) and the kernels that end before it and start after it (which part of the step waited)."""
    ks = sorted(kernels, key=lambda k: k["ts"])
    out = [
        {
            "at_ms": 0.0,
            "gap_ms": (ks[0]["ts"] - mark_start) / 1e3,
            "before": "(step start)",
            "after": ks[0]["name"][:80],
        }
    ]
    end, last = ks[0]["ts"] + ks[0]["dur"], ks[0]
    found = []
    for k in ks[1:]:
        if k["ts"] > end:
            found.append({"at_ms": (end - mark_start) / 1e3, "gap_ms": (k["ts"] - end) / 1e3,
                          "before": last["name"][:80], "after": k["name"][:80]})  # fmt: skip
        if k["ts"] + k["dur"] >= end:
            end, last = k["ts"] + k["dur"], k
    return out + sorted(found, key=lambda g: -g["gap_ms"])[:top]


def profile_steps(run_step: Callable[[int], None], steps: Sequence[int], sync: Callable[[], None]) -> dict[str, Any]:
    """Run ``run_step(step)`` for each of ``steps`` under the CUDA profiler (synchronised before and after each)
    and return ``breakdown_from_trace`` of them."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    syncs: list[str] = []
    with tempfile.TemporaryDirectory(prefix="mcore-profile-") as tmp:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for step in steps:
                sync()
                with record_function(STEP_MARK):
                    # CUDA's sync debug mode warns at every implicit host sync (.item(), .cpu(), nonzero, ...)
                    # inside the step, pointing at the Python line that caused it.
                    with warnings.catch_warnings(record=True) as caught:
                        warnings.simplefilter("always")
                        torch.cuda.set_sync_debug_mode("warn")
                        try:
                            run_step(step)
                        finally:
                            torch.cuda.set_sync_debug_mode("default")
                    # (the mode's own "prototype feature" notice is not a sync)
                    found = [w for w in caught if "synchronizing CUDA operation" in str(w.message)]
                    syncs += [f"{w.filename}:{w.lineno}" for w in found]
                    sync()
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
    result = breakdown_from_trace(trace)
    result["host_syncs_per_step"] = len(syncs) / max(1, len(steps))
    result["host_sync_sites"] = dict(Counter(syncs).most_common(10))
    return result


def render_breakdown(b: dict[str, Any], top: int = 12) -> str:
    """Markdown: the categories (ms per step and % of the step window), then the costliest kernels."""
    lines = [
        f"step window {b['step_window_ms']:.1f} ms (mean of {b['steps']} profiled steps), GPU busy "
        f"{b['busy_ms']:.1f} ms, idle {b['idle_ms']:.1f} ms, "
        f"exposed communication {b['exposed_communication_ms']:.1f} ms, "
        f"implicit host syncs per step {b.get('host_syncs_per_step', 'n/a')}",
        "",
        "| category | ms/step | % of step |",
        "|---|---:|---:|",
    ]
    for cat, ms in b["categories_ms"].items():
        lines.append(f"| {cat} | {ms:.2f} | {b['categories_percent_of_window'][cat]:.1f} |")
    idle_percent = 100 * b["idle_ms"] / b["step_window_ms"]
    lines.append(f"| idle (GPU waits for the host) | {b['idle_ms']:.2f} | {idle_percent:.1f} |")
    lines += ["", "| kernel | category | ms/step | calls/step |", "|---|---|---:|---:|"]
    for k in b["top_kernels"][:top]:
        name = k["name"].replace("|", "\\|")[:90]
        lines.append(f"| `{name}` | {k['category']} | {k['ms_per_step']:.2f} | {k['calls_per_step']:.0f} |")
    return "\n".join(lines)
