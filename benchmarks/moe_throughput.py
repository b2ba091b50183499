"""Single-GPU MoE training throughput of mcore-train against the Hugging Face MoE baseline, plus micro-benchmarks.

Runs the real ``mcore-train`` step (``load_config`` -> ``init_runtime`` -> ``Trainer``: the model with its ``moe``
MLPs, the distributed optimizer at dp=1, the schedule) on the shapes of ``hf_moe_baseline.py`` (``mixtral2l``:
Mixtral-8x7B layers x 2; ``qwen3moe4l``: Qwen3-30B-A3B layers x 4; ``moonlight8l``: Moonlight-16B-A3B layers x 8,
multi-head latent attention and DeepSeek-V3 routing; bf16 compute, fp32 master weights and AdamW
states, seq 4096, micro-batch 2, dropless, no aux loss: the baseline's HF models do not compute one either) on mock
data, then the baseline eager and with ``torch.compile``, each in its own process. Reported with the baseline's
keys: tokens/s, TFLOP/s/GPU and MFU on active parameters (6 x active matmul weights + attention, the formula of
the baseline's docstring; peak 989.4 TFLOP/s), peak memory, first-step time.

``--profile-steps N`` (default 1 on the GPU): N more steps after the timed ones run under the CUDA profiler; the
record gets ``profile`` (``step_profile``'s breakdown) and ``time_breakdown`` (``moe_profile``: router, permute,
unpermute, grouped GEMMs, expert activation, attention, other GEMMs, optimizer, rest, idle; ms and %).

``--variants LAYOUT:GEMM,...`` runs ours once per variant, each in its own process beside the baselines of the same
call: LAYOUT ``zero1`` (the distributed optimizer at dp=1: bf16 weights + fp32 masters, 18 bytes per parameter),
``fsdp`` (FSDP2 ``parallel.dp_shard``: fp32 weights that are the masters, 16 bytes, HF's layout; at dp=1 the units
stay gathered from forward to backward and the weight-gradient GEMMs accumulate into the fp32 shard gradients) or
``fsdp_reshard`` (the same, each unit resharded after its forward and gathered again for backward), GEMM
``moe_router.expert_gemm`` (``grouped``; ``per_expert``: fp32 weight gradients straight into ``main_grad``;
``grouped_fp32_wgrad``: grouped forward and input gradients, those weight gradients per expert). Each
variant's record is ``{label}_{shape}.json``, label ``mcore[-LAYOUT unless zero1][-per_expert]``; the summary gives
each one's ratios to HF (``ratios_by_variant``). Default: ``zero1:<--expert-gemm>``, plus ``fsdp:<--expert-gemm>``
with ``--fsdp``.

``--micro`` (run first, in this process): the expert GEMMs of each shape through ``mcore.kernels.grouped_gemm``
(forward + both backward GEMMs) against one dense GEMM of the same FLOPs, and the router / permute / unpermute
ops, each timed with CUDA events (median of ``--iters``). The expert rows are padded to multiples of 8 per expert
(``moe_router.align=8``: 16-byte rows for the bf16 grouped GEMM's TMA loads; zero rows change no result).

::

    python benchmarks/moe_throughput.py --json-dir DIR                 # one GPU: micro, then both shapes
    python benchmarks/moe_throughput.py --shape moonlight8l --json-dir DIR   # one shape (+ its micro-benchmarks)
    python benchmarks/moe_throughput.py --dry-run --json-dir DIR       # CPU, tiny fp32 shapes, no baseline
    python benchmarks/moe_throughput.py --shape mixtral2l --skip-micro --skip-compile \
        --variants zero1:per_expert,fsdp:grouped --json-dir DIR            # two of ours beside HF eager
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from _common import RunSpec, check_spec, child_env, run_one_launch, run_spec, shared_bench, write_json
from gpt_oss_bench import DRY_RUN_SHAPES as GPT_OSS_DRY_RUN
from gpt_oss_bench import GPT_OSS_SHAPES, gpt_oss_model
from gpt_oss_bench import SHAPES as GPT_OSS_BENCH_SHAPES
from moe_micro import run_micro
from moe_profile import moe_time_breakdown, render_moe_breakdowns
from train_throughput import ratios, render

HF_MOE_BASELINE = shared_bench("hf_moe_baseline.py")
GPU_SHAPES = ("mixtral2l", "qwen3moe4l", "moonlight8l")
DRY_RUN_SHAPES = ("tiny", "tiny_mla")
BASELINES = {"hf": [], "hf-compile": ["--compile"]}
EXPERT_GEMMS = ("grouped", "per_expert", "grouped_fp32_wgrad")

# The baseline's shapes (its SHAPES table), as mcore model sections; "tiny" is the CPU dry run's.
SHAPES: dict[str, dict[str, Any]] = {
    "mixtral2l": dict(family="mixtral", hidden=4096, layers=2, heads=32, kv=8, head_dim=128, experts=8, topk=2,
                      moe_ffn=14336, vocab=32000, seq=4096, mbs=2),
    "qwen3moe4l": dict(family="qwen3_moe", hidden=2048, layers=4, heads=32, kv=4, head_dim=128, experts=128, topk=8,
                       moe_ffn=768, dense_ffn=6144, vocab=151936, seq=4096, mbs=2),
    "tiny": dict(family="qwen3_moe", hidden=64, layers=2, heads=4, kv=2, head_dim=16, experts=8, topk=2, moe_ffn=32,
                 dense_ffn=96, vocab=259, seq=64, mbs=2),
    # Moonlight-16B-A3B layers x 8 (DeepSeek-V3's architecture: MLA without q-LoRA, sigmoid routing, 2 shared experts)
    "moonlight8l": dict(family="deepseek_v3", hidden=2048, layers=8, heads=16, kv=16, head_dim=192, experts=64, topk=6,
                        moe_ffn=1408, shared=2, dense_ffn=11264, first_dense=1, kv_lora=512, qk_nope=128, qk_rope=64,
                        v_head=128, vocab=163840, seq=4096, mbs=2),
    "tiny_mla": dict(family="deepseek_v3", hidden=64, layers=3, heads=4, kv=4, head_dim=32, experts=8, topk=2,
                     moe_ffn=32, shared=2, dense_ffn=96, first_dense=1, kv_lora=32, qk_nope=24, qk_rope=8, v_head=16,
                     vocab=259, seq=64, mbs=2),
}  # fmt: skip
SHAPES.update(GPT_OSS_BENCH_SHAPES)


def moe_model(shape: dict[str, Any], *, align: int, expert_gemm: str = "grouped") -> dict[str, Any]:
    """The ``model`` section of ``shape`` with transformers' defaults of its family for the rest."""
    if shape["family"] == "deepseek_v3":
        return mla_moe_model(shape, align=align, expert_gemm=expert_gemm)
    if shape["family"] == "gpt_oss":
        return gpt_oss_model(shape, align=align, expert_gemm=expert_gemm)
    mixtral = shape["family"] == "mixtral"
    router: dict[str, Any] = {"align": align} if align > 1 else {}
    if expert_gemm != "grouped":
        router["expert_gemm"] = expert_gemm
    return {
        "model_type": shape["family"],
        "hidden_size": shape["hidden"],
        "num_hidden_layers": shape["layers"],
        "num_attention_heads": shape["heads"],
        "num_key_value_heads": shape["kv"],
        "head_dim": shape["head_dim"],
        "intermediate_size": shape["moe_ffn"] if mixtral else shape["dense_ffn"],
        "moe_intermediate_size": None if mixtral else shape["moe_ffn"],
        "num_experts": shape["experts"],
        "num_experts_per_tok": shape["topk"],
        "norm_topk_prob": True,
        "qk_norm": not mixtral,
        "vocab_size": shape["vocab"],
        "max_position_embeddings": shape["seq"],
        "rope_theta": 1000000.0 if mixtral else 10000.0,
        "rms_norm_eps": 1e-5 if mixtral else 1e-6,
        "tie_word_embeddings": False,
        "router_aux_loss_coef": 0.0,
        "moe_router": router or None,
    }


