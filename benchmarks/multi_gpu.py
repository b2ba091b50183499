"""Two-GPU benchmark and NCCL correctness check of mcore-train: tp=2, pp=2, dp=2 against one GPU.

One run on a machine with 2 GPUs trains the same GPT (default: the Llama-3-8B layer shape with 4 layers, bf16,
seq 4096, micro-batch 2, 8 micro-batches of the global batch) for ``--steps`` steps in each configuration:

- ``single``: one GPU, the reference (8 micro-batches per step);
- ``single-half-batch``: one GPU at half the global batch (the per-GPU batch of a dp=2 rank), for scaling only;
- ``tp2``, ``tp2-sp``: tensor parallelism, without and with sequence parallelism;
- ``pp2-1f1b``, ``pp2-vpp2-interleaved``, ``pp2-zero-bubble``: pipeline parallelism (8 micro-batches);
- ``dp2``, ``dp2-overlap``, ``dp2-distopt``, ``dp2-distopt-overlap``: data parallelism with the plain or the
  distributed optimizer, without and with overlapping the gradient reduction with backward (4 micro-batches
  per rank: the same global batch); ``dp2-distopt-overlap-all`` also overlaps the parameter all-gather with
  the next forward.

Every configuration runs in its own process group (``torch.distributed.run``; NVLS/multicast off), through the
real ``Trainer``, on the same seed and data. It reports tokens/s, TFLOP/s/GPU, MFU, peak memory and the loss
after the last step, and checks that each 2-GPU loss curve matches the single-GPU one (same global batch) over
the first ``--compare-steps`` steps (relative 1e-2 at every step and the same trend in bf16, 1e-4 in fp32); it
exits non-zero when a check fails or a configuration did not run. Scaling efficiency: for dp=2, weak scaling
(the step time of ``single-half-batch`` over the dp=2 step time: same per-GPU batch); for tp=2 and pp=2, strong
scaling (the 1-GPU step time at the same global batch over twice the step time), with the schedule's theoretical
bubble beside it.

::

    python benchmarks/multi_gpu.py --out DIR                      # on 2 GPUs (see benchmarks/README.md)
    python benchmarks/multi_gpu.py --shape small --precision fp32 --out DIR   # fp32 smoke run, tolerance 1e-4
    python benchmarks/multi_gpu.py --dry-run --out DIR            # CPU, gloo, world size 2, tiny fp32 model
    python benchmarks/multi_gpu.py --report DIR [DIR ...] --out DIR2   # re-check and re-report saved results
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from _common import (
    SHAPES,
    RunSpec,
    add_orchestrator_arguments,
    compare_loss_curves,
    curve,
    default_rtol,
    llama_model,
    load_reported,
    markdown_table,
    orchestrate,
    parse_names,
    resolve_orchestrator_arguments,
    worker_main,
    write_report,
)

REFERENCE = "single"
# One GPU at the per-GPU batch of a dp=2 rank (half the global batch): the weak-scaling reference of dp=2. Its
# loss curve differs (another batch) and is not checked.
HALF = "single-half-batch"
BALANCED = "parallel.pipeline_layout=balanced"
# name -> (world size, parallel overrides)
CONFIGS: dict[str, tuple[int, list[str]]] = {
    REFERENCE: (1, []),
    HALF: (1, []),
    "tp2": (2, ["parallel.tp=2", "parallel.dp=1"]),
    "tp2-sp": (2, ["parallel.tp=2", "parallel.dp=1", "parallel.sequence_parallel=true"]),
    # The pipeline runs use the balanced layout: the last stage also carries the output layer (for 8b4l, with its
    # 128k vocabulary, ~2 layers' worth of FLOPs), so an even split of 4 layers leaves rank 0 idle half the time.
    "pp2-1f1b": (2, ["parallel.pp=2", "parallel.dp=1", "parallel.schedule=1f1b", BALANCED]),
    "pp2-vpp2-interleaved": (
        2,
        ["parallel.pp=2", "parallel.vpp=2", "parallel.dp=1", "parallel.schedule=interleaved", BALANCED],
    ),
    "pp2-zero-bubble": (2, ["parallel.pp=2", "parallel.dp=1", "parallel.schedule=zero-bubble", BALANCED]),
    "dp2": (2, ["parallel.dp=2", "parallel.overlap_grad_reduce=false"]),
    "dp2-overlap": (2, ["parallel.dp=2", "parallel.overlap_grad_reduce=true"]),
    "dp2-distopt": (2, ["parallel.dp=2", "parallel.distributed_optimizer=true", "parallel.overlap_grad_reduce=false"]),
    "dp2-distopt-overlap": (
        2,
        ["parallel.dp=2", "parallel.distributed_optimizer=true", "parallel.overlap_grad_reduce=true"],
    ),
    # both overlaps: the gradient reduce-scatter behind backward, the parameter all-gather behind the next forward
    "dp2-distopt-overlap-all": (
        2,
        [
            "parallel.dp=2",
            "parallel.distributed_optimizer=true",
            "parallel.overlap_grad_reduce=true",
            "parallel.overlap_param_gather=true",
        ],
    ),
}


def build_specs(args: argparse.Namespace, names: list[str]) -> list[RunSpec]:
    """The run spec of each configuration in ``names`` (same model, seed, data and global batch)."""
    shape = SHAPES[args.shape]
    # pp=2 x vpp=2 needs the layers to split into 4 chunks; the dry-run shape has 2 layers otherwise.
    model = llama_model(shape, num_hidden_layers=max(4, shape["layers"]))
    lr = ["lr.warmup_steps=1"] if args.dry_run else [f"lr.warmup_steps={max(1, args.steps // 4)}", "lr.max_lr=3e-4"]
    common = [
        f"train.device={'cpu' if args.dry_run else 'cuda'}",
        f"train.precision={args.precision}",
        f"data.seq_length={shape['seq']}",
        f"train.micro_batch_size={shape['mbs']}",
        f"train.global_batch_size={shape['mbs'] * args.micro_batches}",
        f"train.steps={args.steps + args.profile_steps}",
        "lr.min_lr=3e-5",
        *lr,
    ]
    half = [f"train.global_batch_size={shape['mbs'] * args.micro_batches // 2}"]
    return [
        RunSpec(
            name,
            CONFIGS[name][0],
            [*common, *CONFIGS[name][1], *(half if name == HALF else [])],
            model,
            untimed_steps=args.untimed_steps,
            profile_steps=args.profile_steps,
        )
        for name in names
    ]


def evaluate(results: dict[str, dict[str, Any]], expected: list[str], rtol: float, compare_steps: int) -> dict:
    """Loss-curve checks against the single-GPU run, scaling, and what is missing."""
    checks: dict[str, Any] = {}
    missing = [n for n in expected if n not in results]
    ref = results.get(REFERENCE)
    for name in expected:
        if name in (REFERENCE, HALF) or name not in results:
            continue
        if ref is None:
            checks[name] = {"ok": False, "problems": [f"the reference '{REFERENCE}' did not run"]}
            continue
        check = compare_loss_curves(curve(ref), curve(results[name]), rtol=rtol, max_steps=compare_steps)
        checks[name] = check.to_dict()
    scaling = {name: _scaling(name, res, results) for name, res in results.items() if res["world_size"] > 1}
    ok = not missing and all(c["ok"] for c in checks.values())
    return {"ok": ok, "rtol": rtol, "reference": REFERENCE, "missing": missing, "checks": checks, "scaling": scaling}


def _scaling(name: str, res: dict[str, Any], results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Data parallelism: weak scaling, the 1-GPU step time at the same per-GPU batch over this step time. Tensor and
    pipeline parallelism: strong scaling, the 1-GPU speed-up at the same global batch over the GPU count."""
    weak = res["layout"]["dp"] > 1
    base = results.get(HALF if weak else REFERENCE)
    if base is None:
        return {"kind": "weak" if weak else "strong", "efficiency": None, "note": "its 1-GPU reference did not run"}
    ratio = base["step_s"] / res["step_s"]
    if weak:
        return {"kind": "weak", "efficiency": ratio, "reference": HALF}
    return {"kind": "strong", "speedup": ratio, "efficiency": ratio / res["world_size"], "reference": REFERENCE}


