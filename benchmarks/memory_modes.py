"""Memory modes on one GPU: a full Llama-3-8B trained with the optimizer offloaded, and what each mode costs.

Part ``8b`` (with the 8b4l reference, ZeRO-1 without offload, to compare against): the whole Llama-3-8B (32
layers, seq 4096, bf16 compute, fp32 master weights and AdamW states,
untied, micro-batch 1) through ``mcore-train``'s real step on one H200, which cannot hold its ~128 GB of
training state plus activations: ``optim.offload_fraction`` keeps a share of the masters and moments in host
memory (stepped by the CPU), with full recompute or activation offload for the activations. Then the Hugging Face
baseline (``hf_baseline.py``'s step, its ``8b4l`` shape with all 32 layers) in its own process, which runs out of
memory: its out-of-memory error and the memory it held are the record.

Part ``8b4l``: the cost of each mode on the ``8b4l`` shape of ``train_throughput.py`` (4 layers, micro-batch 2,
one micro-batch per step): ZeRO-1 at dp=1 as the reference, ``parallel.dp_shard`` (FSDP2) at world size 1 with its
``auto`` settings (layers kept gathered from forward to backward, weight gradients accumulated in fp32 inside the
GEMMs), without that fusion (``dp_shard_no_fusion``: FSDP's cast and copies of each gradient) and with every layer
resharded after its forward (``dp_shard_reshard``: what a re-gather costs at one rank), the optimizer offloaded
at 25% and 100%, activation offload of attention+MLP and of whole layers, selective and full recompute.
``--profile-steps 1`` adds one step under the CUDA profiler per configuration: where the step's GPU time goes
(``step_profile.py``'s categories; FSDP's casts and copies are ``copy/cast``), in the summary and in
``profiles.md``.

Every configuration runs in its own process (memory statistics do not mix); per configuration: tokens/s, MFU,
peak GPU memory (``max_memory_allocated``) and peak host memory (the process's peak RSS), the losses. The summary
gives each 8b4l mode's tokens/s relative to the reference, and the 8B run's tokens/s per layer and MFU relative
to the reference's (the issue's target: >= 70%).

::

    python benchmarks/memory_modes.py --part 8b --out DIR --hf-baseline .bench/hf_baseline.py   # ~7 min
    python benchmarks/memory_modes.py --part 8b4l --out DIR                                      # ~6 min
    python benchmarks/memory_modes.py --part 8b4l --configs 8b4l_zero1,8b4l_dp_shard --profile-steps 1 --out DIR
    python benchmarks/memory_modes.py --dry-run --out DIR      # CPU, tiny fp32 shape, both parts, ~1 min
"""

from __future__ import annotations

import argparse
import json
import resource
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
    read_plan,
    report_launch,
    result_path,
    run_spec,
    write_json,
    write_plan,
)

# name -> overrides on top of the shape's run: the cost of each mode on 8b4l (the first is the reference)
MODES_8B4L = {
    "zero1": [],
    "dp_shard": ["parallel.distributed_optimizer=false", "parallel.dp_shard=true"],
    "dp_shard_no_fusion": [
        "parallel.distributed_optimizer=false",
        "parallel.dp_shard=true",
        "parallel.gradient_accumulation_fusion=false",
    ],
    "dp_shard_reshard": [
        "parallel.distributed_optimizer=false",
        "parallel.dp_shard=true",
        "parallel.dp_shard_reshard_after_forward=true",
    ],
    "optim_offload_0.25": ["optim.offload_fraction=0.25"],
    "optim_offload_1.0": ["optim.offload_fraction=1.0"],
    "act_offload_attn_mlp": ["train.activation_offload=[attention,mlp]"],
    "act_offload_layer": ["train.activation_offload=[layer]"],
    "recompute_selective": ["train.recompute=selective"],
    "recompute_full": ["train.recompute=full"],
}
# the full 8B: 32 micro-batches of 4096 tokens per step, so that the CPU step is shared by 131k tokens
MODES_8B = {
    # what `mcore-train plan` names the fastest mode that fits (125 GB predicted): no recompute, half offloaded
    "optim_offload_0.5": ["optim.offload_fraction=0.5"],
    "optim_offload_0.35": ["optim.offload_fraction=0.35"],
    "optim_offload_0.5_act_offload_mlp": [
        "optim.offload_fraction=0.5",
        "train.recompute=selective",
        "train.activation_offload=[mlp]",
    ],
}


def _shape(part: str, dry_run: bool) -> dict[str, int]:
    if dry_run:
        return dict(SHAPES["tiny"])
    shape = dict(SHAPES["8b4l"])
    if part == "8b":
        shape.update(layers=32, mbs=1)
    return shape


