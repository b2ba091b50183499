"""MoE micro-benchmarks (used by ``moe_throughput.py --micro``): the grouped expert GEMM against a dense GEMM of the
same FLOPs, and the router / permute / unpermute ops, on one shape's tokens (micro-batch x seq).

Inputs are random but routed for real (a random router over random hidden states), so the per-expert row counts
are uneven as in training. Each op is timed forward + backward with CUDA events (perf_counter on CPU), median of
``iters`` after 2 warm-up calls; TFLOP/s counts the three GEMMs of forward + backward (2 x M x N x K each).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any


def _timer(fn: Callable[[], None], iters: int, cuda: bool) -> float:
    import torch

    for _ in range(2):
        fn()
    times = []
    for _ in range(iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _shape_micro(shape: dict[str, Any], iters: int, dry_run: bool) -> dict[str, Any]:
    import torch

    from mcore.kernels.moe import RouterConfig, grouped_gemm, permute, plan_permutation, route, unpermute

    cuda = torch.cuda.is_available() and not dry_run
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    g = torch.Generator(device=device).manual_seed(0)
    h, f, e, k = shape["hidden"], shape["moe_ffn"], shape["experts"], shape["topk"]
    tokens = shape["mbs"] * shape["seq"]
    x = torch.randn(tokens, h, device=device, dtype=dtype, generator=g)
    router_w = torch.randn(e, h, device=device, generator=g) * h**-0.5
    cfg = RouterConfig(num_experts=e, topk=k, norm_topk_prob=True)
    align = 8 if cuda else 1
    out: dict[str, Any] = {"shape": shape["name"], "tokens": tokens, "device": device, "dtype": str(dtype)}

    def router_step():
        routing = route(x.float() @ router_w.t(), cfg)
        plan_permutation(routing.indices, e, align=align)

    out["router_and_plan_ms"] = 1e3 * _timer(router_step, iters, cuda)
    routing = route(x.float() @ router_w.t(), cfg)
    plan = plan_permutation(routing.indices, e, align=align)
    xr = x.clone().requires_grad_(True)
    rows = permute(xr, plan)
    y = rows.detach().clone().requires_grad_(True)
    weights = routing.weights.detach().clone().requires_grad_(True)
    probe = torch.ones_like(x)
    # the default backend (Triton on CUDA), then the pure-torch reference it replaced
    for suffix, backend in (("", None), ("_reference", "reference")):
        out[f"permute_fwd_bwd_ms{suffix}"] = 1e3 * _timer(
            lambda b=backend: permute(xr, plan, backend=b).backward(torch.ones_like(rows)), iters, cuda
        )
        out[f"unpermute_fwd_bwd_ms{suffix}"] = 1e3 * _timer(
            lambda b=backend: unpermute(y, weights, plan, backend=b).backward(probe), iters, cuda
        )

    n_rows = plan.num_rows
    a = rows.detach().clone().requires_grad_(True)
    w = (torch.randn(e, 2 * f, h, device=device, generator=g) * h**-0.5).to(dtype).requires_grad_(True)
    dy = torch.randn(n_rows, 2 * f, device=device, dtype=dtype, generator=g)
    flops = 3 * 2 * tokens * k * h * 2 * f  # the routed rows only (padding rows are zeros)
    grouped_s = _timer(lambda: grouped_gemm(a, w, plan.offsets).backward(dy), iters, cuda)
    dense_a = torch.randn(tokens * k, h, device=device, dtype=dtype, generator=g).requires_grad_(True)
    dense_w = (torch.randn(2 * f, h, device=device, generator=g) * h**-0.5).to(dtype).requires_grad_(True)
    dense_dy = torch.randn(tokens * k, 2 * f, device=device, dtype=dtype, generator=g)
    dense_s = _timer(lambda: (dense_a @ dense_w.t()).backward(dense_dy), iters, cuda)
    out.update(
        gemm=f"[{tokens * k} routed rows, {h}] x {e} experts [{2 * f}, {h}] (gate_up), fwd + bwd",
        grouped_gemm_ms=1e3 * grouped_s,
        grouped_gemm_tflops=flops / grouped_s / 1e12,
        dense_gemm_ms=1e3 * dense_s,
        dense_gemm_tflops=flops / dense_s / 1e12,
        grouped_over_dense=dense_s / grouped_s,
        tokens_per_expert_max=int(plan.tokens_per_expert.max()),
        tokens_per_expert_mean=tokens * k / e,
    )
    if cuda and hasattr(torch, "_grouped_mm"):
        out["grouped_gemm_layouts_tflops"] = _layouts(a.detach(), w.detach(), dy, plan.offsets, tokens * k, iters)
        out.update(_with_main_grad(a.detach(), w.detach(), dy, plan.offsets, flops, iters))
    return out


def _with_main_grad(x, w, dy, offsets, flops: float, iters: int) -> dict[str, float]:
    """The gate_up GEMMs forward + backward with the weight gradient landing in an fp32 ``main_grad`` as training
    does: grouped (bf16 weight gradient, then added) against one cuBLAS GEMM per expert from host offsets (one
    sync per layer) whose weight gradient accumulates in fp32 inside the GEMM (``addmm(out_dtype=float32)``)."""
    import torch

    main_grad = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
    ends = offsets.tolist()
    starts = [0, *ends[:-1]]

    def grouped():
        torch._grouped_mm(x, w.transpose(-2, -1), offs=offsets)
        torch._grouped_mm(dy, w, offs=offsets)
        main_grad.add_(torch._grouped_mm(dy.t(), x, offs=offsets))

    def per_expert():
        for g, (lo, hi) in enumerate(zip(starts, ends)):
            torch.mm(x[lo:hi], w[g].t())
            torch.mm(dy[lo:hi], w[g])
            torch.addmm(main_grad[g], dy[lo:hi].t(), x[lo:hi], out_dtype=torch.float32, out=main_grad[g])

    out = {}
    for name, fn in (("grouped", grouped), ("per_expert_mm", per_expert)):
        try:
            seconds = _timer(fn, iters, True)
        except (RuntimeError, TypeError) as exc:  # e.g. a torch without addmm's out_dtype
            out[f"{name}_with_main_grad_error"] = repr(exc)[:200]
            continue
        out[f"{name}_with_main_grad_ms"] = 1e3 * seconds
        out[f"{name}_with_main_grad_tflops"] = flops / seconds / 1e12
    return out


def _layouts(x, w, dy, offsets, routed_rows: int, iters: int) -> dict[str, float]:
    """TFLOP/s of each of the three expert GEMMs through ``torch._grouped_mm`` with the weight stored [E, N, K]
    (nn.Linear's, ours) or [E, K, N], and the weight gradient from ``dy^T x`` or ``(x^T dy)^T``: which operand
    layouts hit the fast kernel."""
    import torch

    n, k_dim = w.shape[1], w.shape[2]
    flops = 2 * routed_rows * n * k_dim
    w_kn = w.transpose(-2, -1).contiguous()  # [E, K, N]
    dy_t = dy.t().contiguous()
    cases = {
        "fwd_w_enk": lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offsets),
        "fwd_w_ekn": lambda: torch._grouped_mm(x, w_kn, offs=offsets),
        "dgrad_w_enk": lambda: torch._grouped_mm(dy, w, offs=offsets),
        "dgrad_w_ekn": lambda: torch._grouped_mm(dy, w_kn.transpose(-2, -1), offs=offsets),
        "wgrad_dyT_x": lambda: torch._grouped_mm(dy.t(), x, offs=offsets),
        "wgrad_dyT_contiguous_x": lambda: torch._grouped_mm(dy_t, x, offs=offsets),
        "wgrad_xT_dy": lambda: torch._grouped_mm(x.t(), dy, offs=offsets),
    }
    return {name: flops / _timer(fn, iters, True) / 1e12 for name, fn in cases.items()}


def run_micro(shapes: list[dict[str, Any]], *, iters: int, dry_run: bool) -> list[dict[str, Any]]:
    """One record per shape (see the module docstring)."""
    records = []
    for shape in shapes:
        record = _shape_micro(shape, iters, dry_run)
        print(
            f"micro {record['shape']}: grouped GEMM {record['grouped_gemm_tflops']:.1f} TFLOP/s vs dense "
            f"{record['dense_gemm_tflops']:.1f}; router+plan {record['router_and_plan_ms']:.2f} ms, permute "
            f"{record['permute_fwd_bwd_ms']:.2f} ms, unpermute {record['unpermute_fwd_bwd_ms']:.2f} ms",
            flush=True,
        )
        records.append(record)
    return records