def mla_moe_model(shape: dict[str, Any], *, align: int, expert_gemm: str = "grouped") -> dict[str, Any]:
    """A DeepSeek-V3-architecture shape as the baseline builds it (DeepseekV3Config defaults: rope interleaved,
    theta 10000, eps 1e-6; n_group 1, routed_scaling_factor 2.446, renormalised top-k, the expert bias)."""
    router: dict[str, Any] = {"score_function": "sigmoid", "expert_bias": True, "routed_scaling_factor": 2.446}
    if expert_gemm != "grouped":
        router["expert_gemm"] = expert_gemm
    return {
        "model_type": "deepseek_v3",
        "hidden_size": shape["hidden"],
        "num_hidden_layers": shape["layers"],
        "num_attention_heads": shape["heads"],
        "intermediate_size": shape["dense_ffn"],
        "moe_intermediate_size": shape["moe_ffn"],
        "shared_expert_intermediate_size": shape["shared"] * shape["moe_ffn"],
        "first_k_dense_replace": shape["first_dense"],
        "kv_lora_rank": shape["kv_lora"],
        "qk_nope_head_dim": shape["qk_nope"],
        "qk_rope_head_dim": shape["qk_rope"],
        "v_head_dim": shape["v_head"],
        "rope_interleave": True,
        "num_experts": shape["experts"],
        "num_experts_per_tok": shape["topk"],
        "norm_topk_prob": True,
        "vocab_size": shape["vocab"],
        "max_position_embeddings": shape["seq"],
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "router_aux_loss_coef": 0.0,
        "moe_router": {**router, "align": align} if align > 1 else router,
    }


