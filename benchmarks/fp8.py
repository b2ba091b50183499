"""FP8 on one GPU: per-GEMM speedups, cast-kernel bandwidth, and the 8b4l training step in bf16 and each recipe.

1. **GEMMs** at the 8b4l linear shapes (M = seq 4096 x micro-batch 2 tokens; qkv, out_proj, gate_up, down), the
   three GEMMs of each (forward ``[M, K] x [N, K]^T``, dgrad ``[M, N] x [K, N]^T``, wgrad ``[N, M] x [K, M]^T``):
   bf16 ``torch.mm`` against ``scaled_matmul`` of pre-quantized operands in each recipe (tensorwise, rowwise,
   blockwise): TFLOP/s and speedup.
   **Linears**: all three GEMMs and every cast the recipe's autograd function runs (``LowPrecisionLinear``
   forward + backward), against the bf16 linear, also with the weight's casts from the cache (every micro-batch
   of a step after the first); eager (the host launching) and replayed from a CUDA graph (the GPU alone).
2. **Casts**: each fused operand-and-transpose cast (``quantize_dual``) and the two single casts it replaces, on
   a bf16 ``[8192, 4096]`` tensor: GB/s over the bytes each moves, against the copy (``clone``) in the same run.
   With ``--sweep-casts``, first every candidate launch shape of the fused cast kernels (``fp8_cast_sweep.py``)
   on the same tensor, and the fastest of each.
3. **Training**: the real ``mcore-train`` step on ``8b4l`` (``train_throughput.py``'s spec: seq 4096, micro-batch 2,
   distributed optimizer at dp=1, mock data) in bf16 and with ``train.precision=fp8`` per recipe: tokens/s,
   speedup, peak memory, final loss; on the GPU one more step per row under the CUDA profiler
   (``step_profile.py``, ``--profile-steps``): the row's ``profile`` and its ``time_breakdown`` (ms per step:
   fp8 casts, fp8 GEMMs, bf16 GEMMs, attention, optimizer, the rest, GPU idle), to show what the fp8 step still
   spends beside its GEMMs.
4. **Experts**: the ``mixtral2l`` expert GEMMs (8 experts, 2 x 4096 x 2 routed rows, gate_up [8, 28672, 4096] and
   down [8, 4096, 14336], balanced) forward + backward through ``grouped_gemm`` (bf16) and ``fp8_grouped_gemm``
   (row-wise fp8, every cast included); then ``mixtral2l`` training (``moe_throughput.py``'s spec) in bf16 and
   with ``train.precision=fp8 fp8.recipe=rowwise`` (fp8 attention linears and experts; ``--moe-recipes`` for
   others), at one micro-batch per step or at each count of ``--moe-micro-batches`` (e.g. ``1,8``: gradient
   accumulation, where the experts' weight casts are made once per step).

The parts run in the order casts, training (saved row by row), linears, GEMMs, experts, MoE training. Timing:
CUDA events, the median over windows of ``--iters`` back-to-back calls after ``--warmup`` (and CUDA-graph
replays); on CPU (``--dry-run``: tiny shapes, the reference GEMMs, the fp32 ``tiny`` model) ``time.perf_counter``.
Writes ``OUT/fp8.json`` and ``OUT/fp8.md`` (rewritten after each part and each training row)::

    python benchmarks/fp8.py --out $OUT/fp8          # one H200, ~4 minutes
    python benchmarks/fp8.py --out $OUT/fp8 --skip gemms,experts,moe_training   # casts, linears, 8b4l: ~2.5 min
    python benchmarks/fp8.py --out $OUT/fp8 --skip gemms,linears,casts,training,experts --moe-micro-batches 1,8
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
# training-row labels beside the recipe names (--train-configs only): their config overrides
RECIPE_OVERRIDES = {"delayed-recast": ["fp8.recipe=delayed", "fp8.delayed_overflow=recast"]}
# training rows: a recipe, or a recipe with "+output": the output layer in fp8 too (fp8.keep=[]; it is kept in
# bf16 by default, and on 8b4l its GEMMs are 37% of the step's GEMM FLOPs)
TRAIN_CONFIGS = (*TRAIN_RECIPES, "tensorwise+output")
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
    """Seconds per call of ``fn``: the median over 5 windows of back-to-back calls (CUDA events around each
    window, so the host may run ahead as it does in training; a call whose host work outlasts its GPU work is
    timed by the host)."""
    for _ in range(warmup):
        fn()
    windows, per_window = [], max(1, iters // 5)
    for _ in range(5 if iters >= 5 else 1):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(per_window):
                fn()
            end.record()
            end.synchronize()
            windows.append(start.elapsed_time(end) / 1e3 / per_window)
        else:
            t0 = time.perf_counter()
            for _ in range(per_window):
                fn()
            windows.append((time.perf_counter() - t0) / per_window)
    return statistics.median(windows)


def graph_timer(fn: Callable[[], Any], iters: int) -> float:
    """Seconds per call of ``fn`` replayed from a CUDA graph: the GPU's time alone, without the host's launches."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside the capture (allocator, Triton compilation, autograd state)
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def _graph_ms(fn: Callable[[], Any], iters: int, cuda: bool) -> dict[str, Any]:
    """``{"graph_ms": ...}`` on CUDA (or the capture's error), nothing on CPU."""
    if not cuda:
        return {}
    try:
        return {"graph_ms": 1e3 * graph_timer(fn, iters)}
    except Exception as exc:  # noqa: BLE001 - a capture failure is reported, the eager number stands
        return {"graph_error": _first_line(exc)}


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
    return rows


