"""docs/scaling.md: the planner against our measurements and Megatron's table, and two worked examples.

CPU only (the planner needs no GPU). Writes ``scaling.md`` and three PNG plots into ``--out`` (default
``docs``, where the committed copies live)::

    python benchmarks/planner_report.py                 # rewrite docs/scaling.md and docs/scaling/*.png (~2 min)
    python benchmarks/planner_report.py --quick --out /tmp/s   # without the two searches (what the test runs)
"""

from __future__ import annotations

import argparse
import importlib
import time
from pathlib import Path

from mcore.models.families import get_config
from mcore.train.planning.calibration import load_calibration
from mcore.train.planning.cluster import PRESETS, Network
from mcore.train.planning.kernel_rates import attention_rows, gemm_rows, gemm_run_rates
from mcore.train.planning.memory import GB, rank_chunks, stage_memory
from mcore.train.planning.published import MEGATRON_WEAK_SCALING, tuned_layout
from mcore.train.planning.shape import ModelShape
from mcore.train.planning.time_model import TimeModel
from mcore.train.planning.validation import measured_cases

search_module = importlib.import_module("mcore.train.planning.search")
RESULTS = Path(__file__).resolve().parent / "results"
DEEPSEEK_V3 = ModelShape(
    hidden=7168, ffn=18432, layers=61, heads=128, kv_heads=128, head_dim=128, vocab=129280, num_experts=256,
    top_k=8, moe_ffn=2048, shared_ffn=2048, first_dense_layers=3, q_lora_rank=1536, kv_lora_rank=512,
    qk_rope_head_dim=64, v_head_dim=128, mtp_layers=1, name="deepseek-v3",
)  # fmt: skip


def table(headers: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def measured_section(out: Path) -> tuple[str, float, float]:
    net = Network(PRESETS["h200-node"])
    rows, worst_t, worst_m, points = [], 0.0, 0.0, []
    for case in measured_cases(RESULTS):
        step, memory = case.predicted(net)
        err_t = step / case.measured_step_s - 1
        errs_m = [p / m - 1 for p, m in zip(memory, case.measured_peak_gb, strict=True)]
        worst_t, worst_m = max(worst_t, abs(err_t)), max([worst_m] + [abs(e) for e in errs_m])
        lay = case.layout
        rows.append([
            case.name, f"{lay.tp}/{lay.pp}/{lay.dp}" + (f" vpp {lay.vpp}" if lay.vpp > 1 else ""), lay.schedule_name,
            f"{1e3 * case.measured_step_s:.1f}", f"{1e3 * step:.1f}", f"{100 * err_t:+.1f}%",
            " / ".join(f"{m:.1f}" for m in case.measured_peak_gb), " / ".join(f"{p:.1f}" for p in memory),
            " / ".join(f"{100 * e:+.1f}%" for e in errs_m),
        ])  # fmt: skip
        points.append((case.name, case.measured_step_s, step, case.measured_peak_gb, memory))
    _plot_measured(points, out / "scaling" / "measured_vs_predicted.png")
    text = table(
        ["run", "tp/pp/dp", "schedule", "measured ms", "predicted ms", "error", "measured GB", "predicted GB",
         "error"], rows,
    )  # fmt: skip
    return text, worst_t, worst_m


def _plot_measured(points, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.6))
    for ax, lo, hi, unit in ((a, 50, 1100, "step ms"), (b, 15, 120, "peak GB per rank")):
        ax.fill_between([lo, hi], [0.9 * lo, 0.9 * hi], [1.1 * lo, 1.1 * hi], color="0.9", zorder=1)
        ax.plot([lo, hi], [lo, hi], "k-", lw=0.8, zorder=2)
        ax.set_xlabel(f"measured {unit}")
        ax.set_ylabel(f"predicted {unit}")
        ax.set_xscale("log")
        ax.set_yscale("log")
    for i, (_, mt, pt, mm, pm) in enumerate(points):
        a.scatter(1e3 * mt, 1e3 * pt, s=22, color=f"C{i % 10}", zorder=3)
        b.scatter(mm, pm, s=22, color=f"C{i % 10}", zorder=3)
    a.set_title(f"step time, {len(points)} runs on H200 (band: 10%)")
    b.set_title("peak memory per pipeline rank")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def megatron_section(out: Path) -> str:
    """The table (with the prediction at micro-batch 1 beside the tuned one) and where each row's step goes."""
    net = Network(PRESETS["dgx-h100"])
    rows, parts, points = [], [], []
    keys = (
        "gemm",
        "attention",
        "memory",
        "tp_comm",
        "pipeline_wait",
        "dp_grad_comm",
        "dp_param_comm",
        "dp_overlap_slowdown",
        "grad_bucket_passes",
        "grad_zero",
        "host",
    )
    for row in MEGATRON_WEAK_SCALING:
        layout, p = tuned_layout(row, net)
        one = tuned_layout(row, net, micro_batches=(1,))[1]
        need = max(s.total for s in stage_memory(row.shape(), layout)) / GB
        rows.append([
            row.name, row.gpus, f"{row.tp}/{row.pp}/{row.dp}", row.batch, f"{row.mfu_percent:.0f}%",
            f"{100 * p.mfu:.1f}%", f"{100 * p.mfu - row.mfu_percent:+.1f}", layout.micro_batch, layout.vpp,
            layout.recompute, f"{need:.0f}", f"{100 * p.bubble_fraction:.1f}%", f"{100 * one.mfu:.1f}%",
        ])  # fmt: skip
        b = p.breakdown
        rest = p.step_s - sum(b.get(k, 0.0) for k in keys)
        parts.append([row.name, f"{p.step_s:.2f}"] + [f"{100 * b.get(k, 0.0) / p.step_s:.1f}" for k in keys]
                     + [f"{100 * rest / p.step_s:.1f}"])  # fmt: skip
        points.append((row.name, row.gpus, row.mfu_percent, 100 * p.mfu))
    _plot_megatron(points, out / "scaling" / "megatron_mfu.png")
    first = table(
        ["model", "GPUs", "tp/pp/dp", "batch", "published MFU", "predicted MFU", "points", "micro-batch", "vpp",
         "recompute", "GB/GPU", "pipeline idle", "predicted at micro-batch 1"], rows,
    )  # fmt: skip
    second = table(["model", "step s"] + [f"{k} %" for k in keys] + ["optimizer, other %"], parts)
    return first + "\n\nWhere the predicted step goes (share of the step on the slowest rank):\n\n" + second