def build_specs(part: str, *, steps: int, dry_run: bool, profile_steps: int = 0) -> list[RunSpec]:
    """The configurations of one part (``8b`` or ``8b4l``), validated by the caller with ``check_spec``;
    ``profile_steps`` of each configuration's ``steps`` (the last ones) run under the CUDA profiler, untimed."""
    shape = _shape(part, dry_run)
    microbatches = 32 if part == "8b" and not dry_run else 1
    base = [
        f"train.device={'cpu' if dry_run else 'cuda'}",
        f"train.precision={'fp32' if dry_run else 'bf16'}",
        "parallel.distributed_optimizer=true",
        f"data.seq_length={shape['seq']}",
        f"train.micro_batch_size={shape['mbs']}",
        f"train.global_batch_size={shape['mbs'] * microbatches}",
        f"train.steps={steps}",
        "lr.schedule=constant",
        "lr.max_lr=1e-4",
        "lr.min_lr=1e-4",
        "lr.warmup_steps=0",
    ]
    modes = MODES_8B if part == "8b" else MODES_8B4L
    untimed = min(2, steps - 1)
    specs = [
        RunSpec(f"{part}_{name}", 1, base + extra, llama_model(shape), untimed, profile_steps=profile_steps)
        for name, extra in modes.items()
    ]
    if part == "8b":  # the 8b4l reference in the same call, to compare against (a device call starts empty)
        ref_steps = steps if dry_run else 8
        specs.insert(0, build_specs("8b4l", steps=ref_steps, dry_run=dry_run, profile_steps=profile_steps)[0])
    return specs


