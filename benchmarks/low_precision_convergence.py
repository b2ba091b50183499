"""Loss curves on real text in high precision and in every FP8 / FP4 recipe: final losses side by side, plotted.

Each configuration trains the same model on the same data with ``train.precision`` set to ``fp8`` / ``fp4`` and
the recipe chosen; the baseline is the device's high precision (fp32 on CPU, where the FP8 GEMMs are emulated
exactly: the same fp8 values and scales, multiplied in fp32; bf16 on CUDA, with the real kernels). The final loss
is the mean training loss of the last ``--tail`` steps (one step's loss is one batch's: noisy), and a recipe
passes when it lies within ``--tolerance`` (default 1%) of the baseline's.

* ``--text stdlib`` (default): the Python standard library's sources, byte-tokenized (``real_text.py``: present on
  any machine, no internet needed); ``--text embedded``: the small corpus embedded in mcore-train.
* ``--model demo``: the ~1M-parameter demo Llama (seq 128); ``--model medium`` (default on CUDA): a 110M Llama
  (hidden 1024, 8 layers, FFN 2816, seq 1024, batch 16), every linear a multiple of 128 so all recipes apply.

::

    python benchmarks/low_precision_convergence.py --device cuda --steps 500 --out $OUT/convergence
    python benchmarks/low_precision_convergence.py --steps 300 --model demo --tolerance 0.02 --out DIR   # CPU
    python benchmarks/low_precision_convergence.py --dry-run --out DIR     # 6 steps, the CI test

``--from FILE`` (repeatable) reuses the curves of an earlier run's JSON instead of training those
configurations again (to split the runs over processes and merge them); a configuration ``--only`` names is
trained even when a ``--from`` file holds it (its new curve replaces the old one).

Writes ``DIR/low_precision_convergence.json`` (every loss curve, the text used), ``.md`` and ``.png`` (the curves,
when matplotlib imports); exits 1 when a recipe misses the tolerance.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from _common import RunSpec, markdown_table, run_spec, write_json

# name -> overrides on top of the model
CONFIGS: dict[str, list[str]] = {
    "baseline": [],
    "fp8-tensorwise": ["train.precision=fp8", "fp8.recipe=tensorwise"],
    # tensor-wise with the "hybrid" e5m2 gradients (its default until session 9; e4m3 measured closer to bf16)
    "fp8-tensorwise-e5m2": ["train.precision=fp8", "fp8.recipe=tensorwise", "fp8.grad_format=e5m2"],
    "fp8-delayed": ["train.precision=fp8", "fp8.recipe=delayed"],
    "fp8-rowwise": ["train.precision=fp8", "fp8.recipe=rowwise"],
    "fp8-blockwise": ["train.precision=fp8", "fp8.recipe=blockwise"],
    # e5m2 gradients: cuBLAS's block-scaled GEMMs refuse them, mcore's Triton block-scaled GEMM runs them
    "fp8-blockwise-e5m2": ["train.precision=fp8", "fp8.recipe=blockwise", "fp8.grad_format=e5m2"],
    "fp8-mxfp8": ["train.precision=fp8", "fp8.recipe=mxfp8"],
    "fp4-mxfp4": ["train.precision=fp4", "fp4.recipe=mxfp4"],
    "fp4-nvfp4": ["train.precision=fp4", "fp4.recipe=nvfp4"],
    # Megatron's precision-aware optimizer (fp32 master weights kept): bf16 gradients and Adam moments, the
    # optimizer-state policy the MoE rows of docs/performance.md are measured with besides fp32
    "bf16-optimizer-states": [
        "optim.main_grads_dtype=bf16",
        "optim.exp_avg_dtype=bf16",
        "optim.exp_avg_sq_dtype=bf16",
    ],
}
MEDIUM = {
    "model_type": "llama",
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "vocab_size": 259,
    "max_position_embeddings": 1024,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
    "make_vocab_size_divisible_by": 64,
}
MODEL_DATA = {"demo": ["data.seq_length=128"], "medium": ["data.seq_length=1024", "train.global_batch_size=16"]}


def build_spec(
    name: str, steps: int, device: str, model: str, data_path: str | None, seed: int | None = None
) -> RunSpec:
    from mcore.train.config import DEMO_MODEL

    overrides = [
        *([f"train.seed={seed}"] if seed is not None else []),
        "data.mock=false",  # real text, not mock tokens
        f"train.device={device}",
        f"train.steps={steps}",
        f"lr.warmup_steps={min(50, max(1, steps // 10))}",
        "train.eval_interval=0",
        *MODEL_DATA[model],
        *CONFIGS[name],
    ]
    if data_path is not None:
        overrides.append(f"data.path={data_path}")
    return RunSpec(name, 1, overrides, dict(DEMO_MODEL if model == "demo" else MEDIUM))


def summarize(results: dict[str, dict[str, Any]], tail: int, tolerance: float) -> dict[str, Any]:
    def final(name: str) -> float:
        return statistics.fmean(results[name]["losses"][-tail:])

    if "baseline" not in results:
        return {}
    base = final("baseline")
    rows = {}
    for name, result in results.items():
        value = final(name)
        rel = (value - base) / base
        rows[name] = {
            "final_loss": value,
            "relative_to_baseline": rel,
            "passes": name == "baseline" or abs(rel) <= tolerance,
            "step_s": result["step_s"],
            "precision": result["precision"],
            "peak_mem_gb": result.get("peak_mem_gb"),
        }
    return rows


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--tail", type=int, default=20, help="final loss: mean of the last TAIL steps")
    parser.add_argument("--tolerance", type=float, default=0.01)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--model", choices=tuple(MODEL_DATA), default=None, help="default: medium on cuda, else demo")
    parser.add_argument("--text", choices=("stdlib", "embedded"), default="stdlib")
    parser.add_argument("--text-mb", type=float, default=32.0, help="stdlib text: at most this many MB")
    parser.add_argument("--only", default=None, help="comma-separated configurations (baseline is always run)")
    parser.add_argument("--dry-run", action="store_true", help="6 steps, tail 2, 0.2 MB of text, no tolerance check")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--from", dest="sources", type=Path, action="append", default=[], help="reuse these results")
    parser.add_argument("--skip-baseline", action="store_true", help="do not train the baseline here")
    parser.add_argument(
        "--seed",
        type=int,
        default=None,
        help="train.seed of every run (initial weights; default the config's): one run's final loss moves by a few "
        "percent with it (CPU demo, 500 steps: the baseline 1.5609 / 1.5309 / 1.6060 at seeds 1234 / 1 / 2)",
    )
    args = parser.parse_args(argv)
    if args.dry_run:
        args.steps, args.tail, args.text_mb = 6, 2, 0.2
    args.model = args.model or ("medium" if args.device == "cuda" and not args.dry_run else "demo")
    names = list(CONFIGS) if args.only is None else ["baseline", *[n for n in args.only.split(",") if n != "baseline"]]
    if args.skip_baseline:
        names.remove("baseline")
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        parser.error(f"unknown configuration(s) {unknown}; known: {list(CONFIGS)}")
    args.names = names
    args.explicit = set(names) - {"baseline"} if args.only is not None else set()
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results: dict[str, dict[str, Any]] = {}
    source_text = None  # the text the reused curves were trained on (kept when nothing is trained here)
    for source in args.sources:
        previous = json.loads(source.read_text())
        source_text = source_text or previous.get("text")
        for name, curve in previous["curves"].items():
            # "runs" holds step time and precision; files of the first version kept them in "summary" only
            old = previous.get("runs", previous["summary"])[name]
            results[name] = {"losses": curve, "step_s": old["step_s"], "precision": old["precision"]}
    data_path, args.text_info = None, {"text": "the corpus embedded in mcore-train, byte tokenizer"}
    to_train = [n for n in args.names if n not in results or n in args.explicit]
    if not to_train and source_text is not None:  # a merge of earlier runs: their text, no corpus built
        args.text_info = source_text
    elif args.text == "stdlib":
        from real_text import build_corpus

        # the tokenized text (tens of MB) goes to a temporary directory, not beside the results
        text_dir = Path(tempfile.mkdtemp(prefix="mcore-text-"))
        data_path, args.text_info = build_corpus(text_dir, int(args.text_mb * 2**20))
    for name in to_train:  # what --from holds is reused, except what --only names
        result, runtime = run_spec(build_spec(name, args.steps, args.device, args.model, data_path, args.seed))
        runtime.shutdown()
        results[name] = result
        print(f"[{name}] loss after {args.steps} steps {result['final_loss']:.4f}, {result['step_s']:.3f} s/step")
        write_outputs(args, results)
    rows = write_outputs(args, results)
    failed = [n for n, r in rows.items() if not r["passes"]]
    if failed and not args.dry_run:
        print(f"outside {100 * args.tolerance:.0f}% of the baseline: {failed}", file=sys.stderr)
        return 1
    return 0


def write_outputs(args: argparse.Namespace, results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Rewrite the JSON, the markdown table and the plot from ``results``; returns the summary rows."""
    rows = summarize(results, args.tail, args.tolerance)
    data = {"steps": args.steps, "tail": args.tail, "tolerance": args.tolerance, "model": args.model, "seed": args.seed}
    data.update(text=args.text_info, summary=rows, curves={n: r["losses"] for n, r in results.items()})
    data["runs"] = {n: {"step_s": r["step_s"], "precision": r["precision"]} for n, r in results.items()}
    write_json(args.out / "low_precision_convergence.json", data)
    table = markdown_table(
        ["configuration", "precision", f"final loss (mean of last {args.tail})", "vs baseline", "s/step", "peak GB"],
        [
            [n, r["precision"], f"{r['final_loss']:.4f}", f"{100 * r['relative_to_baseline']:+.2f}%", r["step_s"]]
            + [r["peak_mem_gb"]]
            for n, r in rows.items()
        ],
    )
    seed = "" if args.seed is None else f", train.seed={args.seed}"
    text = f"Text: {args.text_info['text']}; model {args.model}, {args.steps} steps{seed}.\n\n{table}\n"
    (args.out / "low_precision_convergence.md").write_text(text)
    plot(args.out / "low_precision_convergence.png", results, args.tail)
    print(table, flush=True)
    return rows


