"""Eight-GPU 3D-parallel benchmark of mcore-train: Llama-3-8B at several (tp, pp, dp) layouts, plus resharding.

Llama-3-8B (32 layers, vocab 128256) at seq 8192, micro-batch 1, global batch 16, bf16 parameters with fp32
master weights, trained on mock data for ``--steps`` (30) steps with the distributed optimizer and overlapped
gradient reduction at (tp, pp, dp) = (2, 2, 2), (1, 2, 4), (2, 1, 4), and (1, 1, 8) when ``mcore-train plan``'s
memory estimate says it fits ``--gpu-memory`` (141 GB; skipped with the printed estimate otherwise). Each
layout runs in its own process group (``torch.distributed.run``, NVLS/multicast off) through the real
``Trainer``. Reported per layout: tokens/s/GPU, TFLOP/s/GPU, MFU, peak memory (the training steps'; the
checkpoint save's own peak is reported apart).

Checked (non-zero exit otherwise): every layout's losses agree with (2, 2, 2)'s over the first
``--compare-steps`` (20) steps (relative 1e-2 and the same trend in bf16, 1e-4 in fp32), and a checkpoint saved
by (2, 2, 2) after step ``--save-at`` (10) loads at (1, 2, 4) and continues for ``--resume-steps`` (5) steps with
the losses (2, 2, 2) had at those steps.

::

    python benchmarks/eight_gpu.py --out DIR [--configs a,b] [--ckpt-dir /dev/shm/ckpt]   # on 8 GPUs
    python benchmarks/eight_gpu.py --dry-run --out DIR     # CPU, gloo, world size 8, tiny Llama, 4 steps
    python benchmarks/eight_gpu.py --report DIR [DIR ...] --out DIR2   # check results saved by several runs
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from _common import (
    RunSpec,
    add_orchestrator_arguments,
    check_spec,
    compare_loss_curves,
    curve,
    default_rtol,
    load_reported,
    markdown_table,
    orchestrate,
    parse_names,
    resolve_orchestrator_arguments,
    worker_main,
    write_report,
)

WORLD = 8
REFERENCE = "tp2-pp2-dp2"
RESUME = "resume-tp1-pp2-dp4"
OPTIONAL = "tp1-pp1-dp8"  # run only when the memory plan says it fits
LAYOUTS: dict[str, tuple[int, int, int]] = {
    REFERENCE: (2, 2, 2),
    "tp1-pp2-dp4": (1, 2, 4),
    "tp2-pp1-dp4": (2, 1, 4),
    OPTIONAL: (1, 1, 8),
}
CONFIG_NAMES = [*LAYOUTS, RESUME]


def _layout_overrides(tp: int, pp: int, dp: int) -> list[str]:
    return [
        f"parallel.tp={tp}",
        f"parallel.pp={pp}",
        f"parallel.dp={dp}",
        "parallel.distributed_optimizer=true",
        "parallel.overlap_grad_reduce=true",
    ]


def build_specs(args: argparse.Namespace, names: list[str], ckpt_dir: str) -> list[RunSpec]:
    """The run specs of ``names``; the reference saves the checkpoint that the resume spec continues from."""
    if args.dry_run:
        model: dict[str, Any] = {"preset": "llama-tiny", "num_hidden_layers": 4, "vocab_size": 300}
        shape = ["data.seq_length=64", "train.micro_batch_size=1", "train.global_batch_size=8", "lr.warmup_steps=1"]
    else:
        model = {"preset": "llama3-8b"}
        shape = [
            "data.seq_length=8192",
            "train.micro_batch_size=1",
            f"train.global_batch_size={args.global_batch_size}",
            f"lr.warmup_steps={max(1, args.steps // 6)}",
            "lr.max_lr=3e-4",
            "lr.min_lr=3e-5",
        ]
    common = [
        f"train.device={'cpu' if args.dry_run else 'cuda'}",
        f"train.precision={args.precision}",
        f"train.steps={args.steps}",
        *shape,
    ]
    specs = []
    for name in names:
        if name == RESUME:
            specs.append(
                RunSpec(
                    name,
                    WORLD,
                    [*common, *_layout_overrides(1, 2, 4)],
                    model,
                    untimed_steps=1,
                    resume_from=ckpt_dir,
                    stop_after=args.save_at + args.resume_steps,
                )
            )
            continue
        save = name == REFERENCE and RESUME in names
        specs.append(
            RunSpec(
                name,
                WORLD,
                [*common, *_layout_overrides(*LAYOUTS[name])],
                model,
                untimed_steps=args.untimed_steps,
                save_at=args.save_at if save else None,
                ckpt_dir=ckpt_dir if save else None,
            )
        )
    return specs


def memory_plan(spec: RunSpec, gpu_memory_gb: float) -> tuple[bool, str]:
    """Whether ``spec`` fits ``gpu_memory_gb`` per GPU by ``mcore-train plan``'s estimate, and the estimate."""
    from mcore.train.plan import make_plan

    config = check_spec(spec)
    plan = make_plan(config, spec.world_size, gpu_memory_gb)
    worst = plan.worst
    text = (
        f"{spec.name}: mcore-train plan estimates {worst.total / 1e9:.1f} GB on pp rank {worst.pp_rank} (weights "
        f"{worst.weights / 1e9:.1f}, grads {worst.gradients / 1e9:.1f}, optimizer {worst.optimizer / 1e9:.1f}, "
        f"activations {worst.activations / 1e9:.1f}, overhead {worst.overhead / 1e9:.1f}) of {gpu_memory_gb:g} GB"
    )
    return plan.fits, text