def bench_linears(shapes, device, dtype, iters, warmup) -> list[dict[str, Any]]:
    """Each whole linear, forward + backward with every cast the recipe runs, against the bf16 linear."""
    from mcore.kernels.fp8_weight_cache import WeightCastCache
    from mcore.kernels.low_precision_linear import LowPrecisionLinear, Recipe

    cuda = device.type == "cuda"
    rows = []
    for layer, (m, n, k) in shapes.items():
        x = torch.randn(m, k, device=device, dtype=dtype, requires_grad=True)
        w = torch.randn(n, k, device=device, dtype=dtype, requires_grad=True)
        g = torch.randn(m, n, device=device, dtype=dtype)
        impls = {"bf16": torch.nn.functional.linear}
        impls.update({recipe: LowPrecisionLinear(Recipe(recipe)) for recipe in TRAIN_RECIPES})
        # a micro-batch after a step's first: the weight's casts come from the cache (one cast per step)
        impls.update(
            {f"{r}+weight cache": LowPrecisionLinear(Recipe(r), weight_cache=WeightCastCache()) for r in GEMM_RECIPES}
        )
        base = None
        for impl, fn in impls.items():

            def step(fn=fn, x=x, w=w, g=g):
                torch.autograd.grad(fn(x, w), (x, w), g)

            row = dict(layer=layer, gemm="linear", impl=impl)
            try:
                t = timer(step, iters, warmup, cuda)
                base = t if base is None else base
                row.update(ms=1e3 * t, tflops=6 * m * n * k / t / 1e12, speedup=base / t)
                row.update(_graph_ms(step, iters, cuda))
                if "graph_ms" in row and impl != "bf16":
                    bf16 = next(r for r in rows if r["layer"] == layer and r["impl"] == "bf16")
                    if "graph_ms" in bf16:
                        row["graph_speedup"] = bf16["graph_ms"] / row["graph_ms"]
            except (RuntimeError, ValueError) as exc:
                row["error"] = _first_line(exc)
            rows.append(row)
    return rows


def _first_line(exc: Exception) -> str:
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}"