def render(results: dict[str, dict[str, Any]], verdict: dict[str, Any], compare_steps: int) -> str:
    """The markdown report: one row per configuration, then the verdict."""
    rows = []
    for name in CONFIGS:
        res = results.get(name)
        if res is None:
            continue
        lay = res["layout"]
        check = verdict["checks"].get(name)
        scale = verdict["scaling"].get(name)
        rows.append(
            [
                name,
                f"{lay['tp']}/{lay['pp']}/{lay['dp']}"
                + (f" vpp{lay['vpp']}" if lay["vpp"] > 1 else "")
                + (f" layers {res['layers_per_stage']}" if res.get("layers_per_stage") else ""),
                res["schedule"],
                res["num_microbatches"],
                res["tokens_per_s"],
                res["tflops_per_gpu"],
                100 * res["mfu"],
                res["peak_mem_gb"],
                1000 * res["step_s"],
                res["final_loss"],
                None if check is None else check.get("max_rel_diff"),
                res["bubble_fraction"],
                {REFERENCE: "reference", HALF: "-"}.get(name, "ok" if check and check["ok"] else "FAIL"),
                None if scale is None else scale["efficiency"],
                None if scale is None else scale["kind"],
            ]
        )
    headers = [
        "config",
        "tp/pp/dp",
        "schedule",
        "micro-batches/rank",
        "tokens/s",
        "TFLOP/s/GPU",
        "MFU %",
        "peak GB",
        "step ms",
        "final loss",
        f"max rel diff vs 1 GPU (first {compare_steps} steps)",
        "bubble (theory)",
        f"loss check (rtol {verdict['rtol']:g})",
        "scaling efficiency",
        "scaling",
    ]
    lines = [markdown_table(headers, rows), ""]
    for name, check in verdict["checks"].items():
        for problem in check["problems"]:
            lines.append(f"- {name}: {problem}")
    if verdict["missing"]:
        lines.append(f"- did not run: {', '.join(verdict['missing'])}")
    lines.append("PASS" if verdict["ok"] else "FAIL")
    profiled = render_profiles(results)
    if profiled:
        lines += ["", profiled]
    return "\n".join(lines)