# ----------------------------------------------------------------------------------------------- workers
def run_worker(plan: Path, name: str, work: Path) -> None:
    """Measure one configuration in this process and write its record (with host memory and offload counts)."""
    (spec,) = read_plan(plan, [name])
    result, runtime = run_spec(spec)
    result["peak_host_mem_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9
    result["overrides"] = spec.overrides
    write_json(result_path(work, spec.name), result)
    runtime.shutdown()


def run_hf_oom(hf_baseline: Path, out: Path, iters: int) -> None:
    """``hf_baseline.py``'s training step on the whole Llama-3-8B (its 8b4l shape, 32 layers), expected to run out
    of memory: write what happened (the error, how far it got, the memory held) instead of failing."""
    import importlib.util

    import torch

    spec = importlib.util.spec_from_file_location("hf_baseline", hf_baseline)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.SHAPES["8b"] = {**module.SHAPES["8b4l"], "layers": 32}
    sys.argv = ["hf_baseline.py", "--shape", "8b", "--iters", str(iters), "--json", str(out.with_suffix(".run.json"))]
    record: dict[str, Any] = {"impl": "hf", "shape": "8b (8b4l with 32 layers)", "gpu": torch.cuda.get_device_name()}
    try:
        module.main()
        record["oom"] = False
        record["result"] = json.loads(out.with_suffix(".run.json").read_text())
    except torch.cuda.OutOfMemoryError as exc:
        record["oom"] = True
        record["error"] = str(exc).splitlines()[0]
    record["peak_mem_gb"] = torch.cuda.max_memory_allocated() / 1e9
    record["total_mem_gb"] = torch.cuda.get_device_properties(0).total_memory / 1e9
    write_json(out, record)


# ----------------------------------------------------------------------------------------------- orchestration
def summarize(results: dict[str, dict | None], hf: dict | None) -> dict[str, Any]:
    """Each mode against its part's reference, and the 8B run against the 8b4l reference per layer."""
    ref = results.get("8b4l_zero1")
    rows, relative = [], {}
    for name, res in results.items():
        if res is None:
            rows.append([name, None, None, None, None, None, "failed"])
            continue
        rel = res["tokens_per_s"] / ref["tokens_per_s"] if ref else None
        if name.startswith("8b_") and ref:
            per_layer = res["tokens_per_s"] * 32 / (ref["tokens_per_s"] * 4)
            relative[name] = {"tokens_per_s_per_layer_vs_8b4l": per_layer, "mfu_vs_8b4l": res["mfu"] / ref["mfu"]}
            rel = per_layer  # the target: >= 0.7
        elif ref:
            relative[name] = {"tokens_per_s_vs_zero1": rel}
        rows.append([name, res["tokens_per_s"], 100 * res["mfu"], res["peak_mem_gb"], res["peak_host_mem_gb"], rel, ""])
    if hf is not None:
        note = f"out of memory ({hf.get('error', '')[:60]})" if hf.get("oom") else "ran"
        rows.append(["hf_8b", None, None, hf["peak_mem_gb"], None, None, note])
    headers = ["config", "tokens/s", "MFU %", "peak GPU GB", "peak host GB", "vs 8b4l_zero1 (8b: per layer)", "note"]
    return {"results": results, "hf_8b": hf, "relative": relative, "markdown": markdown_table(headers, rows)}


def render_profiles(results: dict[str, dict | None]) -> str:
    """Each profiled configuration's step breakdown (``step_profile.render_breakdown``), as markdown."""
    from step_profile import render_breakdown

    parts = []
    for name, res in results.items():
        for rank, breakdown in enumerate((res or {}).get("profile") or []):
            parts.append(f"## {name} (rank {rank})\n\n{render_breakdown(breakdown)}\n")
    return "\n".join(parts)


def orchestrate(args: argparse.Namespace) -> int:
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    parts = ["8b4l", "8b"] if args.dry_run or args.part == "all" else [args.part]
    specs = {
        s.name: s
        for part in parts
        for s in build_specs(part, steps=args.steps, dry_run=args.dry_run, profile_steps=args.profile_steps)
    }
    specs = [s for s in specs.values() if not args.configs or s.name in args.configs]  # the 8b4l reference once
    unknown = sorted(set(args.configs or ()) - {s.name for s in specs})
    if unknown:
        raise SystemExit(f"--configs: no configuration(s) {unknown} in part(s) {parts}")
    for spec in specs:
        check_spec(spec)
    work = Path(tempfile.mkdtemp(prefix="memory_modes_"))
    plan = write_plan(work, specs)
    env = child_env(dry_run=args.dry_run)
    log = out / "memory_modes.log"
    log.unlink(missing_ok=True)
    summary_path = out / "summary.json"
    results: dict[str, dict | None] = {}
    hf = None
    failures = []
    for spec in specs:
        print(f"running {spec.name}", flush=True)
        argv = ["--worker", "--plan", str(plan), "--name", spec.name, "--work", str(work)]
        launch = launch_workers(Path(__file__), 1, argv, names=[spec.name], log_path=log, env=env, timeout_s=900)
        report_launch(launch)
        path = result_path(work, spec.name)
        results[spec.name] = json.loads(path.read_text()) if launch.returncode == 0 and path.is_file() else None
        if results[spec.name] is None:
            failures.append(spec.name)
        write_json(summary_path, summarize(results, hf))
    if "8b" in parts and not args.dry_run and not args.skip_baseline:
        print("running the Hugging Face baseline on the full 8B (expected: out of memory)", flush=True)
        hf_out = work / "hf_8b.json"
        argv = ["--hf-oom", str(args.hf_baseline), "--json", str(hf_out)]
        launch = launch_workers(Path(__file__), 1, argv, names=["hf_8b"], log_path=log, env=env, timeout_s=600)
        report_launch(launch)
        hf = json.loads(hf_out.read_text()) if hf_out.is_file() else {"oom": None, "peak_mem_gb": None}
    summary = summarize(results, hf)
    write_json(summary_path, summary)
    print(summary["markdown"], flush=True)
    if args.profile_steps:
        profiles = render_profiles(results)
        (out / "profiles.md").write_text(profiles)
        print(profiles, flush=True)
    for name in failures:
        print(f"FAILED: {name} (see {log})", flush=True)
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", choices=["8b", "8b4l", "all"], default="all")
    ap.add_argument("--steps", type=int, default=None, help="steps per configuration (8b: 3, 8b4l: 8; dry run 3)")
    ap.add_argument("--out", type=Path, default=None, help="summary.json and the log go here")
    ap.add_argument("--hf-baseline", type=Path, default=DEFAULT_HF_BASELINE)
    ap.add_argument("--skip-baseline", action="store_true")
    ap.add_argument("--configs", type=lambda v: v.split(","), help="only these configurations (comma-separated)")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny fp32 shape, every configuration, no baseline")
    ap.add_argument(
        "--profile-steps", type=int, default=0, help="of each configuration's steps, this many last under the profiler"
    )
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--plan", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--name", help=argparse.SUPPRESS)
    ap.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--hf-oom", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--json", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        run_worker(args.plan, args.name, args.work)
        return 0
    if args.hf_oom:
        run_hf_oom(args.hf_oom, args.json, iters=2)
        return 0
    if args.steps is None:
        args.steps = 3 if args.dry_run or args.part == "8b" else 8
    if args.steps < 2:
        ap.error(f"--steps must be >= 2 (the first step is not timed), got {args.steps}")
    if args.profile_steps < 0 or (args.dry_run and args.profile_steps):
        ap.error(f"--profile-steps must be >= 0 (and 0 in a dry run: the CUDA profiler), got {args.profile_steps}")
    if args.profile_steps and args.steps - min(2, args.steps - 1) - args.profile_steps < 1:
        ap.error(f"--profile-steps {args.profile_steps} leaves no timed step of --steps {args.steps}")
    if args.out is None:
        args.out = Path(tempfile.mkdtemp(prefix="memory_modes_out_"))
    if not args.dry_run and args.part in ("8b", "all") and not args.skip_baseline and not args.hf_baseline.is_file():
        ap.error(f"--hf-baseline: {args.hf_baseline} does not exist (copy ../shared/bench/hf_baseline.py to .bench/)")
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