def evaluate(
    results: dict[str, dict[str, Any]], expected: list[str], skipped: dict[str, str], rtol: float, compare_steps: int
) -> dict[str, Any]:
    """Losses of every layout against (2, 2, 2), and the resumed run against (2, 2, 2) at the same steps."""
    checks: dict[str, Any] = {}
    pending: list[str] = []
    missing = [n for n in expected if n not in results and n not in skipped]
    ref = results.get(REFERENCE)
    for name in expected:
        if name == REFERENCE or name not in results:
            continue
        if ref is None:
            if REFERENCE in expected:
                checks[name] = {"ok": False, "problems": [f"the reference '{REFERENCE}' did not run"]}
            else:  # a partial run (device time is limited per call): compared later with --report
                pending.append(name)
            continue
        if name == RESUME:
            # The resumed run starts after the checkpoint's step; compare every step it ran.
            check = compare_loss_curves(curve(ref), curve(results[name]), rtol=rtol)
            saved = ref.get("checkpoint") or {}
            resumed_at = results[name]["steps"][0] - 1
            problems = list(check.problems)
            if saved.get("step") != resumed_at:
                saved_at = saved.get("step")
                problems.append(f"resumed after step {resumed_at}, but {REFERENCE} saved after step {saved_at}")
            checks[name] = {**check.to_dict(), "ok": check.ok and not problems, "problems": problems}
        else:
            checks[name] = compare_loss_curves(
                curve(ref), curve(results[name]), rtol=rtol, max_steps=compare_steps
            ).to_dict()
    ok = not missing and all(c["ok"] for c in checks.values())
    return {
        "ok": ok,
        "rtol": rtol,
        "reference": REFERENCE,
        "missing": missing,
        "skipped": skipped,
        "pending": pending,
        "checks": checks,
    }


def render(results: dict[str, dict[str, Any]], verdict: dict[str, Any]) -> str:
    """The markdown report: one row per configuration, then the verdict."""
    rows = []
    for name in CONFIG_NAMES:
        res = results.get(name)
        if res is None:
            continue
        lay = res["layout"]
        check = verdict["checks"].get(name)
        ckpt = res.get("checkpoint") or {}
        rows.append(
            [
                name,
                f"({lay['tp']}, {lay['pp']}, {lay['dp']})",
                f"{res['steps'][0]}-{res['steps'][-1]}",
                res["tokens_per_s_per_gpu"],
                res["tflops_per_gpu"],
                100 * res["mfu"],
                res["peak_mem_gb"],
                ckpt.get("save_peak_mem_gb"),
                1000 * res["step_s"],
                res["final_loss"],
                None if check is None else check.get("max_rel_diff"),
                "reference" if name == REFERENCE else ("ok" if check and check["ok"] else "FAIL"),
            ]
        )
    headers = [
        "config",
        "(tp, pp, dp)",
        "steps",
        "tokens/s/GPU",
        "TFLOP/s/GPU",
        "MFU %",
        "peak GB",
        "save peak GB",
        "step ms",
        "final loss",
        f"max rel diff vs {REFERENCE}",
        f"loss check (rtol {verdict['rtol']:g})",
    ]
    lines = [markdown_table(headers, rows), ""]
    for name, reason in verdict["skipped"].items():
        lines.append(f"- skipped {name}: {reason}")
    for name, check in verdict["checks"].items():
        for problem in check["problems"]:
            lines.append(f"- {name}: {problem}")
    if verdict["missing"]:
        lines.append(f"- did not run: {', '.join(verdict['missing'])}")
    if verdict["pending"]:
        lines.append(
            f"- not compared yet ({REFERENCE} ran elsewhere; combine the result directories with --report): "
            f"{', '.join(verdict['pending'])}"
        )
    lines.append("PASS" if verdict["ok"] else "FAIL")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--out", type=Path, default=Path("runs/bench/eight_gpu"), help="where results.json, results.md, launches.log go"
    )
    ap.add_argument("--steps", type=int, default=None, help="steps per layout (30; dry run 4)")
    ap.add_argument("--global-batch-size", type=int, default=16, help="sequences per step (16)")
    ap.add_argument("--save-at", type=int, default=None, help="step after which (2,2,2) saves (10; dry run 2)")
    ap.add_argument("--resume-steps", type=int, default=None, help="steps run after resuming (5; dry run 2)")
    ap.add_argument(
        "--ckpt-dir", type=Path, default=None, help="checkpoint directory, kept (default: a temporary one, removed)"
    )
    ap.add_argument("--gpu-memory", type=float, default=141.0, help="GB per GPU for the memory plan (141)")
    add_orchestrator_arguments(ap, dry_run_help="CPU, gloo, world size 8, tiny Llama, 4 steps")
    args = ap.parse_args(argv)
    dry = args.dry_run
    if args.save_at is None:
        args.save_at = 2 if dry else 10
    if args.resume_steps is None:
        args.resume_steps = 2 if dry else 5
    resolve_orchestrator_arguments(ap, args, steps=30, positive=("global_batch_size",))
    if not 1 <= args.save_at < args.steps or args.save_at + args.resume_steps > args.steps:
        ap.error(
            f"need 1 <= --save-at < --steps and --save-at + --resume-steps <= --steps, got save-at {args.save_at}, "
            f"resume-steps {args.resume_steps}, steps {args.steps}"
        )
    return args


