"""FP8 on one GPU: per-GEMM speedups, cast-kernel bandwidth, and the 8b4l training step in bf16 and each recipe.

1. **GEMMs** at the 8b4l linear shapes (M = seq 4096 x micro-batch 2 tokens; qkv, out_proj, gate_up, down), the
   three GEMMs of each (forward ``[M, K] x [N, K]^T``, dgrad ``[M, N] x [K, N]^T``, wgrad ``[N, M] x [K, M]^T``):
   bf16 ``torch.mm`` against ``scaled_matmul`` of pre-quantized operands in each recipe (tensorwise, rowwise,
   blockwise): TFLOP/s and speedup; plus "linear" = all three GEMMs and every cast the recipe's autograd
   function runs (``LowPrecisionLinear`` forward + backward), against the bf16 linear.
2. **Casts**: each quantizer on a bf16 ``[8192, 4096]`` tensor (and transposed), GB/s over the bytes read and
   written, against the copy bandwidth (``clone``) measured in the same run.
3. **Training**: the real ``mcore-train`` step on ``8b4l`` (``train_throughput.py``'s spec: seq 4096, micro-batch 2,
   distributed optimizer at dp=1, mock data) in bf16 and with ``train.precision=fp8`` per recipe: tokens/s,
   speedup, peak memory, final loss.

Timing: CUDA events, the median of ``--iters`` runs after ``--warmup``; on CPU (``--dry-run``: tiny shapes, the
reference GEMMs, the fp32 ``tiny`` model) ``time.perf_counter``. Writes ``OUT/fp8.json`` and ``OUT/fp8.md``
(rewritten after each part)::

    python benchmarks/fp8.py --out $OUT/fp8          # one H200, ~6 minutes
    python benchmarks/fp8.py --dry-run --out /tmp/fp8
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _common import SHAPES, RunSpec, markdown_table, run_spec, write_json

GEMM_RECIPES = ("tensorwise", "rowwise", "blockwise")
TRAIN_RECIPES = ("tensorwise", "delayed", "rowwise", "blockwise")
_PAIRS = {"tensorwise": ("tensor", "tensor"), "rowwise": ("row", "row"), "blockwise": ("1x128", "128x128")}


def linear_shapes(shape: dict[str, int]) -> dict[str, tuple[int, int, int]]:
    """name -> (M, N, K) of the four linears of a Llama layer of ``shape``."""
    h, heads, kv, ffn = shape["hidden"], shape["heads"], shape["kv"], shape["ffn"]
    m, head_dim = shape["seq"] * shape["mbs"], shape["hidden"] // shape["heads"]
    return {
        "qkv": (m, (heads + 2 * kv) * head_dim, h),
        "out_proj": (m, h, h),
        "gate_up": (m, 2 * ffn, h),
        "down": (m, h, ffn),
    }


def timer(fn: Callable[[], Any], iters: int, warmup: int, cuda: bool) -> float:
    """Median seconds of ``fn``."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_gemms(shapes, device, dtype, iters, warmup) -> list[dict[str, Any]]:
    from mcore.kernels.fp8_gemm import scaled_matmul
    from mcore.kernels.quantization import E4M3, quantize_fp8

    cuda = device.type == "cuda"
    rows = []
    for layer, (m, n, k) in shapes.items():
        gemms = {"fwd": (m, n, k), "dgrad": (m, k, n), "wgrad": (n, k, m)}
        for gemm, (gm, gn, gk) in gemms.items():
            a = torch.randn(gm, gk, device=device, dtype=dtype)
            b = torch.randn(gn, gk, device=device, dtype=dtype)
            flops = 2 * gm * gn * gk
            base = timer(lambda a=a, b=b: a @ b.t(), iters, warmup, cuda)
            rows.append(dict(layer=layer, gemm=gemm, impl="bf16", ms=1e3 * base, tflops=flops / base / 1e12))
            for recipe in GEMM_RECIPES:
                qa = quantize_fp8(a, E4M3, _PAIRS[recipe][0])
                qb = quantize_fp8(b, E4M3, _PAIRS[recipe][1])
                t = timer(lambda qa=qa, qb=qb: scaled_matmul(qa, qb, out_dtype=dtype), iters, warmup, cuda)
                rows.append(
                    dict(layer=layer, gemm=gemm, impl=recipe, ms=1e3 * t, tflops=flops / t / 1e12, speedup=base / t)
                )
        rows += bench_linear(layer, (m, n, k), device, dtype, iters, warmup)
    return rows


def bench_linear(layer, mnk, device, dtype, iters, warmup) -> list[dict[str, Any]]:
    """The whole linear, forward + backward with every cast the recipe runs, against the bf16 linear."""
    from mcore.kernels.low_precision_linear import LowPrecisionLinear, Recipe

    m, n, k = mnk
    x = torch.randn(m, k, device=device, dtype=dtype, requires_grad=True)
    w = torch.randn(n, k, device=device, dtype=dtype, requires_grad=True)
    g = torch.randn(m, n, device=device, dtype=dtype)
    impls = {"bf16": torch.nn.functional.linear}
    impls.update({recipe: LowPrecisionLinear(Recipe(recipe)) for recipe in TRAIN_RECIPES})
    rows, base = [], None
    for impl, fn in impls.items():

        def step(fn=fn):
            fn(x, w).backward(g)

        t = timer(step, iters, warmup, device.type == "cuda")
        base = t if base is None else base
        rows.append(
            dict(layer=layer, gemm="linear", impl=impl, ms=1e3 * t, tflops=6 * m * n * k / t / 1e12, speedup=base / t)
        )
    return rows


