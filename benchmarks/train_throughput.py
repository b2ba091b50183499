"""Single-GPU training throughput of mcore-train against the Hugging Face baseline, on the same shapes.

Runs the real ``mcore-train`` training step (the CLI's path: ``load_config`` -> ``init_runtime`` -> ``Trainer``;
the model, the loss, the distributed optimizer at dp=1 and the schedule) on the two shapes of
``hf_baseline.py`` (``1b`` and ``8b4l``: bf16 compute with fp32 master weights and optimizer states, seq 4096,
the same micro-batch, one micro-batch per step, untied embeddings) on mock data, then the baseline (eager, then
``torch.compile``), each in its own process so that memory statistics do not mix. Reported like the baseline:
tokens/s, TFLOP/s/GPU and MFU (model FLOPs: 6 x matmul weights including the output layer, excluding the
embedding, + 12 x layers x hidden x seq; peak 989.4 TFLOP/s), peak memory, first-step time; the step time is the
median of ``--iters`` CUDA-event-timed steps after the first step and ``--warmup`` more.

Differences that remain, by design of the two programs: mcore keeps bf16 parameters and fp32 master weights in
the optimizer (the baseline: fp32 parameters under bf16 autocast); mcore clips gradients at norm 1.0 and decays
weights by 0.1 (the CLI's defaults; the baseline does not clip and its AdamW decays by 0.01), both at a constant
LR of 1e-4; mcore's mock tokens are drawn from the byte tokenizer's 259 ids, the baseline's from the whole
vocabulary (neither changes the work done). mcore's FLOP count leaves out the norm weights, which the baseline
counts (< 0.01% of the FLOPs). ``--compile`` is not offered: mcore's model does not expose regional compilation.

::

    python benchmarks/train_throughput.py --shape all --json-dir DIR   # on one GPU (see benchmarks/README.md)
    python benchmarks/train_throughput.py --dry-run --json-dir DIR     # CPU, tiny fp32 shape, 3 iterations
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from _common import (
    DEFAULT_HF_BASELINE,
    SHAPES,
    RunSpec,
    check_spec,
    child_env,
    launch_workers,
    llama_model,
    markdown_table,
    report_launch,
    run_spec,
    write_json,
)
from step_profile import render_breakdown

GPU_SHAPES = ("1b", "8b4l")
# result file stem -> extra arguments of hf_baseline.py
BASELINES = {"hf": [], "hf-compile": ["--compile"]}


def build_spec(shape_name: str, *, iters: int, warmup: int, dry_run: bool, profile_steps: int = 0) -> RunSpec:
    """The mcore run of one shape: one micro-batch per step (the baseline's tokens per step), dp=1; ``profile_steps``
    more steps after the timed ones under the CUDA profiler."""
    shape = SHAPES[shape_name]
    steps = 1 + warmup + iters + profile_steps
    overrides = [
        f"train.device={'cpu' if dry_run else 'cuda'}",
        f"train.precision={'fp32' if dry_run else 'bf16'}",
        "parallel.distributed_optimizer=true",
        f"data.seq_length={shape['seq']}",
        f"train.micro_batch_size={shape['mbs']}",
        f"train.global_batch_size={shape['mbs']}",
        f"train.steps={steps}",
        "lr.schedule=constant",
        "lr.max_lr=1e-4",
        "lr.min_lr=1e-4",
        "lr.warmup_steps=0",
    ]
    return RunSpec(
        f"mcore_{shape_name}", 1, overrides, llama_model(shape), untimed_steps=1 + warmup, profile_steps=profile_steps
    )


def run_ours(args: argparse.Namespace) -> int:
    """``--only mcore``: measure one shape in this process and write its JSON (the baseline's keys first)."""
    spec = build_spec(
        args.shape, iters=args.iters, warmup=args.warmup, dry_run=args.dry_run, profile_steps=args.profile_steps
    )
    result, runtime = run_spec(spec)
    runtime.shutdown()
    shape = SHAPES[args.shape]
    record = {
        "impl": "mcore" + ("-dryrun" if args.dry_run else ""),
        "shape": args.shape,
        **shape,
        "params": result["params"],
        "tokens_per_s": result["tokens_per_s"],
        "step_s": result["step_s"],
        "tflops_per_gpu": result["tflops_per_gpu"],
        "mfu": result["mfu"],
        "peak_mem_gb": result["peak_mem_gb"],
        "first_step_s": result["first_step_s"],
        "gpu": result["gpu"],
        "torch": result["torch"],
        "precision": result["precision"],
        "optimizer": "DistributedOptimizer (dp=1), fp32 master weights and AdamW states",
        "flops_per_token": result["flops_per_token"],
        "iters": args.iters,
        "warmup": args.warmup,
        "step_times_s": result["step_times_s"],
        "losses": result["losses"],
        "profile": result["profile"][0] if result["profile"] else None,
    }
    write_json(args.json, record)
    if record["profile"]:
        print(render_breakdown(record["profile"]), flush=True)
    print(json.dumps({k: record[k] for k in ("impl", "shape", "tokens_per_s", "tflops_per_gpu", "mfu", "peak_mem_gb")}))
    return 0


def ratios(results: dict[str, dict[str, Any] | None]) -> dict[str, float | None]:
    """ours / baseline for tokens/s and peak memory (``None`` where a run is missing)."""

    def ratio(key: str, other: str) -> float | None:
        a, b = results.get("mcore"), results.get(other)
        if a is None or b is None or not b.get(key):
            return None
        return a[key] / b[key]

    return {
        "tokens_per_s_vs_hf": ratio("tokens_per_s", "hf"),
        "tokens_per_s_vs_hf_compile": ratio("tokens_per_s", "hf-compile"),
        "peak_mem_vs_hf": ratio("peak_mem_gb", "hf"),
        "peak_mem_vs_hf_compile": ratio("peak_mem_gb", "hf-compile"),
    }


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def render(summary: dict[str, Any]) -> str:
    """A markdown table of every run, then the ratios per shape."""
    rows, ratio_lines = [], []
    for shape, entry in summary["shapes"].items():
        for label, res in entry["results"].items():
            if res is None:
                rows.append([shape, label, None, None, None, None, None, None, "did not run"])
                continue
            rows.append(
                [
                    shape,
                    res["impl"],
                    res["tokens_per_s"],
                    1000 * res["step_s"],
                    res["tflops_per_gpu"],
                    100 * res["mfu"],
                    res["peak_mem_gb"],
                    res["first_step_s"],
                    "",
                ]
            )
        r = entry["ratios"]
        ratio_lines.append(
            f"- {shape}: tokens/s mcore/HF-eager {_fmt(r['tokens_per_s_vs_hf'])}, mcore/HF-compile "
            f"{_fmt(r['tokens_per_s_vs_hf_compile'])}; peak memory mcore/HF-eager {_fmt(r['peak_mem_vs_hf'])}, "
            f"mcore/HF-compile {_fmt(r['peak_mem_vs_hf_compile'])}"
        )
    headers = ["shape", "impl", "tokens/s", "step ms", "TFLOP/s/GPU", "MFU %", "peak GB", "first step s", "note"]
    return "\n".join([markdown_table(headers, rows), "", *ratio_lines])


def _runs(args: argparse.Namespace, shape: str, out: Path) -> list[tuple[str, list[str]]]:
    """(label, script and arguments) of each run of ``shape``: ours first, then the baselines."""
    ours = [str(Path(__file__).resolve()), "--only", "mcore", "--shape", shape, "--iters", str(args.iters)]
    ours += ["--warmup", str(args.warmup), "--profile-steps", str(args.profile_steps)]
    ours += ["--json", str(out / f"mcore_{shape}.json")]
    runs = [("mcore", ours + (["--dry-run"] if args.dry_run else []))]
    if args.skip_baseline or args.dry_run:
        return runs
    for label, extra in BASELINES.items():
        if label == "hf-compile" and args.skip_hf_compile:
            continue
        argv = [str(args.hf_baseline), "--shape", shape, *extra, "--iters", str(args.iters)]
        runs.append((label, argv + ["--json", str(out / f"{label}_{shape}.json")]))
    return runs


def orchestrate(args: argparse.Namespace) -> int:
    """Ours, then the baselines, one process each and one after another, per shape; the summary is rewritten
    after every run (a device call cut short still returns what finished)."""
    out: Path = args.json_dir
    out.mkdir(parents=True, exist_ok=True)
    shapes = ["tiny"] if args.dry_run else (list(GPU_SHAPES) if args.shape == "all" else [args.shape])
    skip_baseline = args.skip_baseline or args.dry_run
    if not skip_baseline and not args.hf_baseline.is_file():
        raise SystemExit(f"--hf-baseline: {args.hf_baseline} does not exist; pass the path of hf_baseline.py")
    if not skip_baseline and args.warmup != 2:
        print(f"note: hf_baseline.py always warms up 2 steps; mcore warms up {args.warmup}", flush=True)
    for shape in shapes:
        spec = build_spec(
            shape, iters=args.iters, warmup=args.warmup, dry_run=args.dry_run, profile_steps=args.profile_steps
        )
        check_spec(spec)
    env = child_env(dry_run=args.dry_run)
    summary: dict[str, Any] = {"shapes": {}, "failures": []}
    # One log for every run: a device call returns at most 8 files (6 JSON, the summary and this).
    log = out / "throughput.log"
    log.unlink(missing_ok=True)
    for shape in shapes:
        results: dict[str, dict[str, Any] | None] = {}
        for label, argv in _runs(args, shape, out):
            json_path = out / f"{label}_{shape}.json"
            json_path.unlink(missing_ok=True)
            print(f"running {label} on {shape}", flush=True)
            launch = launch_workers(
                Path(argv[0]), 1, argv[1:], names=[json_path.stem], log_path=log, env=env, timeout_s=args.timeout
            )
            report_launch(launch)
            ok = launch.returncode == 0 and json_path.is_file()
            results[label] = json.loads(json_path.read_text()) if ok else None
            if results[label] is None:
                summary["failures"].append(f"{label} on {shape}: exit {launch.returncode} (log {launch.log})")
            summary["shapes"][shape] = {
                "results": results,
                "ratios": ratios(results),
                "baseline": "skipped" if skip_baseline else str(args.hf_baseline),
            }
            write_json(out / "summary.json", {**summary, "markdown": render(summary)})
    print(render(summary), flush=True)
    for failure in summary["failures"]:
        print(f"FAILED: {failure}", flush=True)
    return 1 if summary["failures"] else 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=[*GPU_SHAPES, "all", "tiny"], default="all", help="shape(s) to run (all)")
    ap.add_argument("--iters", type=int, default=None, help="timed steps (8, as hf_baseline.py; dry run 3)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps after the first (2; dry run 1)")
    ap.add_argument(
        "--profile-steps",
        type=int,
        default=None,
        help="steps after the timed ones run under the CUDA profiler for the time breakdown (2; dry run 0)",
    )
    ap.add_argument("--skip-baseline", action="store_true", help="run mcore only")
    ap.add_argument("--skip-hf-compile", action="store_true", help="run the baseline eager only")
    ap.add_argument("--hf-baseline", type=Path, default=DEFAULT_HF_BASELINE, help="path of hf_baseline.py")
    ap.add_argument("--json-dir", type=Path, default=None, help="where the JSON files go (default: a temp dir)")
    ap.add_argument("--json", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--only", choices=["mcore"], help=argparse.SUPPRESS)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per run (600)")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny fp32 shape, 3 iterations, no baseline")
    args = ap.parse_args(argv)
    args.iters = args.iters if args.iters is not None else (3 if args.dry_run else 8)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.dry_run else 2)
    args.profile_steps = args.profile_steps if args.profile_steps is not None else (0 if args.dry_run else 2)
    if args.dry_run and args.profile_steps:
        ap.error("--profile-steps needs a GPU (the breakdown reads CUDA kernels); leave it out of dry runs")
    if args.profile_steps < 0:
        ap.error(f"--profile-steps must be >= 0, got {args.profile_steps}")
    if args.iters < 1 or args.warmup < 0:
        ap.error(f"--iters must be >= 1 and --warmup >= 0, got {args.iters} and {args.warmup}")
    if args.only and (args.json is None or args.shape == "all"):
        ap.error("--only mcore needs --json FILE and one --shape")
    if args.shape == "tiny" and not (args.dry_run or args.only):
        ap.error("--shape tiny is the dry-run shape; use --dry-run")
    if args.json_dir is None and not args.only:
        args.json_dir = Path(tempfile.mkdtemp(prefix="mcore-throughput-"))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return run_ours(args) if args.only else orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
