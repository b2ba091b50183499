"""Single-GPU training throughput of mcore-train against the Hugging Face baseline, on the same shapes.

Runs the real ``mcore-train`` training step (the CLI's path: ``load_config`` -> ``init_runtime`` -> ``Trainer``;
the model, the loss, the distributed optimizer at dp=1 and the schedule) on the two shapes of
``hf_baseline.py`` (``1b`` and ``8b4l``: bf16 compute with fp32 master weights and optimizer states, seq 4096,
the same micro-batch, one micro-batch per step, untied embeddings) on mock data, then the baseline (eager, then
``torch.compile``), each in its own process so that memory statistics do not mix. Reported like the baseline:
tokens/s, TFLOP/s/GPU and MFU (model FLOPs: 6 x matmul weights including the output layer, excluding the
embedding, + 12 x layers x hidden x seq; peak 989.4 TFLOP/s), peak memory, first-step time; the step time is the
median of ``--iters`` CUDA-event-timed steps after the first step and ``--warmup`` more.

``--attention-backend`` picks attention's backend through ``MCORE_ATTENTION_BACKEND`` (``auto``, the default, is
the dispatcher's measured choice: SDPA for one plain document, our Triton kernel for packed documents); several,
comma-separated, are each a run of their own; each record lists the backends the dispatcher logged it used.

``--grads fp32,bf16`` measures ours with each dtype of the gradient buffer (``optim.main_grads_dtype``; fp32, the
default, is Megatron's for bf16 training). With one micro-batch per step at dp=1 (these runs) a bf16 buffer holds
what the baseline's fp32 ``.grad`` holds: autocast's weight-gradient GEMM writes bf16, which is then upcast; the
moments and master weights stay fp32 either way. The MoE comparisons (``moe_throughput.py``) use that policy.

``--variants standard,packed`` adds a packed-documents run of each shape (``<shape>-packed``): rows filled with
documents whose lengths follow a cited real-corpus distribution (FinePDFs-Edu's mean document length,
log-normal; ``packed_documents.py``) or the user's (``--doc-lengths``), read through mcore-train's own packed data
path (a ``.bin/.idx`` corpus with ``data.packing=true``: ``cu_seqlens`` and restarting positions per row). Its
tokens/s count every token; its TFLOP/s and MFU are *effective*: the attention term counts the work inside
documents only, ``12 * L * q_size * sum_i n_i^2`` per row of documents ``n_i`` instead of the standard
``12 * L * q_size * s^2`` (the unpacked case, one document of ``s``); ``packed_documents.py`` gives the formula.
Its baseline is ``hf_packed_baseline.py``: hf_baseline.py's step fed the same rows, the documents given to
Hugging Face as restarting ``position_ids`` (checked on the device to separate documents; eager only).

Differences that remain, by design of the two programs: mcore keeps bf16 parameters and fp32 master weights in
the optimizer (the baseline: fp32 parameters under bf16 autocast); mcore clips gradients at norm 1.0 and decays
weights by 0.1 (the CLI's defaults; the baseline does not clip and its AdamW decays by 0.01), both at a constant
LR of 1e-4; mcore's mock tokens are drawn from the byte tokenizer's 259 ids, the baseline's from the whole
vocabulary (neither changes the work done). mcore's FLOP count leaves out the norm weights, which the baseline
counts (< 0.01% of the FLOPs). ``--compile`` is not offered: mcore's model does not expose regional compilation.

::

    python benchmarks/train_throughput.py --shape all --json-dir DIR   # on one GPU (see benchmarks/README.md)
    python benchmarks/train_throughput.py --dry-run --json-dir DIR     # CPU, tiny fp32 shape, 3 iterations
    python benchmarks/train_throughput.py --shape 1b,8b4l --variants standard,packed --skip-hf-compile \\
        --json-dir $OUT/packed --runs-dir /tmp/runs    # per-run JSON kept out of DIR (a device call returns 8 files)
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from _common import (
    DEFAULT_HF_BASELINE,
    SHAPES,
    RunSpec,
    check_spec,
    child_env,
    llama_model,
    markdown_table,
    run_one_launch,
    run_spec,
    spec_config,
    write_json,
)
from packed_documents import GPU_SEQ, LengthSource, data_overrides, packed_record, run_rows, write_corpus
from step_profile import render_breakdown

GPU_SHAPES = ("1b", "8b4l")
VARIANTS = ("standard", "packed")
ATTENTION_BACKENDS = ("auto", "sdpa", "flex", "triton", "reference")  # mcore.kernels.attention's, "auto" first
GRAD_DTYPES = ("fp32", "bf16")  # optim.main_grads_dtype of the mcore runs
HF_PACKED_BASELINE = Path(__file__).resolve().parent / "hf_packed_baseline.py"
# result file stem -> extra arguments of hf_baseline.py
BASELINES = {"hf": [], "hf-compile": ["--compile"]}


def build_spec(
    shape_name: str,
    *,
    iters: int,
    warmup: int,
    dry_run: bool,
    profile_steps: int = 0,
    corpus: Path | None = None,
    grads: str = "fp32",
) -> RunSpec:
    """The mcore run of one shape: one micro-batch per step (the baseline's tokens per step), dp=1; ``profile_steps``
    more steps after the timed ones under the CUDA profiler; with ``corpus`` (a ``.bin/.idx`` prefix) its documents
    packed into the rows instead of mock tokens; ``grads`` the gradient buffer's dtype (``GRAD_DTYPES``)."""
    if grads not in GRAD_DTYPES:
        raise ValueError(f"build_spec: grads must be one of {GRAD_DTYPES}, got {grads!r}")
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
        f"optim.main_grads_dtype={grads}",
    ]
    name = f"mcore_{shape_name}" + ("" if grads == "fp32" else f"-{grads}grads")
    if corpus is not None:
        overrides += data_overrides(corpus)
        name += "-packed"
    return RunSpec(name, 1, overrides, llama_model(shape), untimed_steps=1 + warmup, profile_steps=profile_steps)


