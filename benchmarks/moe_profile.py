"""The MoE view of a step's CUDA-profiler breakdown (``step_profile.breakdown_from_trace``): where an MoE training
step's GPU time goes, in the parts the MoE issue asks for.

``step_profile`` files each kernel under the MoE layer's ``record_function`` range it was launched in (forward and
backward): ``moe router`` / ``moe permute`` / ``moe experts`` / ``moe unpermute``, with ``: gemm`` or
``: communication`` appended for those kernels inside a range. This module folds those categories into the rows
below (ms per step and % of the step window); everything the rows do not name is ``rest`` (norms, rope, loss,
casts, residual adds, embedding).
"""

from __future__ import annotations

from typing import Any

# row -> the step_profile categories it sums
ROWS: dict[str, tuple[str, ...]] = {
    "router": ("moe router", "moe router: gemm"),
    "permute": ("moe permute",),
    "unpermute": ("moe unpermute",),
    "grouped GEMMs": ("moe experts: gemm",),
    "expert activation/casts": ("moe experts",),
    "expert communication": (
        "moe router: communication",
        "moe permute: communication",
        "moe experts: communication",
        "moe unpermute: communication",
    ),
    "attention": ("attention",),
    "other GEMMs": ("gemm",),
    "optimizer": ("optimizer",),
}


def moe_time_breakdown(b: dict[str, Any]) -> dict[str, Any]:
    """``{row: {"ms": .., "percent": ..}}`` for the rows of ``ROWS`` plus ``rest`` and ``idle`` (the GPU waiting
    for the host), from one rank's breakdown ``b``; the rows add up to the step window when no kernels overlap."""
    cats: dict[str, float] = dict(b["categories_ms"])
    window = b["step_window_ms"]
    rows: dict[str, float] = {}
    for row, members in ROWS.items():
        rows[row] = sum(cats.pop(c, 0.0) for c in members)
    rows["rest"] = sum(cats.values())
    rows["idle"] = b["idle_ms"]
    return {
        "step_window_ms": window,
        "rows": {row: {"ms": ms, "percent": 100 * ms / window} for row, ms in rows.items()},
        "rest_categories_ms": cats,
        "host_syncs_per_step": b.get("host_syncs_per_step"),
        "host_sync_sites": b.get("host_sync_sites"),
    }


def render_moe_breakdowns(breakdowns: dict[str, dict[str, Any]]) -> str:
    """Markdown: one column per shape, one row per part (ms per step, % of the step in brackets)."""
    if not breakdowns:
        return ""
    shapes = list(breakdowns)
    lines = [
        "Time breakdown (CUDA profiler, ms per step (% of the step window), profiled steps after the timed ones)",
        "",
        "| part | " + " | ".join(shapes) + " |",
        "|---|" + "---:|" * len(shapes),
    ]
    for row in (*ROWS, "rest", "idle"):
        cells = [
            f"{breakdowns[s]['rows'][row]['ms']:.2f} ({breakdowns[s]['rows'][row]['percent']:.1f}%)" for s in shapes
        ]
        lines.append(f"| {row} | " + " | ".join(cells) + " |")
    lines.append("| step window | " + " | ".join(f"{breakdowns[s]['step_window_ms']:.2f}" for s in shapes) + " |")
    syncs = " | ".join(str(breakdowns[s]["host_syncs_per_step"]) for s in shapes)
    lines.append(f"| implicit host syncs per step | {syncs} |")
    return "\n".join(lines)