# ``--fsdp``: the same step with FSDP2 (fp32 parameters that are the master weights, bf16 compute, fp32 gradients:
# HF's policy and its 16 bytes per parameter; the distributed optimizer at dp=1 holds 18: bf16 weights besides them)
FSDP_OVERRIDES = [
    "parallel.dp_shard=true",
    "parallel.distributed_optimizer=false",
    "parallel.overlap_param_gather=false",
]


# the memory layouts of --variants: ZeRO-1 at dp=1; FSDP2 with its dp=1 defaults (units kept gathered from forward
# to backward); FSDP2 resharding each unit after its forward (gathered again for backward: less memory, one more cast)
LAYOUT_OVERRIDES = {
    "zero1": [],
    "fsdp": FSDP_OVERRIDES,
    "fsdp_reshard": [*FSDP_OVERRIDES, "parallel.dp_shard_reshard_after_forward=true"],
}
LAYOUTS = tuple(LAYOUT_OVERRIDES)


def variant_label(layout: str, expert_gemm: str) -> str:
    """``mcore[-fsdp|-fsdp_reshard][-per_expert]``: the name of one of our runs (its JSON file, its table row)."""
    return (
        "mcore" + ("" if layout == "zero1" else f"-{layout}") + ("" if expert_gemm == "grouped" else f"-{expert_gemm}")
    )


def parse_variants(text: str) -> list[tuple[str, str]]:
    """``"zero1:grouped,fsdp:per_expert"`` -> ``[(layout, expert_gemm), ...]``; one ValueError naming a bad entry."""
    out: list[tuple[str, str]] = []
    for item in (part.strip() for part in text.split(",")):
        layout, _, gemm = item.partition(":")
        if layout not in LAYOUTS or gemm not in EXPERT_GEMMS:
            raise ValueError(
                f"--variants entry {item!r}: want LAYOUT:GEMM with LAYOUT one of {LAYOUTS} and GEMM one of "
                f"{EXPERT_GEMMS}, e.g. zero1:per_expert"
            )
        if (layout, gemm) in out:
            raise ValueError(f"--variants lists {item!r} twice")
        out.append((layout, gemm))
    return out