def checkpoint_parent(spec: RunSpec) -> Path:
    """Where the temporary checkpoint goes: ``/dev/shm`` (memory, fast) when it has room for it with a quarter to
    spare, else the temporary directory. Size: every parameter in the parameter dtype plus three fp32 optimizer
    states (master, exp_avg, exp_avg_sq)."""
    from mcore.models.accounting import parameter_counts

    config = check_spec(spec)
    per_param = {"bf16": 2, "fp16": 2, "fp32": 4}.get(config.train.precision, 4) + 12
    need = 1.25 * per_param * parameter_counts(config.model).total
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK) and shutil.disk_usage(shm).free >= need:
        return shm
    return Path(tempfile.gettempdir())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker_main(args.plan, args.configs.split(","), args.work_dir)
        return 0
    names = parse_names(args.configs, CONFIG_NAMES)
    args.out.mkdir(parents=True, exist_ok=True)

    def publish(results: dict[str, dict[str, Any]], final: bool, skipped: dict[str, str]) -> int:
        ref = results.get(REFERENCE)
        rtol = args.rtol if args.rtol is not None else default_rtol(ref["precision"] if ref else args.precision)
        verdict = evaluate(results, names, skipped, rtol, args.compare_steps)
        report = render(results, verdict)
        write_report(args.out, {"configs": results, "complete": final, **verdict}, report)
        if final:
            print(report, flush=True)
        return 0 if verdict["ok"] else 1

    if args.report:
        results = load_reported(args.report)
        skipped = {n: "not in these results (not run, or skipped by its run)" for n in [OPTIONAL] if n not in results}
        return publish(results, True, skipped)

    if RESUME in names and REFERENCE not in names and args.ckpt_dir is None:
        raise SystemExit(f"{RESUME} continues from the checkpoint {REFERENCE} saves: run both, or give --ckpt-dir")
    saving = RESUME in names and REFERENCE in names
    if saving and args.ckpt_dir is not None and args.ckpt_dir.exists() and any(args.ckpt_dir.iterdir()):
        # A published checkpoint of the same step would be kept and this run's discarded (never overwritten).
        raise SystemExit(f"--ckpt-dir {args.ckpt_dir} is not empty; give a new or empty directory")
    ckpt_dir, own_ckpt = args.ckpt_dir, args.ckpt_dir is None and saving
    if own_ckpt:
        probe = build_specs(args, [REFERENCE], "")[0]
        ckpt_dir = Path(tempfile.mkdtemp(prefix="mcore-bench-ckpt-", dir=checkpoint_parent(probe)))
        print(f"checkpoint directory: {ckpt_dir} (removed at the end)", flush=True)
    specs = build_specs(args, names, str(ckpt_dir or ""))
    skipped: dict[str, str] = {}
    for spec in specs:
        fits, text = memory_plan(spec, args.gpu_memory)
        print(text, flush=True)
        if not fits and spec.name == OPTIONAL:
            skipped[spec.name] = f"does not fit: {text}"
            print(f"skipping {spec.name}: it does not fit", flush=True)
    log = args.out / "launches.log"
    log.unlink(missing_ok=True)
    try:
        return orchestrate(
            Path(__file__).resolve(),
            [s for s in specs if s.name not in skipped],
            work_dir=args.work_dir,
            log_path=log,
            one_launch=args.one_launch,
            dry_run=args.dry_run,
            timeout_s=args.launch_timeout,
            publish=lambda results, final: publish(results, final, skipped),
        )
    finally:
        if own_ckpt:
            shutil.rmtree(ckpt_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