class _BackendLog(logging.Handler):
    """Collects what ``mcore.kernels`` logs about attention's backend (each choice is logged once)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("mcore.kernels.attention: using the"):
            self.lines.append(message)


def run_ours(args: argparse.Namespace) -> int:
    """``--only mcore``: measure one shape in this process and write its JSON (the baseline's keys first)."""
    if args.attention_backend != "auto":
        os.environ["MCORE_ATTENTION_BACKEND"] = args.attention_backend
    backend_log = _BackendLog()
    kernels_logger = logging.getLogger("mcore.kernels")
    kernels_logger.setLevel(logging.INFO)
    kernels_logger.addHandler(backend_log)
    spec = build_spec(
        args.shape,
        iters=args.iters,
        warmup=args.warmup,
        dry_run=args.dry_run,
        profile_steps=args.profile_steps,
        corpus=args.corpus,
        grads=args.grads,
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
        "optimizer": f"DistributedOptimizer (dp=1), fp32 master weights and AdamW states, {args.grads} gradients",
        "grads": args.grads,
        "variant": "standard" if args.corpus is None else "packed",
        "attention_backend": args.attention_backend,
        "attention_backends_used": backend_log.lines,
        "flops_per_token": result["flops_per_token"],
        "iters": args.iters,
        "warmup": args.warmup,
        "step_times_s": result["step_times_s"],
        "losses": result["losses"],
        "profile": result["profile"][0] if result["profile"] else None,
    }
    if args.corpus is not None:
        record.update(_effective(spec, result))
    write_json(args.json, record)
    if record["profile"]:
        print(render_breakdown(record["profile"]), flush=True)
    print(json.dumps({k: record[k] for k in ("impl", "shape", "tokens_per_s", "tflops_per_gpu", "mfu", "peak_mem_gb")}))
    return 0


def _effective(spec: RunSpec, result: dict[str, Any]) -> dict[str, Any]:
    """The packed run's effective FLOPs per token, TFLOP/s and MFU over its timed steps (``packed_documents.py``)."""
    from mcore.models.accounting import model_flops_per_token

    config = spec_config(spec)
    gbs = config.train.global_batch_size
    rows = run_rows(config, len(result["steps"]) * gbs)
    timed = range(spec.untimed_steps + 1, len(result["steps"]) + 1)
    return packed_record(
        rows["position_ids"],
        gbs,
        timed,
        lambda n: model_flops_per_token(config.model, n),
        result["tokens_per_s"],
        result["peak_flops"],
    )


def ratios(results: dict[str, dict[str, Any] | None], ours: str = "mcore") -> dict[str, float | None]:
    """``ours`` / baseline for tokens/s and peak memory (``None`` where a run is missing or has no number)."""

    def ratio(key: str, other: str) -> float | None:
        a, b = results.get(ours), results.get(other)
        if a is None or b is None or not b.get(key) or not a.get(key):
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


def _row(shape: str, res: dict[str, Any]) -> list[Any]:
    if "unsupported" in res:
        return [shape, res["impl"], None, None, None, None, None, None, f"unsupported: {res['unsupported']}"]
    note = ", ".join(res.get("attention_backends_used", []))
    if "documents_per_row" in res:
        note = f"{res['documents_per_row']:.2f} docs/row, attention {res['attention_work_vs_unpacked']:.3f}x; {note}"
    numbers = [res["tokens_per_s"], 1000 * res["step_s"], res["tflops_per_gpu"], 100 * res["mfu"]]
    impl = res["impl"] + (f" [{res['attention_backend']}]" if res.get("attention_backend", "auto") != "auto" else "")
    impl += f" [{res['grads']} grads]" if res.get("grads", "fp32") != "fp32" else ""
    return [shape, impl, *numbers, res["peak_mem_gb"], res["first_step_s"], note]


def render(summary: dict[str, Any]) -> str:
    """A markdown table of every run, then the ratios per shape (packed rows: effective TFLOP/s and MFU)."""
    rows, ratio_lines = [], []
    for shape, entry in summary["shapes"].items():
        for label, res in entry["results"].items():
            rows.append([shape, label, *[None] * 6, "did not run"] if res is None else _row(shape, res))
        for label, r in entry.get("ratios_by_impl", {"mcore": entry["ratios"]}).items():
            ratio_lines.append(
                f"- {shape} {label}: tokens/s vs HF-eager {_fmt(r['tokens_per_s_vs_hf'])}, vs HF-compile "
                f"{_fmt(r['tokens_per_s_vs_hf_compile'])}; peak memory vs HF-eager {_fmt(r['peak_mem_vs_hf'])}, "
                f"vs HF-compile {_fmt(r['peak_mem_vs_hf_compile'])}"
            )
    headers = ["shape", "impl", "tokens/s", "step ms", "TFLOP/s/GPU", "MFU %", "peak GB", "first step s", "note"]
    return "\n".join([markdown_table(headers, rows), "", *ratio_lines])


def _labels(args: argparse.Namespace) -> dict[str, tuple[str, str]]:
    """Result label -> (attention backend, gradient dtype) of each mcore run (``mcore`` alone when one of each is
    asked for; else ``mcore-<backend>`` / ``mcore-<dtype>grads`` where several are)."""
    labels = {}
    for backend in args.attention_backend:
        for grads in args.grads:
            label = "mcore" + (f"-{backend}" if len(args.attention_backend) > 1 else "")
            labels[label + (f"-{grads}grads" if len(args.grads) > 1 else "")] = (backend, grads)
    return labels


def _runs(args: argparse.Namespace, shape: str, entry: str, packed: dict[str, Path] | None) -> list[tuple[str, list]]:
    """(label, script and arguments) of each run of ``entry`` (``shape`` or ``shape-packed``): ours, then the
    baselines; the JSON of each goes to ``--runs-dir``."""
    runs = []
    for label, (backend, grads) in _labels(args).items():
        ours = [str(Path(__file__).resolve()), "--only", "mcore", "--shape", shape, "--iters", str(args.iters)]
        ours += ["--warmup", str(args.warmup), "--profile-steps", str(args.profile_steps)]
        ours += ["--attention-backend", backend, "--grads", grads]
        ours += ["--json", str(args.runs_dir / f"{label}_{entry}.json")]
        ours += ["--corpus", str(packed["corpus"])] if packed else []
        runs.append((label, ours + (["--dry-run"] if args.dry_run else [])))
    if args.skip_baseline or (args.dry_run and not packed):  # hf_baseline.py needs CUDA; ours runs on CPU too
        return runs
    if packed:
        argv = [str(HF_PACKED_BASELINE), "--shape", shape, "--rows", str(packed["rows"]), "--iters", str(args.iters)]
        argv += ["--dry-run"] if args.dry_run else []
        return runs + [("hf", argv + ["--json", str(args.runs_dir / f"hf_{entry}.json")])]
    for label, extra in BASELINES.items():
        if label == "hf-compile" and args.skip_hf_compile:
            continue
        argv = [str(args.hf_baseline), "--shape", shape, *extra, "--iters", str(args.iters)]
        runs.append((label, argv + ["--json", str(args.runs_dir / f"{label}_{shape}.json")]))
    return runs


def prepare_packed(args: argparse.Namespace, shape: str, scratch: Path) -> dict[str, Any]:
    """The corpus of ``shape``'s packed run (twice the tokens the run reads, so no document repeats) and the rows
    of its steps for the Hugging Face baseline (the same rows, step by step)."""
    s = SHAPES[shape]
    steps = max(1 + args.warmup + args.iters + args.profile_steps, 3 + args.iters)  # hf: 1 + 2 warm-up + timed
    # As many steps as the longer of the two runs; their rows are the same (the corpus holds twice the tokens read,
    # so every row comes from the first epoch, whose order does not depend on the number of samples).
    extra = steps - 1 - args.warmup - args.iters
    spec = build_spec(
        shape, iters=args.iters, warmup=args.warmup, dry_run=args.dry_run, profile_steps=extra, corpus=scratch / shape
    )
    source = args.doc_source
    if args.dry_run and source.path is None:
        source = LengthSource(mean=source.mean * s["seq"] / GPU_SEQ, sigma=source.sigma)
    lengths = source.draw(args.seed, 2 * steps * s["mbs"] * s["seq"])
    write_corpus(scratch / shape, lengths, s["vocab"], args.seed)
    check_spec(spec)
    rows = run_rows(spec_config(spec), steps * s["mbs"])
    np.savez(scratch / f"{shape}-rows.npz", **rows)
    print(f"{shape}-packed: {len(lengths)} documents from {source.describe()}", flush=True)
    return {"corpus": scratch / shape, "rows": scratch / f"{shape}-rows.npz", "lengths": source.describe()}


def orchestrate(args: argparse.Namespace) -> int:
    """Ours, then the baselines, one process each and one after another, per shape and variant; the summary is
    rewritten after every run (a device call cut short still returns what finished)."""
    out: Path = args.json_dir
    out.mkdir(parents=True, exist_ok=True)
    args.runs_dir = args.runs_dir or out
    args.runs_dir.mkdir(parents=True, exist_ok=True)
    shapes = ["tiny"] if args.dry_run else args.shape
    standard_baseline = not (args.skip_baseline or args.dry_run) and "standard" in args.variants
    if standard_baseline and not args.hf_baseline.is_file():
        raise SystemExit(f"--hf-baseline: {args.hf_baseline} does not exist; pass the path of hf_baseline.py")
    if not args.skip_baseline and args.warmup != 2:
        print(f"note: the HF baselines always warm up 2 steps; mcore warms up {args.warmup}", flush=True)
    for shape in shapes:
        check_spec(build_spec(shape, iters=args.iters, warmup=args.warmup, dry_run=args.dry_run))
    env = child_env(dry_run=args.dry_run)
    summary: dict[str, Any] = {"shapes": {}, "failures": []}
    # One log for every run: a device call returns at most 8 files.
    log = out / "throughput.log"
    log.unlink(missing_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="mcore-packed-"))
    try:
        for shape in shapes:
            for variant in args.variants:
                packed = prepare_packed(args, shape, scratch) if variant == "packed" else None
                entry = shape if packed is None else f"{shape}-packed"
                _run_entry(args, shape, entry, packed, env, log, summary)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(render(summary), flush=True)
    for failure in summary["failures"]:
        print(f"FAILED: {failure}", flush=True)
    return 1 if summary["failures"] else 0