def bench_casts(rows_cols, device, dtype, iters, warmup) -> list[dict[str, Any]]:
    """Every operand-and-transpose cast a linear runs (``quantize_dual``) and, for comparison, the same two
    operands from two single casts (``quantize_fp8`` of x and of x^T): GB/s over the bytes each moves, against
    the copy (``clone``) measured here; ``of ideal``: the time of the fewest bytes (read x once, write q and q^T)
    at the copy's rate over the time taken."""
    from mcore.kernels.fp8_casts import DUAL_PATH, quantize_dual
    from mcore.kernels.quantization import E4M3, quantize_fp8

    cuda = device.type == "cuda"
    x = torch.randn(*rows_cols, device=device, dtype=dtype)
    n, size = x.numel(), x.element_size()
    copy = timer(lambda: x.clone(), iters, warmup, cuda)
    copy_gbps = 2 * n * size / copy / 1e9
    out = [dict(cast="copy (clone)", ms=1e3 * copy, gbps=copy_gbps, pct_copy=100.0, **_graph_ms(x.clone, iters, cuda))]
    ideal_s = n * (size + 2) / (copy_gbps * 1e9)
    amax = x.abs().amax().float()
    passes = {"tensor": 2, "row": 2, "1x128": 1, "128x128": 1}
    cases = {}
    for granularity, reads in passes.items():
        cases[f"{granularity} fused q + q^T"] = (
            lambda g=granularity: _fused_dual(x, g, cuda),
            n * (reads * size + 2),
        )
        # what the linears run: fp8_casts.DUAL_PATH's choice between the fused kernel and the two single casts
        cases[f"{granularity} quantize_dual ({DUAL_PATH[granularity]})"] = (
            lambda g=granularity: quantize_dual(x, E4M3, g),
            n * ((reads if DUAL_PATH[granularity] == "fused" else 2) * size + 2),
        )
        cases[f"{granularity} two single casts"] = (
            lambda g=granularity: (quantize_fp8(x, E4M3, g), quantize_fp8(x, E4M3, g, transpose=True)),
            n * ((2 * reads if granularity in ("tensor", "row") else 2) * size + 2),
        )
    cases["tensor fused, given amax (delayed)"] = (lambda: quantize_dual(x, E4M3, "tensor", amax=amax), n * (size + 2))
    for name, (fn, nbytes) in cases.items():
        t = timer(fn, iters, warmup, cuda)
        row = dict(cast=name, ms=1e3 * t, gbps=nbytes / t / 1e9, pct_copy=100 * nbytes / t / 1e9 / copy_gbps)
        row.update(pct_ideal=100 * ideal_s / t, **_graph_ms(fn, iters, cuda))
        if "graph_ms" in row:
            row["graph_pct_ideal"] = 100 * ideal_s / (row["graph_ms"] / 1e3)
        out.append(row)
    return out


def bench_cast_sweep(rows_cols, device, dtype, iters, warmup) -> dict[str, Any]:
    """``fp8_cast_sweep.sweep_casts`` on a random ``rows_cols`` tensor, each fused cast timed like the casts part."""
    from fp8_cast_sweep import sweep_casts

    cuda = device.type == "cuda"
    x = torch.randn(*rows_cols, device=device, dtype=dtype)
    return sweep_casts(x, lambda t, g: 1e3 * timer(lambda: _fused_dual(t, g, cuda), iters, warmup, cuda))


def _fused_dual(x: torch.Tensor, granularity: str, cuda: bool):
    """The fused operand-and-transpose kernel of ``granularity`` whatever ``DUAL_PATH`` chose (CPU: the reference)."""
    from mcore.kernels.fp8_casts import quantize_dual
    from mcore.kernels.quantization import E4M3, fp8_dtype

    if cuda and granularity in ("1x128", "128x128"):
        from mcore.kernels.triton.quant_fused import block_dual

        return block_dual(x, fp8_dtype(E4M3), granularity == "128x128", write_t=True)
    return quantize_dual(x, E4M3, granularity)