def build_spec(
    shape_name: str,
    *,
    iters: int,
    warmup: int,
    dry_run: bool,
    profile_steps: int = 0,
    fsdp: bool = False,
    expert_gemm: str = "grouped",
    layout: str | None = None,
    recompute_modules: str | None = None,
    extra_overrides: list[str] | None = None,
) -> RunSpec:
    """``layout``: one of ``LAYOUTS`` (default ``"fsdp"`` when ``fsdp``, else ``"zero1"``); ``extra_overrides``:
    config overrides appended last (``--override``, e.g. the optimizer's dtypes)."""
    layout = layout or ("fsdp" if fsdp else "zero1")
    shape = SHAPES[shape_name]
    overrides = [
        f"train.device={'cpu' if dry_run else 'cuda'}",
        f"train.precision={'fp32' if dry_run else 'bf16'}",
        "parallel.distributed_optimizer=true",
        f"data.seq_length={shape['seq']}",
        f"train.micro_batch_size={shape['mbs']}",
        f"train.global_batch_size={shape['mbs']}",
        f"train.steps={1 + warmup + iters + profile_steps}",
        "lr.schedule=constant",
        "lr.max_lr=1e-4",
        "lr.min_lr=1e-4",
        "lr.warmup_steps=0",
    ]
    if layout != "zero1":
        overrides = [o for o in overrides if not o.startswith("parallel.distributed_optimizer")]
        overrides += LAYOUT_OVERRIDES[layout]
    if recompute_modules:  # selective recompute of these sub-blocks (comma-separated, Megatron's names)
        overrides += ["train.recompute=selective", f"train.recompute_modules=[{recompute_modules}]"]
    overrides += list(extra_overrides or [])
    model = moe_model(shape, align=1 if dry_run else 8, expert_gemm=expert_gemm)
    name = f"{variant_label(layout, expert_gemm)}_{shape_name}"
    return RunSpec(name, 1, overrides, model, 1 + warmup, profile_steps=profile_steps)


def run_ours(args: argparse.Namespace) -> int:
    """``--only mcore``: measure one shape in this process and write its JSON (the baseline's keys first)."""
    spec = build_spec(
        args.shape,
        iters=args.iters,
        warmup=args.warmup,
        dry_run=args.dry_run,
        profile_steps=args.profile_steps,
        expert_gemm=args.expert_gemm,
        layout=args.layout,
        recompute_modules=args.recompute_modules,
        extra_overrides=args.override,
    )
    result, runtime = run_spec(spec)
    runtime.shutdown()
    keys = ("params", "tokens_per_s", "step_s", "tflops_per_gpu", "mfu", "peak_mem_gb", "first_step_s", "gpu", "torch")
    record = {
        "impl": variant_label(args.layout, args.expert_gemm) + ("-dryrun" if args.dry_run else ""),
        "shape": args.shape,
        **SHAPES[args.shape],
        **{k: result[k] for k in keys},
        "precision": result["precision"],
        "expert_gemm": args.expert_gemm,
        "recompute_modules": args.recompute_modules,
        "overrides": args.override,
        "flops_per_token": result["flops_per_token"],
        "iters": args.iters,
        "warmup": args.warmup,
        "step_times_s": result["step_times_s"],
        "losses": result["losses"],
    }
    if result["profile"]:
        record["profile"] = result["profile"][0]
        record["time_breakdown"] = moe_time_breakdown(result["profile"][0])
    write_json(args.json, record)
    print(json.dumps({k: record[k] for k in ("impl", "shape", "tokens_per_s", "tflops_per_gpu", "mfu", "peak_mem_gb")}))
    return 0


def _runs(args: argparse.Namespace, shape: str, out: Path) -> list[tuple[str, list[str]]]:
    runs = []
    for layout, gemm in args.variant_list:
        label = variant_label(layout, gemm)
        ours = [str(Path(__file__).resolve()), "--only", "mcore", "--shape", shape, "--iters", str(args.iters)]
        ours += ["--warmup", str(args.warmup), "--profile-steps", str(args.profile_steps), "--expert-gemm", gemm]
        if args.recompute_modules:
            ours += ["--recompute-modules", args.recompute_modules]
        for item in args.override:
            ours += ["--override", item]
        ours += ["--json", str(out / f"{label}_{shape}.json")]
        runs.append((label, ours + (["--dry-run"] if args.dry_run else []) + ["--layout", layout]))
    if args.skip_baseline or args.dry_run or not SHAPES[shape].get("baseline", True):
        return runs
    for label, extra in BASELINES.items():
        if args.skip_compile and "--compile" in extra:
            continue
        argv = [str(args.hf_baseline), "--shape", shape, *extra, "--iters", str(args.iters)]
        runs.append((label, argv + ["--json", str(out / f"{label}_{shape}.json")]))
    return runs