def _plot_megatron(points, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.4))
    gpus = [g for _, g, _, _ in points]
    ax.plot(gpus, [m for *_, m, _ in points], "o-", label="Megatron-Core r0.8.0, published (H100)")
    ax.plot(gpus, [p for *_, p in points], "s--", label="mcore-train plan, h100-sxm calibration")
    for name, g, m, _ in points:
        ax.annotate(name, (g, m), textcoords="offset points", xytext=(0, -14), ha="center", fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel("GPUs (weak scaling: model size grows with the GPU count)")
    ax.set_ylabel("MFU %")
    ax.set_ylim(30, 70)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def example_section(shape: ModelShape, gpus: int, batch: int, seq: int, cluster: str, out: Path, tag: str) -> str:
    net = Network(PRESETS[cluster])
    t0 = time.perf_counter()
    found = search_module.search(shape, gpus, batch, seq, net)
    seconds = time.perf_counter() - t0
    best = found[0]
    worst = max(stage_memory(shape, best.layout), key=lambda s: s.total) if best.runs else None
    text = [
        f"`mcore-train plan --search --gpus {gpus} --cluster {cluster}` with global batch {batch} x {seq} tokens "
        f"({seconds:.0f} s on one CPU core):",
        "",
        "```",
        search_module.format_search(found, top=5),
        "```",
    ]
    if best.runs:
        p = best.prediction
        parts = sorted(p.breakdown.items(), key=lambda kv: -kv[1])
        text += [
            "",
            f"Best: {p.tokens_per_s:,.0f} tokens/s ({p.tokens_per_s / gpus:,.0f} per GPU), MFU {100 * p.mfu:.1f}%, "
            f"step {p.step_s:.2f} s; heaviest rank {worst.total / GB:.1f} GB (weights {worst.weights / GB:.1f}, "
            f"gradients {worst.gradients / GB:.1f}, optimizer {worst.optimizer / GB:.1f}, activations "
            f"{worst.activations / GB:.1f}, logits {worst.logits / GB:.1f}). Where its step goes (s, slowest rank): "
            + ", ".join(f"{k} {v:.2f}" for k, v in parts if v >= 0.005)
            + ".",
        ]
        if shape.is_moe and best.layout.ep > 1:
            text += ["", _all_to_all_line(shape, best.layout, net)]
    _plot_search(found, out / "scaling" / f"{tag}_layouts.png", shape.name, gpus)
    return "\n".join(text)


def _all_to_all_line(shape: ModelShape, layout, net: Network) -> str:
    """EP all-to-all bytes per step of the rank holding the most MoE layers."""
    model = TimeModel(shape, layout, net)
    chunks = rank_chunks(shape, layout)
    counts = [sum(shape.is_moe_layer(i) for s, e in rank for i in range(s, e)) for rank in chunks]
    counts[-1] += shape.mtp_layers if shape.is_moe_layer(shape.layers - 1) else 0  # MTP runs on the last stage
    moe_layers = max(counts)
    one = model.ep_exchange_bytes()
    per_step = moe_layers * layout.num_microbatches * 4 * one
    sent = per_step * (layout.ep - 1) / layout.ep
    return (
        f"EP all-to-all per step on the rank with the most MoE layers ({moe_layers}, ep {layout.ep}): "
        f"{layout.num_microbatches} micro-batches x {moe_layers} layers x 4 exchanges (dispatch, combine; forward, "
        f"backward) of {one / 1e6:.0f} MB (tokens x top-k x hidden x 2 bytes) = {per_step / GB:.1f} GB through "
        f"NCCL, {sent / GB:.1f} GB of it sent to other ranks."
    )


def _plot_search(found, path: Path, name: str, gpus: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [c for c in found if c.runs]
    fig, ax = plt.subplots(figsize=(8, 4.4))
    ax.scatter([c.memory_gb for c in runs], [100 * c.prediction.mfu for c in runs], s=8, alpha=0.5)
    top = runs[0]
    ax.scatter([top.memory_gb], [100 * top.prediction.mfu], s=60, marker="*", color="C3", label="best")
    ax.set_xlabel("GB per GPU (heaviest rank)")
    ax.set_ylabel("predicted MFU %")
    ax.set_title(f"{name} on {gpus} GPUs: every layout that fits")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def kernel_section() -> str:
    cal = load_calibration("h200-sxm")
    rows = []
    for r in gemm_rows(RESULTS, cal) + attention_rows(RESULTS, cal):
        check = "within 10%" if r.checked and abs(r.error) <= 0.10 else ("checked" if r.checked else "listed")
        rows.append([r.name, r.runs, f"{r.measured_ms:.3f}", f"{r.predicted_ms:.3f}", f"{100 * r.error:+.1f}%", check])
    return table(["kernel case", "runs", "measured ms", "predicted ms", "error", ""], rows)


def down_spread_section() -> str:
    """down's three GEMMs per run (and --calibrate's point of the same shape): spread, or a shape's effect."""
    rows = [[gemm, precision, " x ".join(map(str, shape)), run, f"{rate:.0f}"]
            for gemm, precision, shape, run, rate in gemm_run_rates(RESULTS, "down")]  # fmt: skip
    return table(["down GEMM", "precision", "m x n x k", "run", "TFLOP/s"], rows)


def calibration_notes() -> str:
    out = []
    for name in ("h200-sxm", "h100-sxm"):
        cal = load_calibration(name)
        out.append(f"**{name}** ({cal.source}):")
        out += [f"- {a}" for a in cal.assumptions]
        out.append("")
    return "\n".join(out)


TEMPLATE = Path(__file__).with_name("planner_report_template.md")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "docs")
    parser.add_argument("--quick", action="store_true", help="skip the two searches (for the test)")
    args = parser.parse_args(argv)
    measured, worst_t, worst_m = measured_section(args.out)
    sections = {
        "measured": measured,
        "worst_time": f"{100 * worst_t:.1f}%",
        "worst_memory": f"{100 * worst_m:.1f}%",
        "megatron": megatron_section(args.out),
        "kernels": kernel_section(),
        "down_spread": down_spread_section(),
        "calibrations": calibration_notes(),
        "llama70b": "(skipped: --quick)",
        "deepseek": "(skipped: --quick)",
    }
    if not args.quick:
        llama = ModelShape.from_config(get_config("llama3-70b"), name="llama3-70b")
        sections["llama70b"] = example_section(llama, 64, 512, 8192, "dgx-h100", args.out, "llama3_70b")
        sections["deepseek"] = example_section(DEEPSEEK_V3, 1024, 4096, 4096, "dgx-h100", args.out, "deepseek_v3")
    text = TEMPLATE.read_text()
    for key, value in sections.items():
        text = text.replace("{{" + key + "}}", value)
    (args.out / "scaling.md").write_text(text)
    print(f"wrote {args.out / 'scaling.md'} and {args.out / 'scaling'}/*.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