def render_profiles(results: dict[str, dict[str, Any]]) -> str:
    """One row per configuration and rank from the CUDA-profiler breakdown (ms per step): where the time went."""
    cats = ("gemm", "attention", "communication")
    rows = []
    for name in CONFIGS:
        res = results.get(name)
        for rank, b in enumerate((res or {}).get("profile") or []):
            c = b["categories_ms"]
            other = sum(v for k, v in c.items() if k not in cats)
            rows.append(
                [
                    name,
                    rank,
                    b["step_window_ms"],
                    *(c.get(k, 0.0) for k in cats),
                    b["exposed_communication_ms"],
                    other,
                    b["idle_ms"],
                ]
            )
    if not rows:
        return ""
    headers = ["config", "rank", "step ms", "GEMM", "attention", "comm total", "comm exposed", "other kernels", "idle"]
    return "Time breakdown (CUDA profiler, ms per step, profiled steps after the timed ones)\n\n" + markdown_table(
        headers, rows
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--out", type=Path, default=Path("runs/bench/multi_gpu"), help="where results.json, results.md, launches.log go"
    )
    ap.add_argument("--shape", choices=[s for s in SHAPES if s != "1b"], default=None, help="model shape (8b4l)")
    ap.add_argument("--steps", type=int, default=None, help="steps per configuration (20; dry run 4)")
    ap.add_argument("--micro-batches", type=int, default=None, help="micro-batches per global batch (8; dry run 4)")
    ap.add_argument(
        "--profile-steps", type=int, default=None, help="steps after the timed ones under the CUDA profiler (1; dry 0)"
    )
    add_orchestrator_arguments(ap, dry_run_help="CPU, gloo, world size 2, tiny fp32 model, 4 steps")
    args = ap.parse_args(argv)
    dry = args.dry_run
    if args.shape is None:
        args.shape = "tiny" if dry else "8b4l"
    if args.micro_batches is None:
        args.micro_batches = 4 if dry else 8
    resolve_orchestrator_arguments(ap, args, steps=20, positive=("micro_batches",))
    if args.profile_steps is None:
        args.profile_steps = 0 if dry else 1
    if args.profile_steps < 0 or (dry and args.profile_steps):
        ap.error(f"--profile-steps must be >= 0 and needs a GPU (0 in dry runs), got {args.profile_steps}")
    if args.micro_batches % 2:
        ap.error(f"--micro-batches must be even (dp=2 and pp=2 split them), got {args.micro_batches}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker_main(args.plan, args.configs.split(","), args.work_dir)
        return 0
    names = parse_names(args.configs, list(CONFIGS))
    args.out.mkdir(parents=True, exist_ok=True)

    def publish(results: dict[str, dict[str, Any]], final: bool, expected: list[str]) -> int:
        ref = results.get(REFERENCE)
        rtol = args.rtol if args.rtol is not None else default_rtol(ref["precision"] if ref else args.precision)
        verdict = evaluate(results, expected, rtol, args.compare_steps)
        report = render(results, verdict, args.compare_steps)
        write_report(args.out, {"configs": results, "complete": final, **verdict}, report)
        if final:
            print(report, flush=True)
        return 0 if verdict["ok"] else 1

    if args.report:
        return publish(load_reported(args.report), True, names)
    if REFERENCE not in names:
        names = [REFERENCE, *names]  # every check needs the single-GPU curve
    log = args.out / "launches.log"
    log.unlink(missing_ok=True)
    return orchestrate(
        Path(__file__).resolve(),
        build_specs(args, names),
        work_dir=args.work_dir,
        log_path=log,
        one_launch=args.one_launch,
        dry_run=args.dry_run,
        timeout_s=args.launch_timeout,
        publish=lambda results, final: publish(results, final, names),
    )


if __name__ == "__main__":
    sys.exit(main())