def orchestrate(args: argparse.Namespace) -> int:
    """Micro-benchmarks, then per shape ours and the baselines one process each; the summary is rewritten after
    every run (a device call cut short still returns what finished)."""
    out: Path = args.json_dir
    out.mkdir(parents=True, exist_ok=True)
    if args.dry_run:  # the GPT-OSS shapes have their own tiny stand-in; every other request runs the MoE ones
        shapes = [GPT_OSS_DRY_RUN[args.shape]] if args.shape in GPT_OSS_DRY_RUN else list(DRY_RUN_SHAPES)
    else:
        named = {"all": list(GPU_SHAPES), "gptoss": list(GPT_OSS_SHAPES)}
        shapes = named.get(args.shape, [args.shape])
    skip_baseline = args.skip_baseline or args.dry_run
    if not skip_baseline and not args.hf_baseline.is_file():
        raise SystemExit(f"--hf-baseline: {args.hf_baseline} does not exist; pass the path of hf_moe_baseline.py")
    for shape in shapes:  # every variant's configuration, before any process starts (GPU time is dear)
        for layout, gemm in args.variant_list:
            spec = build_spec(shape, iters=args.iters, warmup=args.warmup, dry_run=args.dry_run, layout=layout,
                              expert_gemm=gemm)  # fmt: skip
            check_spec(spec)
    summary: dict[str, Any] = {"shapes": {}, "failures": []}
    if not args.skip_micro:
        summary["micro"] = run_micro([SHAPES[s] | {"name": s} for s in shapes], iters=args.iters, dry_run=args.dry_run)
        write_json(out / "micro.json", summary["micro"])
    env = child_env(dry_run=args.dry_run)
    log = out / "moe_throughput.log"
    log.unlink(missing_ok=True)
    for shape in shapes:
        results: dict[str, dict[str, Any] | None] = {}
        for label, argv in _runs(args, shape, out):
            results[label] = run_one_launch(
                argv, out / f"{label}_{shape}.json", f"{label} on {shape}", log=log, env=env,
                timeout_s=args.timeout, failures=summary["failures"],
            )  # fmt: skip
            baseline = "skipped" if skip_baseline else str(args.hf_baseline)
            entry = {"results": results, "ratios": ratios(results), "baseline": baseline}
            entry["ratios_by_variant"] = {
                label: ratios({**results, "mcore": results.get(label)})
                for label in (variant_label(*v) for v in args.variant_list)
            }
            summary["shapes"][shape] = entry
            write_json(out / "summary.json", {**summary, "markdown": _render(summary)})
    print(_render(summary), flush=True)
    for failure in summary["failures"]:
        print(f"FAILED: {failure}", flush=True)
    return 1 if summary["failures"] else 0


