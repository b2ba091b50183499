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
4. **Experts**: the ``mixtral2l`` expert GEMMs (8 experts, 2 x 4096 x 2 routed rows, gate_up [8, 28672, 4096] and
   down [8, 4096, 14336], balanced) forward + backward through ``grouped_gemm`` (bf16) and ``fp8_grouped_gemm``
   (row-wise fp8, every cast included); then ``mixtral2l`` training (``moe_throughput.py``'s spec) in bf16 and
   with ``train.precision=fp8 fp8.recipe=rowwise`` (fp8 attention linears and experts).

Timing: CUDA events, the median of ``--iters`` runs after ``--warmup``; on CPU (``--dry-run``: tiny shapes, the
reference GEMMs, the fp32 ``tiny`` model) ``time.perf_counter``. Writes ``OUT/fp8.json`` and ``OUT/fp8.md``
(rewritten after each part)::

    python benchmarks/fp8.py --out $OUT/fp8          # one H200, ~4 minutes
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
# the weight gradient contracts over tokens: block-wise, both of its operands are 1x128 tiles along them
_WGRAD_PAIRS = {**_PAIRS, "blockwise": ("1x128", "1x128")}


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
            for recipe in (*GEMM_RECIPES, "blockwise-triton"):
                pair = (_WGRAD_PAIRS if gemm == "wgrad" else _PAIRS)[recipe.removesuffix("-triton")]
                # "blockwise-triton": mcore's Triton block-scaled GEMM (on CPU: the interpreter is too slow, skip)
                backend = "triton" if recipe.endswith("-triton") else None
                if backend and not cuda:
                    continue
                row = dict(layer=layer, gemm=gemm, impl=recipe)
                try:
                    qa, qb = quantize_fp8(a, E4M3, pair[0]), quantize_fp8(b, E4M3, pair[1])
                    step = lambda qa=qa, qb=qb, be=backend: scaled_matmul(qa, qb, out_dtype=dtype, backend=be)  # noqa: E731
                    t = timer(step, iters, warmup, cuda)
                    row.update(ms=1e3 * t, tflops=flops / t / 1e12, speedup=base / t)
                except (RuntimeError, ValueError) as exc:  # one refused GEMM must not stop the table
                    row["error"] = _first_line(exc)
                rows.append(row)
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

        row = dict(layer=layer, gemm="linear", impl=impl)
        try:
            t = timer(step, iters, warmup, device.type == "cuda")
            base = t if base is None else base
            row.update(ms=1e3 * t, tflops=6 * m * n * k / t / 1e12, speedup=base / t)
        except (RuntimeError, ValueError) as exc:
            row["error"] = _first_line(exc)
        rows.append(row)
    return rows


def _first_line(exc: Exception) -> str:
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}"


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
    keys = ("precision", "tokens_per_s", "step_s", "tflops_per_gpu", "mfu", "peak_mem_gb", "final_loss")
    for recipe in (None, *TRAIN_RECIPES):
        name = f"8b4l-{recipe or 'bf16'}"
        try:
            result, runtime = run_spec(train_spec(name, recipe, dry_run, iters, warmup))
        except Exception as exc:  # noqa: BLE001 - a failing recipe is a row of the table, the others still run
            rows.append({"config": name, "recipe": recipe or "bf16", "error": _first_line(exc)})
            continue
        runtime.shutdown()
        row = {"config": name, "recipe": recipe or "bf16", **{k: result[k] for k in keys}}
        row["losses"] = result["losses"]
        rows.append(row)
    base = rows[0].get("tokens_per_s")
    for row in rows:
        if base and "tokens_per_s" in row:
            row["speedup"] = row["tokens_per_s"] / base
    return rows