def bench_casts(rows_cols, device, dtype, iters, warmup) -> list[dict[str, Any]]:
    from mcore.kernels.quantization import E4M3, quantize_fp8, quantize_fp8_pair

    cuda = device.type == "cuda"
    x = torch.randn(*rows_cols, device=device, dtype=dtype)
    n, size = x.numel(), x.element_size()
    copy = timer(lambda: x.clone(), iters, warmup, cuda)
    copy_gbps = 2 * n * size / copy / 1e9
    out = [dict(cast="copy (clone)", ms=1e3 * copy, gbps=copy_gbps, pct_copy=100.0)]
    amax = x.abs().amax().float()
    cases = {
        "tensorwise pair (x and x^T, given amax)": (lambda: quantize_fp8_pair(x, E4M3, amax=amax), n * (size + 2)),
        "tensorwise (amax + cast)": (lambda: quantize_fp8(x, E4M3, "tensor"), n * (2 * size + 1)),
        "rowwise (amax + cast)": (lambda: quantize_fp8(x, E4M3, "row"), n * (2 * size + 1)),
        "rowwise transposed": (lambda: quantize_fp8(x, E4M3, "row", transpose=True), n * (2 * size + 1)),
        "1x128": (lambda: quantize_fp8(x, E4M3, "1x128"), n * (size + 1)),
        "1x128 transposed": (lambda: quantize_fp8(x, E4M3, "1x128", transpose=True), n * (size + 1)),
        "128x128": (lambda: quantize_fp8(x, E4M3, "128x128"), n * (size + 1)),
        "128x128 transposed": (lambda: quantize_fp8(x, E4M3, "128x128", transpose=True), n * (size + 1)),
    }
    for name, (fn, nbytes) in cases.items():
        t = timer(fn, iters, warmup, cuda)
        gbps = nbytes / t / 1e9
        out.append(dict(cast=name, ms=1e3 * t, gbps=gbps, pct_copy=100 * gbps / copy_gbps))
    return out


def train_spec(name: str, recipe: str | None, dry_run: bool, iters: int, warmup: int) -> RunSpec:
    sys.path.insert(0, str(Path(__file__).parent))
    from train_throughput import build_spec

    spec = build_spec("tiny" if dry_run else "8b4l", iters=iters, warmup=warmup, dry_run=dry_run)
    spec.name = name
    if dry_run:  # the tiny model, widened so that every linear fits the 128-element blocks
        spec.model.update(hidden_size=128, intermediate_size=256)
    if recipe is not None:
        spec.overrides += ["train.precision=fp8", f"fp8.recipe={recipe}"]
    return spec


def bench_training(dry_run: bool, iters: int, warmup: int) -> list[dict[str, Any]]:
    rows = []
    for recipe in (None, *TRAIN_RECIPES):
        name = f"8b4l-{recipe or 'bf16'}"
        result, runtime = run_spec(train_spec(name, recipe, dry_run, iters, warmup))
        runtime.shutdown()
        keys = ("precision", "tokens_per_s", "step_s", "tflops_per_gpu", "mfu", "peak_mem_gb", "final_loss")
        row = {"config": name, "recipe": recipe or "bf16", **{k: result[k] for k in keys}}
        row["losses"] = result["losses"]
        rows.append(row)
    base = rows[0]["tokens_per_s"]
    for row in rows:
        row["speedup"] = row["tokens_per_s"] / base
    return rows


def render(data: dict[str, Any]) -> str:
    parts = [f"# FP8 benchmark ({data['device']}, torch {data['torch']}, {data['date']})"]
    if data.get("gemms"):
        rows = [[r["layer"], r["gemm"], r["impl"], r["ms"], r["tflops"], r.get("speedup", "")] for r in data["gemms"]]
        parts.append(markdown_table(["layer", "GEMM", "impl", "ms", "TFLOP/s", "speedup"], rows))
    if data.get("casts"):
        rows = [[r["cast"], r["ms"], r["gbps"], r["pct_copy"]] for r in data["casts"]]
        parts.append(markdown_table(["cast", "ms", "GB/s", "% of copy"], rows))
    if data.get("training"):
        keys = ["config", "tokens_per_s", "speedup", "step_s", "mfu", "peak_mem_gb", "final_loss"]
        parts.append(markdown_table(keys, [[r[k] for k in keys] for r in data["training"]]))
    return "\n\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, reference GEMMs")
    parser.add_argument("--iters", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--skip", default="", help="comma-separated parts to skip: gemms, casts, training")
    args = parser.parse_args(argv)
    device = torch.device("cpu" if args.dry_run else "cuda")
    if not args.dry_run and not torch.cuda.is_available():
        parser.error("no CUDA device: run with --dry-run on CPU")
    iters = args.iters or (2 if args.dry_run else 20)
    warmup = args.warmup if args.warmup is not None else (1 if args.dry_run else 5)
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    skip = {s for s in args.skip.split(",") if s}
    shape = dict(SHAPES["8b4l"])
    if args.dry_run:
        shape.update(hidden=128, heads=4, kv=2, ffn=256, seq=64, mbs=2)
    data: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "dry_run": args.dry_run,
        "linear_shapes": linear_shapes(shape),
    }

    def save() -> None:
        write_json(args.out / "fp8.json", data)
        (args.out / "fp8.md").write_text(render(data))

    if "gemms" not in skip:
        data["gemms"] = bench_gemms(linear_shapes(shape), device, dtype, iters, warmup)
        save()
    if "casts" not in skip:
        data["casts"] = bench_casts((256, 512) if args.dry_run else (8192, 4096), device, dtype, iters, warmup)
        save()
    if "training" not in skip:
        steps = dict(iters=3, warmup=0) if args.dry_run else dict(iters=10, warmup=3)
        data["training"] = bench_training(args.dry_run, **steps)
        save()
    print(render(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