def train_spec(
    name: str, recipe: str | None, dry_run: bool, iters: int, warmup: int, profile_steps: int = 0
) -> RunSpec:
    sys.path.insert(0, str(Path(__file__).parent))
    from train_throughput import build_spec

    shape = "tiny" if dry_run else "8b4l"
    spec = build_spec(shape, iters=iters, warmup=warmup, dry_run=dry_run, profile_steps=profile_steps)
    spec.name = name
    if dry_run:  # the tiny model, widened so that every linear fits the 128-element blocks
        spec.model.update(hidden_size=128, intermediate_size=256)
    if recipe is not None:
        base, _, extra = recipe.partition("+")
        spec.overrides += ["train.precision=fp8", *RECIPE_OVERRIDES.get(base, [f"fp8.recipe={base}"])]
        spec.overrides += ["fp8.keep=[]"] if extra == "output" else []
    return spec


# time_breakdown: step_profile's categories folded into what decides the fp8 speedup (the rest: "other")
_BREAKDOWN = {
    "fp8 cast": ("fp8 cast",),
    "fp8 gemm": ("fp8 gemm",),
    "bf16 gemm": ("gemm",),
    "attention": ("attention",),
    "optimizer": ("optimizer",),
    "copy/cast (torch)": ("copy/cast",),
}


def time_breakdown(profile: dict[str, Any] | None) -> dict[str, float] | None:
    """ms per step of ``_BREAKDOWN``'s groups, ``other`` (every other category), ``idle`` (the GPU waiting for the
    host) and ``step`` (the profiled step window) from ``step_profile``'s breakdown; ``None`` without a profile."""
    if not profile:
        return None
    cats = dict(profile["categories_ms"])
    out = {group: sum(cats.pop(c, 0.0) for c in members) for group, members in _BREAKDOWN.items()}
    out["other"] = sum(cats.values())
    out["idle"] = profile["idle_ms"]
    out["step"] = profile["step_window_ms"]
    return out


def bench_training(
    dry_run: bool,
    iters: int,
    warmup: int,
    configs=TRAIN_CONFIGS,
    rows: list | None = None,
    on_row=None,
    profile_steps: int = 0,
) -> list[dict[str, Any]]:
    """``8b4l`` through the Trainer (``run_spec``) in bf16, then in each of ``configs``, in this process; each row is
    appended to ``rows`` as it finishes and ``on_row()`` called (the caller saves: a cut run keeps its rows).
    ``profile_steps`` more steps per row under the CUDA profiler give the row's ``profile`` and ``time_breakdown``."""
    rows = [] if rows is None else rows
    keys = ("precision", "tokens_per_s", "step_s", "tflops_per_gpu", "mfu", "peak_mem_gb", "final_loss")
    for recipe in (None, *configs):
        name = f"8b4l-{recipe or 'bf16'}"
        t0 = time.perf_counter()
        try:
            result, runtime = run_spec(train_spec(name, recipe, dry_run, iters, warmup, profile_steps))
        except Exception as exc:  # noqa: BLE001 - a failing recipe is a row of the table, the others still run
            rows.append({"config": name, "recipe": recipe or "bf16", "error": _first_line(exc)})
        else:
            runtime.shutdown()
            row = {"config": name, "recipe": recipe or "bf16", **{k: result[k] for k in keys}}
            row["losses"] = result["losses"]
            row["profile"] = result["profile"][0] if result.get("profile") else None
            row["time_breakdown"] = time_breakdown(row["profile"])
            rows.append(row)
        base = rows[0].get("tokens_per_s")
        if base and "tokens_per_s" in rows[-1]:
            rows[-1]["speedup"] = rows[-1]["tokens_per_s"] / base
        rows[-1]["wall_s"] = time.perf_counter() - t0
        print(
            f"fp8.py: {name} {rows[-1].get('tokens_per_s', rows[-1].get('error'))} ({rows[-1]['wall_s']:.1f} s)",
            flush=True,
        )
        if on_row is not None:
            on_row()
    return rows