def bench_expert_gemms(dry_run: bool, device, dtype, iters: int, warmup: int) -> list[dict[str, Any]]:
    """Forward + backward of the two expert GEMMs in bf16 and row-wise fp8, every cast included."""
    from mcore.kernels.fp8_grouped_gemm import fp8_grouped_gemm
    from mcore.kernels.grouped_gemm import grouped_gemm

    experts, hidden, ffn, rows = (4, 64, 96, 128) if dry_run else (8, 4096, 14336, 2 * 4096 * 2)
    offsets = torch.arange(1, experts + 1, device=device, dtype=torch.int32) * (rows // experts)
    shapes = {"gate_up": (2 * ffn, hidden), "down": (hidden, ffn)}
    out = []
    for name, (n, k) in shapes.items():
        x = torch.randn(rows, k, device=device, dtype=dtype, requires_grad=True)
        w = (torch.randn(experts, n, k, device=device, dtype=dtype) * 0.02).requires_grad_()
        g = torch.randn(rows, n, device=device, dtype=dtype)
        base = None
        for impl, fn in (("bf16", grouped_gemm), ("fp8-rowwise", fp8_grouped_gemm)):
            row = dict(gemm=name, impl=impl, rows=rows, n=n, k=k)
            try:
                step = lambda fn=fn, x=x, w=w, g=g: fn(x, w, offsets).backward(g)  # noqa: E731
                t = timer(step, iters, warmup, device.type == "cuda")
                base = t if base is None else base
                row.update(ms=1e3 * t, tflops=6 * rows * n * k / t / 1e12, speedup=base / t)
            except (RuntimeError, ValueError) as exc:
                row["error"] = _first_line(exc)
            out.append(row)
    return out


def bench_moe_training(dry_run: bool, iters: int, warmup: int) -> list[dict[str, Any]]:
    """``mixtral2l`` (``moe_throughput.py``'s spec) in bf16 and with fp8 row-wise linears and experts."""
    sys.path.insert(0, str(Path(__file__).parent))
    from moe_throughput import build_spec

    keys = ("precision", "tokens_per_s", "step_s", "tflops_per_gpu", "mfu", "peak_mem_gb", "final_loss")
    rows = []
    for recipe in (None, "rowwise"):
        spec = build_spec("tiny" if dry_run else "mixtral2l", iters=iters, warmup=warmup, dry_run=dry_run)
        spec.name = f"mixtral2l-{recipe or 'bf16'}"
        if recipe is not None:
            spec.overrides += ["train.precision=fp8", f"fp8.recipe={recipe}"]
        try:
            result, runtime = run_spec(spec)
        except Exception as exc:  # noqa: BLE001 - a failing run is a row of the table
            rows.append({"config": spec.name, "recipe": recipe or "bf16", "error": _first_line(exc)})
            continue
        runtime.shutdown()
        rows.append({"config": spec.name, "recipe": recipe or "bf16", **{k: result[k] for k in keys}})
    base = rows[0].get("tokens_per_s")
    for row in rows:
        if base and "tokens_per_s" in row:
            row["speedup"] = row["tokens_per_s"] / base
    return rows


def render(data: dict[str, Any]) -> str:
    parts = [f"# FP8 benchmark ({data['device']}, torch {data['torch']}, {data['date']})"]
    if data.get("gemms"):
        rows = [
            [r["layer"], r["gemm"], r["impl"], r.get("ms"), r.get("tflops"), r.get("speedup", r.get("error"))]
            for r in data["gemms"]
        ]
        parts.append(markdown_table(["layer", "GEMM", "impl", "ms", "TFLOP/s", "speedup (or error)"], rows))
    if data.get("casts"):
        rows = [[r["cast"], r["ms"], r["gbps"], r["pct_copy"]] for r in data["casts"]]
        parts.append(markdown_table(["cast", "ms", "GB/s", "% of copy"], rows))
    if data.get("training"):
        keys = ["config", "tokens_per_s", "speedup", "step_s", "mfu", "peak_mem_gb", "final_loss", "error"]
        parts.append(markdown_table(keys, [[r.get(k, "") for k in keys] for r in data["training"]]))
    if data.get("experts"):
        keys = ["gemm", "impl", "rows", "n", "k", "ms", "tflops", "speedup", "error"]
        parts.append(markdown_table(keys, [[r.get(k, "") for k in keys] for r in data["experts"]]))
    if data.get("moe_training"):
        keys = ["config", "tokens_per_s", "speedup", "step_s", "mfu", "peak_mem_gb", "final_loss", "error"]
        parts.append(markdown_table(keys, [[r.get(k, "") for k in keys] for r in data["moe_training"]]))
    return "\n\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, reference GEMMs")
    parser.add_argument("--iters", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument(
        "--skip", default="", help="comma-separated parts to skip: gemms, casts, training, experts, moe_training"
    )
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
    if "experts" not in skip:
        data["experts"] = bench_expert_gemms(args.dry_run, device, dtype, iters, warmup)
        save()
    if "moe_training" not in skip:
        steps = dict(iters=3, warmup=0) if args.dry_run else dict(iters=10, warmup=3)
        data["moe_training"] = bench_moe_training(args.dry_run, **steps)
        save()
    print(render(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