def plot(path: Path, results: dict[str, dict[str, Any]], tail: int) -> None:
    """Each configuration's loss curve (a running mean over ``tail`` steps), and the gap to the baseline."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return

    def smooth(values: list[float]) -> list[float]:
        return [statistics.fmean(values[max(0, i - tail + 1) : i + 1]) for i in range(len(values))]

    fig, (curves, gaps) = plt.subplots(1, 2, figsize=(13, 4.5))
    base = smooth(results["baseline"]["losses"]) if "baseline" in results else None
    # one colour per configuration in both panels (the gap panel has no baseline line to shift the cycle)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (name, result) in enumerate(results.items()):
        losses, colour = smooth(result["losses"]), colours[i % len(colours)]
        steps = range(1, len(losses) + 1)
        curves.plot(steps, losses, label=name, linewidth=1, color=colour)
        if base is not None and name != "baseline":
            gap = [100 * (a - b) / b for a, b in zip(losses, base, strict=False)]
            gaps.plot(steps[: len(gap)], gap, label=name, linewidth=1, color=colour)
    curves.set(xlabel="step", ylabel=f"training loss (mean of {tail} steps)", title="loss")
    gaps.set(xlabel="step", ylabel="% vs baseline", title="gap to the baseline")
    gaps.axhline(0, color="black", linewidth=0.5)
    curves.legend(fontsize=7)
    gaps.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