def _run_entry(args, shape: str, entry: str, packed, env, log: Path, summary: dict[str, Any]) -> None:
    """The runs of one shape and variant, the summary rewritten after each."""
    results: dict[str, dict[str, Any] | None] = {}
    for label, argv in _runs(args, shape, entry, packed):
        json_path = Path(argv[argv.index("--json") + 1])
        results[label] = run_one_launch(
            argv, json_path, f"{label} on {entry}", log=log, env=env, timeout_s=args.timeout,
            failures=summary["failures"],
        )  # fmt: skip
        mine = [k for k in _labels(args) if k in results]
        summary["shapes"][entry] = {
            "results": results,
            "ratios": ratios(results, mine[0]) if mine else ratios({}),
            "ratios_by_impl": {k: ratios(results, k) for k in mine},
            "baseline": _baseline(args, packed is not None),
        }
        if packed:
            summary["shapes"][entry]["document_lengths"] = packed["lengths"]
        write_json(args.json_dir / "summary.json", {**summary, "markdown": render(summary)})


def _baseline(args: argparse.Namespace, packed: bool) -> str:
    if args.skip_baseline or (args.dry_run and not packed):
        return "skipped"
    return str(HF_PACKED_BASELINE if packed else args.hf_baseline)


def _names(text: str, known: tuple[str, ...], option: str, ap: argparse.ArgumentParser) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names or len(set(names)) != len(names):
        ap.error(f"{option}: {text!r} is not a comma-separated list of distinct names from {', '.join(known)}")
    return names


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="all", help="comma-separated shapes: 1b, 8b4l, or all (tiny: dry runs)")
    ap.add_argument("--variants", default="standard", help="comma-separated: standard, packed (standard)")
    ap.add_argument(
        "--attention-backend",
        default="auto",
        help=f"comma-separated, one mcore run each: {', '.join(ATTENTION_BACKENDS)} (auto: the dispatcher's choice)",
    )
    ap.add_argument(
        "--grads",
        default="fp32",
        help=f"comma-separated, one mcore run each: the gradient buffer's dtype, {', '.join(GRAD_DTYPES)} (fp32)",
    )
    ap.add_argument("--doc-lengths", type=Path, help="lengths file (one per line) or a .bin/.idx prefix to draw from")
    ap.add_argument("--doc-mean", type=float, default=None, help="log-normal mean (FinePDFs-Edu's 4990 tokens)")
    ap.add_argument("--doc-sigma", type=float, default=None, help="log-normal sigma (1.4, assumed)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the document lengths and tokens (0)")
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
    ap.add_argument("--json-dir", type=Path, default=None, help="summary.json and the log (default: a temp dir)")
    ap.add_argument("--runs-dir", type=Path, default=None, help="each run's JSON (default: --json-dir)")
    ap.add_argument("--json", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--only", choices=["mcore"], help=argparse.SUPPRESS)
    ap.add_argument("--corpus", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per run (600)")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny fp32 shape, 3 iterations, HF only when packed")
    args = ap.parse_args(argv)
    _resolve(ap, args)
    return args


def _resolve(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Defaults that depend on ``--dry-run`` / ``--only``, the lists, and the checks."""
    args.iters = args.iters if args.iters is not None else (3 if args.dry_run else 8)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.dry_run else 2)
    args.profile_steps = args.profile_steps if args.profile_steps is not None else (0 if args.dry_run else 2)
    if args.dry_run and args.profile_steps:
        ap.error("--profile-steps needs a GPU (the breakdown reads CUDA kernels); leave it out of dry runs")
    if args.profile_steps < 0:
        ap.error(f"--profile-steps must be >= 0, got {args.profile_steps}")
    if args.iters < 1 or args.warmup < 0:
        ap.error(f"--iters must be >= 1 and --warmup >= 0, got {args.iters} and {args.warmup}")
    shapes = _names(args.shape, (*GPU_SHAPES, "all", "tiny"), "--shape", ap)
    if "all" in shapes and len(shapes) > 1:
        ap.error("--shape: 'all' stands alone")
    args.shape = list(GPU_SHAPES) if shapes == ["all"] else shapes
    args.variants = _names(args.variants, VARIANTS, "--variants", ap)
    backends = _names(args.attention_backend, ATTENTION_BACKENDS, "--attention-backend", ap)
    grads = _names(args.grads, GRAD_DTYPES, "--grads", ap)
    if args.doc_lengths is not None and (args.doc_mean is not None or args.doc_sigma is not None):
        ap.error("--doc-lengths draws from a file; --doc-mean / --doc-sigma shape the log-normal instead")
    try:
        args.doc_source = LengthSource(
            path=args.doc_lengths,
            **({"mean": args.doc_mean} if args.doc_mean is not None else {}),
            **({"sigma": args.doc_sigma} if args.doc_sigma is not None else {}),
        )
    except ValueError as exc:
        ap.error(str(exc))
    if args.only:
        if args.json is None or len(args.shape) != 1 or len(backends) != 1 or len(grads) != 1:
            ap.error("--only mcore needs --json FILE, one --shape, one --attention-backend and one --grads")
        args.shape, args.attention_backend, args.grads = args.shape[0], backends[0], grads[0]
        return
    args.attention_backend, args.grads = backends, grads
    if "tiny" in args.shape and not args.dry_run:
        ap.error("--shape tiny is the dry-run shape; use --dry-run")
    if args.json_dir is None:
        args.json_dir = Path(tempfile.mkdtemp(prefix="mcore-throughput-"))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return run_ours(args) if args.only else orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