def bench_expert_gemms(dry_run: bool, device, dtype, iters: int, warmup: int) -> list[dict[str, Any]]:
    """Forward + backward of the two expert GEMMs in bf16, row-wise fp8 and block-wise fp8 (``triton`` on CUDA: the
    own block-scaled grouped kernel; the rows per expert are multiples of 128), every cast included."""
    from mcore.kernels.fp8_block_grouped_gemm import fp8_block_grouped_gemm
    from mcore.kernels.fp8_grouped_gemm import fp8_grouped_gemm
    from mcore.kernels.grouped_gemm import grouped_gemm

    experts, hidden, ffn, rows = (2, 128, 128, 256) if dry_run else (8, 4096, 14336, 2 * 4096 * 2)
    offsets = torch.arange(1, experts + 1, device=device, dtype=torch.int32) * (rows // experts)
    shapes = {"gate_up": (2 * ffn, hidden), "down": (hidden, ffn)}
    out = []
    for name, (n, k) in shapes.items():
        x = torch.randn(rows, k, device=device, dtype=dtype, requires_grad=True)
        w = (torch.randn(experts, n, k, device=device, dtype=dtype) * 0.02).requires_grad_()
        g = torch.randn(rows, n, device=device, dtype=dtype)
        base = None
        impls = (("bf16", grouped_gemm), ("fp8-rowwise", fp8_grouped_gemm), ("fp8-blockwise", fp8_block_grouped_gemm))
        for impl, fn in impls:
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


def bench_moe_training(
    dry_run: bool,
    iters: int,
    warmup: int,
    micro_batches: tuple[int, ...] = (1,),
    recipes: tuple[str, ...] = ("rowwise",),
) -> list[dict[str, Any]]:
    """``mixtral2l`` (``moe_throughput.py``'s spec) in bf16 and with fp8 linears and experts (``recipes``), at each
    count of ``micro_batches`` per step (gradient accumulation: the experts' weight casts are made once per step and
    reused, ``fp8.weight_cache``); each row's speedup is against the bf16 row of the same micro-batch count."""
    sys.path.insert(0, str(Path(__file__).parent))
    from moe_throughput import SHAPES as MOE_SHAPES
    from moe_throughput import build_spec

    keys = ("precision", "tokens_per_s", "step_s", "tflops_per_gpu", "mfu", "peak_mem_gb", "final_loss")
    shape = "tiny" if dry_run else "mixtral2l"
    rows = []
    for count in micro_batches:
        batch = [f"train.global_batch_size={MOE_SHAPES[shape]['mbs'] * count}"]
        first = len(rows)
        for recipe in (None, *recipes):
            spec = build_spec(shape, iters=iters, warmup=warmup, dry_run=dry_run, extra_overrides=batch)
            spec.name = f"mixtral2l-{recipe or 'bf16'}" + (f"-mb{count}" if count != 1 else "")
            if recipe is not None:
                spec.overrides += ["train.precision=fp8", f"fp8.recipe={recipe}"]
            row = {"config": spec.name, "recipe": recipe or "bf16", "micro_batches": count}
            try:
                result, runtime = run_spec(spec)
            except Exception as exc:  # noqa: BLE001 - a failing run is a row of the table
                rows.append({**row, "error": _first_line(exc)})
                continue
            runtime.shutdown()
            rows.append({**row, **{k: result[k] for k in keys}})
        base = rows[first].get("tokens_per_s")
        for row in rows[first:]:
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
    if data.get("linears"):
        keys = ["layer", "impl", "ms", "tflops", "speedup", "graph_ms", "graph_speedup", "error", "graph_error"]
        parts.append(markdown_table(keys, [[r.get(k, "") for k in keys] for r in data["linears"]]))
    if data.get("cast_sweep"):
        sweep = data["cast_sweep"]
        rows = [[name, tile, ms] for name, tiles in sweep.items() if name != "best" for tile, ms in tiles.items()]
        table = markdown_table(["constant", "tile", "ms (or error)"], rows)
        parts.append(f"Fused cast tiles (best: {sweep['best']}):\n\n{table}")
    if data.get("casts"):
        keys = ["cast", "ms", "gbps", "pct_copy", "pct_ideal", "graph_ms", "graph_pct_ideal", "graph_error"]
        parts.append(markdown_table(keys, [[r.get(k, "") for k in keys] for r in data["casts"]]))
    if data.get("training"):
        keys = ["config", "tokens_per_s", "speedup", "step_s", "mfu", "peak_mem_gb", "final_loss", "error"]
        parts.append(markdown_table(keys, [[r.get(k, "") for k in keys] for r in data["training"]]))
        profiled = [r for r in data["training"] if r.get("time_breakdown")]
        if profiled:
            groups = [*_BREAKDOWN, "other", "idle", "step"]
            table = [[r["config"], *(r["time_breakdown"][g] for g in groups)] for r in profiled]
            parts.append("GPU time per step (ms, CUDA profiler):\n\n" + markdown_table(["config", *groups], table))
    if data.get("experts"):
        keys = ["gemm", "impl", "rows", "n", "k", "ms", "tflops", "speedup", "error"]
        parts.append(markdown_table(keys, [[r.get(k, "") for k in keys] for r in data["experts"]]))
    if data.get("moe_training"):
        keys = ["config", "micro_batches", "tokens_per_s", "speedup", "step_s", "mfu", "peak_mem_gb", "final_loss"]
        keys.append("error")
        parts.append(markdown_table(keys, [[r.get(k, "") for k in keys] for r in data["moe_training"]]))
    return "\n\n".join(parts) + "\n"


def parse_dual_path(text: str) -> dict[str, str]:
    """``"128x128=two_casts,1x128=fused"`` -> ``{granularity: path}``, checked against ``fp8_casts.DUAL_PATH``."""
    from mcore.kernels.fp8_casts import DUAL_PATH

    chosen: dict[str, str] = {}
    for item in (i for i in text.split(",") if i):
        granularity, _, path = item.partition("=")
        if granularity not in DUAL_PATH or path not in ("fused", "two_casts"):
            raise ValueError(
                f"--dual-path: {item!r} must be granularity=path with granularity one of {sorted(DUAL_PATH)} and "
                "path 'fused' or 'two_casts'"
            )
        chosen[granularity] = path
    return chosen


def apply_dual_path(chosen: dict[str, str]) -> dict[str, str]:
    """Set ``fp8_casts.DUAL_PATH``'s entries in ``chosen`` for the rest of this process; returns the map in force."""
    from mcore.kernels.fp8_casts import DUAL_PATH

    DUAL_PATH.update(chosen)
    return dict(DUAL_PATH)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, reference GEMMs")
    parser.add_argument("--iters", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument(
        "--skip",
        default="",
        help="comma-separated parts to skip: gemms, linears, casts, training, experts, moe_training",
    )
    parser.add_argument(
        "--profile-steps",
        type=int,
        default=None,
        help="steps per training row under the CUDA profiler, after the timed ones (1; dry run 0: it needs a GPU)",
    )
    parser.add_argument(
        "--sweep-casts",
        action="store_true",
        help="first time every candidate tile of the fused casts (fp8_cast_sweep.py) on a bf16 [8192, 4096]",
    )
    parser.add_argument(
        "--use-swept-casts",
        action="store_true",
        help="with --sweep-casts: the rest of the run (casts, training rows, ...) uses the sweep's fastest tiles",
    )
    parser.add_argument(
        "--dual-path",
        default="",
        help="override fp8_casts.DUAL_PATH for this run, e.g. '128x128=two_casts' (granularity=fused|two_casts,...)",
    )
    parser.add_argument(
        "--moe-micro-batches",
        default="1",
        help="micro-batches per step of the mixtral2l training rows, comma-separated (e.g. 1,8: one row set each)",
    )
    parser.add_argument(
        "--moe-recipes", default="rowwise", help="fp8 recipes of the mixtral2l training rows after bf16 (comma list)"
    )
    parser.add_argument(
        "--train-configs",
        default=",".join(TRAIN_CONFIGS),
        help="fp8 training rows after bf16 (recipes; '+output': the output layer in fp8 too)",
    )
    args = parser.parse_args(argv)
    try:
        dual_path = parse_dual_path(args.dual_path)
    except ValueError as exc:
        parser.error(str(exc))
    configs = [c for c in args.train_configs.split(",") if c]
    try:
        moe_micro_batches = tuple(int(c) for c in args.moe_micro_batches.split(",") if c)
    except ValueError:
        parser.error(f"--moe-micro-batches: comma-separated positive ints, got {args.moe_micro_batches!r}")
    if not moe_micro_batches or min(moe_micro_batches) < 1:
        parser.error(f"--moe-micro-batches: comma-separated positive ints, got {args.moe_micro_batches!r}")
    moe_recipes = tuple(r for r in args.moe_recipes.split(",") if r)
    if not moe_recipes or set(moe_recipes) - set(TRAIN_RECIPES):
        parser.error(f"--moe-recipes: some of {list(TRAIN_RECIPES)}, got {args.moe_recipes!r}")
    labels = (*TRAIN_RECIPES, *RECIPE_OVERRIDES)
    valid = {*labels, *(f"{r}+output" for r in labels)}
    if set(configs) - valid:
        parser.error(f"--train-configs: unknown {sorted(set(configs) - valid)}; expected some of {sorted(valid)}")
    profile_steps = args.profile_steps if args.profile_steps is not None else (0 if args.dry_run else 1)
    if profile_steps < 0 or (args.dry_run and profile_steps):
        parser.error(f"--profile-steps must be >= 0 and 0 in a dry run (it reads CUDA kernels), got {profile_steps}")
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
        "dual_path": apply_dual_path(dual_path),
    }

    def save() -> None:
        write_json(args.out / "fp8.json", data)
        (args.out / "fp8.md").write_text(render(data))

    # casts first (seconds), then training row by row (saved after each: a call cut short keeps what ran), then the
    # linears (their CUDA-graph captures last: a failed capture cannot disturb the training rows)
    if args.use_swept_casts and not args.sweep_casts:
        parser.error("--use-swept-casts needs --sweep-casts")
    if args.sweep_casts:
        data["cast_sweep"] = bench_cast_sweep((256, 512) if args.dry_run else (8192, 4096), device, dtype, iters,
                                              warmup)  # fmt: skip
        if args.use_swept_casts:
            from fp8_cast_sweep import apply_tiles

            data["cast_tiles_used"] = apply_tiles(data["cast_sweep"]["best"])
        save()
        print("fp8.py: cast sweep done", data["cast_sweep"]["best"], flush=True)
    if "casts" not in skip:
        data["casts"] = bench_casts((256, 512) if args.dry_run else (8192, 4096), device, dtype, iters, warmup)
        save()
        print("fp8.py: casts done", flush=True)
    if "training" not in skip:
        # the profiled step replaces a timed one: the row's wall time stays ~35-45 s on the H200
        steps = dict(iters=3, warmup=0) if args.dry_run else dict(iters=max(1, 10 - profile_steps), warmup=3)
        data["training"] = []
        rows = data["training"]
        bench_training(args.dry_run, configs=configs, rows=rows, on_row=save, profile_steps=profile_steps, **steps)
    if "linears" not in skip:
        data["linears"] = bench_linears(linear_shapes(shape), device, dtype, iters, warmup)
        save()
    if "gemms" not in skip:
        data["gemms"] = bench_gemms(linear_shapes(shape), device, dtype, iters, warmup)
        save()
    if "experts" not in skip:
        data["experts"] = bench_expert_gemms(args.dry_run, device, dtype, iters, warmup)
        save()
    if "moe_training" not in skip:
        steps = dict(iters=3, warmup=0) if args.dry_run else dict(iters=10, warmup=3)
        data["moe_training"] = bench_moe_training(args.dry_run, **steps, micro_batches=moe_micro_batches,
                                                  recipes=moe_recipes)  # fmt: skip
        save()
    print(render(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