def _render(summary: dict[str, Any]) -> str:
    """The throughput table and ratios, then the time breakdown of each shape that was profiled."""
    breakdowns = {
        f"{shape} {label}": res["time_breakdown"]
        for shape, entry in summary["shapes"].items()
        for label, res in entry["results"].items()
        if (res or {}).get("time_breakdown")
    }
    lines = [render(summary)]
    for shape, entry in summary["shapes"].items():
        for label, r in entry.get("ratios_by_variant", {}).items():
            if label != "mcore" and r["tokens_per_s_vs_hf"] is not None:
                lines.append(
                    f"- {shape} {label}: tokens/s vs HF-eager {r['tokens_per_s_vs_hf']:.3f}, peak memory vs HF-eager "
                    f"{r['peak_mem_vs_hf']:.3f}"
                )
    profiled = render_moe_breakdowns(breakdowns)
    return "\n".join(lines) + ("\n\n" + profiled if profiled else "")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    shape_names = [*GPU_SHAPES, *GPT_OSS_DRY_RUN, "all", *DRY_RUN_SHAPES, "gptoss_tiny"]
    ap.add_argument("--shape", choices=shape_names, default="all", help="shape(s) to run (all)")
    ap.add_argument("--iters", type=int, default=None, help="timed steps (8, as the baseline; dry run 3)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps after the first (2; dry run 1)")
    ap.add_argument("--skip-baseline", action="store_true", help="run mcore only")
    ap.add_argument("--skip-micro", action="store_true", help="leave out the micro-benchmarks")
    ap.add_argument("--skip-compile", action="store_true", help="leave out the torch.compile baseline")
    ap.add_argument("--hf-baseline", type=Path, default=HF_MOE_BASELINE, help="path of hf_moe_baseline.py")
    ap.add_argument("--json-dir", type=Path, default=None, help="where the JSON files go (default: a temp dir)")
    ap.add_argument("--json", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--only", choices=["mcore"], help=argparse.SUPPRESS)
    ap.add_argument("--layout", choices=LAYOUTS, default=None, help=argparse.SUPPRESS)  # of one --only run
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per run (600)")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny fp32 shape, 3 iterations, no baseline")
    ap.add_argument("--fsdp", action="store_true", help="also run ours with FSDP2 (parallel.dp_shard=true)")
    ap.add_argument("--expert-gemm", choices=EXPERT_GEMMS, default="grouped", help="moe_router.expert_gemm (grouped)")
    ap.add_argument(
        "--variants",
        default=None,
        help="ours as LAYOUT:GEMM,... (zero1|fsdp|fsdp_reshard : grouped|per_expert|grouped_fp32_wgrad)",
    )
    ap.add_argument(
        "--recompute-modules", default=None, help="ours: train.recompute_modules, comma-separated (selective recompute)"
    )
    ap.add_argument(
        "--override", action="append", default=[], metavar="KEY=VALUE",
        help="ours: a config override, appended last (repeatable; e.g. optim.exp_avg_dtype=bf16)",
    )  # fmt: skip
    ap.add_argument(
        "--profile-steps", type=int, default=None, help="steps after the timed ones under the CUDA profiler (1; dry 0)"
    )
    args = ap.parse_args(argv)
    args.iters = args.iters if args.iters is not None else (3 if args.dry_run else 8)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.dry_run else 2)
    args.profile_steps = args.profile_steps if args.profile_steps is not None else (0 if args.dry_run else 1)
    if args.profile_steps < 0 or (args.dry_run and args.profile_steps):
        ap.error(f"--profile-steps must be >= 0 and needs a GPU (0 in dry runs), got {args.profile_steps}")
    bad = [o for o in args.override if "=" not in o]
    if bad:
        ap.error(f"--override wants KEY=VALUE, got {bad[0]!r}")
    if args.iters < 1 or args.warmup < 0:
        ap.error(f"--iters must be >= 1 and --warmup >= 0, got {args.iters} and {args.warmup}")
    if args.only and (args.json is None or args.shape in ("all", "gptoss")):
        ap.error("--only mcore needs --json FILE and one --shape")
    if args.shape in (*DRY_RUN_SHAPES, "gptoss_tiny") and not (args.dry_run or args.only):
        ap.error("--shape tiny is the dry-run shape; use --dry-run")
    args.layout = args.layout or ("fsdp" if args.fsdp else "zero1")
    default = f"zero1:{args.expert_gemm}" + (f",fsdp:{args.expert_gemm}" if args.fsdp else "")
    try:
        args.variant_list = parse_variants(args.variants if args.variants is not None else default)
    except ValueError as exc:
        ap.error(str(exc))
    if args.json_dir is None and not args.only:
        args.json_dir = Path(tempfile.mkdtemp(prefix="mcore-moe-throughput-"))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return run_ours(args) if args.only else orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
