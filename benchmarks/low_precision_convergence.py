"""The demo model trained in high precision and in every FP8 / FP4 recipe: final losses side by side.

Each configuration is the embedded demo (``mcore-train`` with no config: the ~1M-parameter Llama on the
embedded corpus, byte tokenizer, cosine LR) with ``train.precision`` set to ``fp8`` / ``fp4`` and the recipe
chosen; the baseline is the device's high precision (fp32 on CPU, where the FP8 GEMMs are emulated exactly:
the same fp8 values and scales, multiplied in fp32; bf16 on CUDA, with the real kernels). The final loss is
the mean training loss of the last ``--tail`` steps (one step's loss is one batch's: noisy), and a recipe
passes when it lies within ``--tolerance`` (default 2%) of the baseline's.

::

    python benchmarks/low_precision_convergence.py --steps 300 --out benchmarks/results/low-precision-cpu
    python benchmarks/low_precision_convergence.py --dry-run --out DIR     # 6 steps, the CI test

``--from FILE`` (repeatable) reuses the curves of an earlier run's JSON instead of training those
configurations again (to split the runs over processes and merge them).

Writes ``DIR/low_precision_convergence.json`` (every loss curve) and ``DIR/low_precision_convergence.md``; exits
1 when a recipe misses the tolerance.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from _common import RunSpec, markdown_table, run_spec, write_json

# name -> overrides on top of the demo
CONFIGS: dict[str, list[str]] = {
    "baseline": [],
    "fp8-tensorwise": ["train.precision=fp8", "fp8.recipe=tensorwise"],
    "fp8-delayed": ["train.precision=fp8", "fp8.recipe=delayed"],
    "fp8-rowwise": ["train.precision=fp8", "fp8.recipe=rowwise"],
    "fp8-blockwise": ["train.precision=fp8", "fp8.recipe=blockwise"],
    "fp8-mxfp8": ["train.precision=fp8", "fp8.recipe=mxfp8"],
    "fp4-mxfp4": ["train.precision=fp4", "fp4.recipe=mxfp4"],
    "fp4-nvfp4": ["train.precision=fp4", "fp4.recipe=nvfp4"],
}


def build_spec(name: str, steps: int, device: str) -> RunSpec:
    from mcore.train.config import DEMO_MODEL

    overrides = [
        "data.mock=false",  # the embedded corpus, not mock tokens
        f"train.device={device}",
        f"train.steps={steps}",
        f"lr.warmup_steps={min(20, max(1, steps // 10))}",
        *CONFIGS[name],
    ]
    return RunSpec(name, 1, overrides, dict(DEMO_MODEL))


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
        }
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--tail", type=int, default=20, help="final loss: mean of the last TAIL steps")
    parser.add_argument("--tolerance", type=float, default=0.02)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--only", default=None, help="comma-separated configurations (baseline is always run)")
    parser.add_argument("--dry-run", action="store_true", help="6 steps, tail 2, no tolerance check")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--from", dest="sources", type=Path, action="append", default=[], help="reuse these results")
    parser.add_argument("--skip-baseline", action="store_true", help="do not train the baseline here")
    args = parser.parse_args(argv)
    if args.dry_run:
        args.steps, args.tail = 6, 2
    names = list(CONFIGS) if args.only is None else ["baseline", *[n for n in args.only.split(",") if n != "baseline"]]
    if args.skip_baseline:
        names.remove("baseline")
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        parser.error(f"unknown configuration(s) {unknown}; known: {list(CONFIGS)}")
    results: dict[str, dict[str, Any]] = {}
    for source in args.sources:
        previous = json.loads(source.read_text())
        for name, curve in previous["curves"].items():
            # "runs" holds step time and precision; files of the first version kept them in "summary" only
            old = previous.get("runs", previous["summary"])[name]
            results[name] = {"losses": curve, "step_s": old["step_s"], "precision": old["precision"]}
    for name in names:
        if name in results:
            continue
        result, runtime = run_spec(build_spec(name, args.steps, args.device))
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
    """Rewrite the JSON and the markdown table from ``results``; returns the summary rows."""
    rows = summarize(results, args.tail, args.tolerance)
    data = {"steps": args.steps, "tail": args.tail, "tolerance": args.tolerance, "summary": rows}
    data["curves"] = {n: r["losses"] for n, r in results.items()}
    data["runs"] = {n: {"step_s": r["step_s"], "precision": r["precision"]} for n, r in results.items()}
    write_json(args.out / "low_precision_convergence.json", data)
    table = markdown_table(
        ["configuration", "precision", f"final loss (mean of last {args.tail})", "vs baseline", "s/step"],
        [
            [n, r["precision"], f"{r['final_loss']:.4f}", f"{100 * r['relative_to_baseline']:+.2f}%", r["step_s"]]
            for n, r in rows.items()
        ],
    )
    (args.out / "low_precision_convergence.md").write_text(table + "\n")
    print(table, flush=True)
    return rows


if __name__ == "__main__":
    sys.exit(main())
