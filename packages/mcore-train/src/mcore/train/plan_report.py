"""How ``mcore-train plan`` prints a :class:`~mcore.train.plan.Plan`: a table for people, a dict for ``--json``."""

from __future__ import annotations

from dataclasses import asdict

from mcore.train.plan import Plan
from mcore.train.planning.memory import GB


def _memory_lines(plan: Plan) -> list[str]:
    lines = [f"memory per rank ({plan.precision} parameters, {plan.states}), GB:"]
    lines.append(
        "  pp rank   layers   params(M)   weights   grads   optimizer   activations   logits   margin+runtime   total"
    )
    for s in plan.stages:
        lines.append(
            f"  {s.pp_rank:>7}   {s.layers:>6}   {s.parameters / 1e6:>9.1f}   {s.weights / GB:>7.2f}   "
            f"{s.gradients / GB:>5.2f}   {s.optimizer / GB:>9.2f}   {s.activations / GB:>11.2f}   "
            f"{s.logits / GB:>6.2f}   {(s.margin + s.overhead) / GB:>14.2f}   {s.total / GB:>5.2f}"
        )
    worst = plan.worst
    verdict = "fits" if plan.fits else "does NOT fit"
    lines.append(
        f"heaviest rank: pp {worst.pp_rank} needs ~{worst.total / GB:.1f} GB: {verdict} in {plan.gpu_memory_gb:g} GB"
    )
    return lines


def _mode_lines(plan: Plan) -> list[str]:
    if not plan.modes:
        return []
    lines = ["memory modes (heaviest rank, GB" + (", predicted step s" if plan.prediction else "") + "):"]
    for m in plan.modes:
        step = f"  {m.step_s:.3f} s" if m.step_s else ""
        changes = " ".join(m.overrides) or "(the config)"
        lines.append(f"  {m.worst_gb:>7.1f}{step}  {'fits' if m.fits else 'no  '}  {m.name}: {changes}")
    best = plan.suggestion
    if not plan.fits:
        if best is None:
            lines.append("  none fits: raise parallel.tp / parallel.pp, lower train.micro_batch_size, or use more GPUs")
        else:
            lines.append(f"  cheapest that fits: {best.name}: {' '.join(best.overrides)}")
    return lines


def _all_to_all_lines(plan: Plan) -> list[str]:
    """The pp rank with the most all-to-all traffic; every rank's in ``--json``."""
    if not plan.ep_traffic:
        return []
    t = max(plan.ep_traffic, key=lambda r: r.total)
    again = f" + {_size(t.recompute)} recomputed" if t.recompute else ""
    return [
        f"all-to-all per GPU per step (ep {t.ep}; pp rank {t.pp_rank}: {t.moe_layers} MoE layer(s) x "
        f"{t.microbatches} micro-batch(es), {_size(t.exchange_bytes)} per exchange): dispatch "
        f"{_size(t.dispatch_forward)} + combine {_size(t.combine_forward)} forward, {_size(t.backward)} "
        f"backward{again} = {_size(t.total)}, {_size(t.off_gpu)} of it to other GPUs"
    ]


def _size(nbytes: float) -> str:
    """``nbytes`` in decimal units (kB, MB, GB, TB) with one decimal."""
    value, unit = float(nbytes), "B"
    for bigger in ("kB", "MB", "GB", "TB"):
        if value < 1000:
            break
        value, unit = value / 1000, bigger
    return f"{value:.1f} {unit}"


def format_plan(plan: Plan, peak_flops_per_gpu: float | None = None) -> str:
    """A human-readable report of ``plan``."""
    lines = [
        f"parameters: {plan.total_parameters / 1e9:.3f} B ({plan.total_parameters:,})",
        f"layout: {plan.world_size} rank(s) = tp {plan.tp}{f' x cp {plan.cp}' if plan.cp > 1 else ''} x pp {plan.pp} "
        f"x dp {plan.dp}"
        + (f" (vpp {plan.vpp})" if plan.vpp > 1 else "")
        + f"; {plan.num_microbatches} micro-batch(es) per step; pipeline bubble {100 * plan.bubble_fraction:.1f}%",
        f"tokens per step: {plan.tokens_per_step:,}; model FLOPs per step: {plan.flops_per_step:.3e} "
        f"({plan.flops_per_step / plan.world_size:.3e} per GPU)",
    ]
    p = plan.prediction
    if p is not None:
        lines.append(
            f"predicted on {plan.calibration}: step {p.step_s:.3f} s, {p.tokens_per_s:,.0f} tokens/s, "
            f"MFU {100 * p.mfu:.1f}%, pipeline idle {100 * p.bubble_fraction:.1f}%"
        )
        parts = sorted(p.breakdown.items(), key=lambda kv: -kv[1])
        lines.append("  slowest rank, s: " + ", ".join(f"{k} {v:.3f}" for k, v in parts if v >= 5e-4))
    elif peak_flops_per_gpu:
        at = plan.flops_per_step / plan.world_size / (0.4 * peak_flops_per_gpu)
        lines.append(f"step time at 40% MFU: {at:.2f} s")
    notes = [f"note: {n}" for n in plan.notes]
    return "\n".join(lines + _all_to_all_lines(plan) + _memory_lines(plan) + _mode_lines(plan) + notes)


def plan_to_dict(plan: Plan) -> dict:
    """``plan`` as JSON-able data."""
    out = {
        "world_size": plan.world_size,
        "layout": {"tp": plan.tp, "pp": plan.pp, "dp": plan.dp, "vpp": plan.vpp},
        "precision": plan.precision,
        "notes": list(plan.notes),
        "parameters": plan.total_parameters,
        "flops_per_step": plan.flops_per_step,
        "tokens_per_step": plan.tokens_per_step,
        "num_microbatches": plan.num_microbatches,
        "bubble_fraction": plan.bubble_fraction,
        "memory_gb": [
            {k: (v / GB if isinstance(v, float) else v) for k, v in {**asdict(s), "total": s.total}.items()}
            for s in plan.stages
        ],
        "gpu_memory_gb": plan.gpu_memory_gb,
        "fits": plan.fits,
        "memory_modes": [asdict(m) for m in plan.modes],
        "suggestion": asdict(plan.suggestion) if plan.suggestion else None,
        # bytes per step and GPU: the exchanges' buffers summed, and the share that leaves the GPU
        "all_to_all_bytes": [{**asdict(t), "total": t.total, "off_gpu": t.off_gpu} for t in plan.ep_traffic],
    }
    if plan.prediction is not None:
        p = plan.prediction
        out["prediction"] = {
            "calibration": plan.calibration,
            "step_s": p.step_s,
            "tokens_per_s": p.tokens_per_s,
            "mfu": p.mfu,
            "pipeline_idle_fraction": p.bubble_fraction,
            "breakdown_s": p.breakdown,
        }
    return out
