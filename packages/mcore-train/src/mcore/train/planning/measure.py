"""``mcore-train plan --calibrate``: measure the rates of the GPU at hand into a calibration file.

Measured (CUDA events, median of the timed repetitions after warm-up): bf16 (and, on sm90+, fp8 tensor-wise
``torch._scaled_mm``) GEMMs over a sweep of sizes; the experts' grouped GEMMs (``mcore.parallel.GroupedExperts``,
forward) against the dense MLP of the same total size by rows per expert; the weight-gradient GEMM writing fp32
(``addmm(out_dtype=float32)``, gradient-accumulation fusion) against the bf16 one; SDPA causal attention forward +
backward at document lengths 512 to 16384 (16k tokens each); device copy bandwidth; and with several GPUs the NCCL bus
bandwidth of all_reduce, all_gather, reduce_scatter, all_to_all and send/recv from 1 MB to 1 GB. What is not
measured (host overhead, PCIe, host AdamW, memory-bound efficiency) is taken from the shipped calibration of the
same GPU model (else H200), and the file's ``assumptions`` say so. ``dry_run`` runs every step at tiny sizes on
the CPU (gloo for the collectives), to test the code path.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mcore.train.planning.calibration import Calibration, load_calibration

GEMM_SIZES = [(1024, 1024, 1024), (2048, 2048, 2048), (4096, 1024, 4096), (4096, 4096, 4096), (8192, 4096, 4096),
              (8192, 8192, 8192), (8192, 14336, 4096), (16384, 16384, 8192)]  # fmt: skip
DOC_LENGTHS = [512, 1024, 2048, 4096, 8192, 16384]
COLLECTIVE_BYTES = [2**20, 2**24, 2**26, 2**28, 2**30]
# rows per expert of the grouped-GEMM sweep: 16,384 routed rows through SwiGLU experts of 4096 -> 2048 (MoE layers route
# 128 to 4,096 rows to each expert at the usual batch, expert and top-k counts)
GROUPED_ROWS = [128, 256, 512, 1024, 2048, 4096]
GROUPED_TOTAL_ROWS, GROUPED_DIM = 16384, 4096


def _timer(device: torch.device) -> Callable[[Callable[[], object], int], float]:
    """Median seconds of ``fn`` over ``reps`` runs after two warm-up runs."""

    def run(fn: Callable[[], object], reps: int) -> float:
        for _ in range(2):
            fn()
        times = []
        for _ in range(reps):
            if device.type == "cuda":
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

    return run


def measure_gemms(device: torch.device, sizes, reps: int) -> dict[str, list[list[float]]]:
    """Achieved TFLOP/s by GEMM FLOPs, bf16 (fp32 on CPU) and fp8 where the GPU has it."""
    timer = _timer(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    curves: dict[str, list[list[float]]] = {"bf16": []}
    fp8 = device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)
    if fp8:
        curves["fp8"] = []
    if device.type == "cuda":
        curves["fp32"] = []
    for m, n, k in sizes:
        a = torch.randn(m, k, device=device, dtype=dtype)
        b = torch.randn(k, n, device=device, dtype=dtype)
        flops = 2.0 * m * n * k
        curves["bf16"].append([flops, flops / timer(partial(torch.matmul, a, b), reps) / 1e12])
        if device.type == "cuda":  # fp32 training's GEMMs (TF32 as torch's setting has it)
            a32, b32 = a.float(), b.float()
            curves["fp32"].append([flops, flops / timer(partial(torch.matmul, a32, b32), reps) / 1e12])
        if fp8:
            a8, b8 = a.to(torch.float8_e4m3fn), b.t().contiguous().to(torch.float8_e4m3fn).t()
            one = torch.ones((), device=device)
            fn = partial(torch._scaled_mm, a8, b8, one, one, out_dtype=torch.bfloat16)
            curves["fp8"].append([flops, flops / timer(fn, reps) / 1e12])
    for curve in curves.values():
        curve.sort()
    return curves


def measure_grouped_gemms(device: torch.device, rows_per_expert, total: int, dim: int, reps: int) -> list[list[float]]:
    """[rows per expert, grouped rate / dense rate]: ``total`` rows split evenly over ``total // rows`` SwiGLU
    experts (``mcore.parallel.GroupedExperts``: two grouped GEMMs, hidden ``dim``, width ``dim / 2``) against the
    dense MLP of the same FLOPs on all rows, forward."""
    from mcore.parallel import GroupedExperts

    timer = _timer(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    ffn = dim // 2
    x = torch.randn(total, dim, device=device, dtype=dtype)
    w1 = torch.randn(2 * ffn, dim, device=device, dtype=dtype)
    w2 = torch.randn(dim, ffn, device=device, dtype=dtype)

    def dense() -> torch.Tensor:
        h = x @ w1.t()
        return (F.silu(h[:, :ffn]) * h[:, ffn:]) @ w2.t()

    dense_s = timer(dense, reps)
    out = []
    for rows in rows_per_expert:
        experts = GroupedExperts(total // rows, dim, ffn, params_dtype=dtype, device=device).requires_grad_(False)
        for weight in (experts.gate_up, experts.down):
            weight.normal_()  # random values on the device (the module's own init draws per expert on the host)
        offsets = torch.arange(1, total // rows + 1, device=device, dtype=torch.int32) * rows
        grouped_s = timer(partial(experts, x, offsets), reps)
        out.append([float(rows), min(1.0, dense_s / grouped_s)])
    return out


def measure_wgrad_slowdown(device: torch.device, reps: int, size: int) -> float:
    """Time of ``addmm`` into an fp32 buffer over the plain bf16 GEMM of the same shape (1.0 on CPU)."""
    if device.type != "cuda":
        return 1.0
    timer = _timer(device)
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    acc = torch.zeros(size, size, device=device, dtype=torch.float32)
    plain = timer(lambda: a @ b, reps)
    fused = timer(lambda: torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc), reps)
    return max(1.0, fused / plain)


def measure_attention(device: torch.device, lengths, tokens: int, heads: int, reps: int) -> list[list[float]]:
    """SDPA causal forward + backward: TFLOP/s of causal FLOPs (``3.5 x 2 B S^2 H D``) by document length."""
    timer = _timer(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    out = []
    for s in lengths:
        b = max(1, tokens // s)
        q, k, v = (torch.randn(b, heads, s, 128, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
        grad = torch.randn(b, heads, s, 128, device=device, dtype=dtype)

        def step(q=q, k=k, v=v, grad=grad):  # gradients returned, not accumulated into .grad
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            torch.autograd.grad(out, (q, k, v), grad)

        flops = 3.5 * 2.0 * b * s * s * heads * 128
        out.append([float(s), flops / timer(step, reps) / 1e12])
    return out


def measure_copy(device: torch.device, nbytes: int, reps: int) -> float:
    """Device copy GB/s (bytes read + written)."""
    x = torch.empty(nbytes // 2, device=device, dtype=torch.bfloat16).normal_()
    y = torch.empty_like(x)
    return 2 * nbytes / _timer(device)(lambda: y.copy_(x), reps) / 1e9


def _exchange(full: torch.Tensor, peer: int) -> None:
    ops = [dist.P2POp(dist.isend, full, peer), dist.P2POp(dist.irecv, torch.empty_like(full), peer)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()


def _collective_ops(full: torch.Tensor, part: torch.Tensor, peer: int, world: int) -> dict:
    """name -> (call, bus-bandwidth factor of NCCL's tests) on a ``full`` buffer and its 1/world ``part``."""
    ring = (world - 1) / world
    return {
        "all_reduce": (partial(dist.all_reduce, full), 2 * ring),
        "all_gather": (partial(dist.all_gather_into_tensor, full, part), ring),
        "reduce_scatter": (partial(dist.reduce_scatter_tensor, part, full), ring),
        "all_to_all": (partial(dist.all_to_all_single, torch.empty_like(full), full), ring),
        "p2p": (partial(_exchange, full, peer), 1.0),
    }


def _collective_worker(rank: int, world: int, init_file: str, sizes, reps: int, backend: str, queue) -> None:
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
    timer = _timer(device)
    curves: dict[str, list[list[float]]] = {}
    try:
        for nbytes in sizes:
            n = nbytes // 2 // world * world
            full = torch.randn(n, device=device, dtype=torch.bfloat16 if backend == "nccl" else torch.float32)
            part = torch.empty(n // world, device=device, dtype=full.dtype)
            ops = _collective_ops(full, part, (rank + 1) % world if rank % 2 == 0 else rank - 1, world)
            size = float(full.numel() * full.element_size())
            for name, (fn, factor) in ops.items():
                dist.barrier()
                seconds = timer(fn, reps)
                curves.setdefault(name, []).append([size, size * factor / seconds / 1e9])
        if rank == 0:
            queue.put(curves)
    finally:
        dist.destroy_process_group()


def measure_collectives(world: int, sizes, reps: int, backend: str) -> dict[str, list[list[float]]]:
    """Bus bandwidth curves of ``world`` local processes (one GPU each with NCCL)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init = os.path.join(tmp, "init")
        procs = [ctx.Process(target=_collective_worker, args=(r, world, init, sizes, reps, backend, queue))
                 for r in range(world)]  # fmt: skip
        for p in procs:
            p.start()
        curves = queue.get(timeout=600)
        for p in procs:
            p.join(timeout=60)
        if any(p.exitcode for p in procs):
            raise RuntimeError(f"a collective measurement process failed: exit codes {[p.exitcode for p in procs]}")
    return curves


def calibrate(base: str | None = None, dry_run: bool = False, reps: int = 10) -> Calibration:
    """Measure this machine (see the module docstring) into a :class:`Calibration`."""
    cuda = torch.cuda.is_available() and not dry_run
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    if base is None:
        base = "h100-sxm" if "H100" in name else "h200-sxm"
    ref = load_calibration(base)
    small = not cuda
    sizes = [(64, 64, 64), (128, 128, 128), (256, 128, 256)] if small else GEMM_SIZES
    gemm = measure_gemms(device, sizes, 3 if small else reps)
    attention = measure_attention(device, [32, 64] if small else DOC_LENGTHS, 128 if small else 16384,
                                  2 if small else 32, 2 if small else reps)  # fmt: skip
    copy = measure_copy(device, 2**23 if small else 2**30, 3 if small else reps)
    slowdown = measure_wgrad_slowdown(device, reps, 8192)
    grouped = measure_grouped_gemms(device, [4, 8] if small else GROUPED_ROWS, 16 if small else GROUPED_TOTAL_ROWS,
                                    32 if small else GROUPED_DIM, 3 if small else reps)  # fmt: skip
    gpus = torch.cuda.device_count() if cuda else 2
    nvlink = dict(ref.nvlink)
    measured = ["gemm", "attention", "grouped_gemm", "copy_gbps", "wgrad_fp32_slowdown", "memory_gb"]
    if gpus > 1:
        sizes_c = [2**12, 2**16] if small else COLLECTIVE_BYTES
        nvlink = measure_collectives(min(gpus, 8), sizes_c, 3 if small else reps, "gloo" if small else "nccl")
        measured.append(f"nvlink ({min(gpus, 8)} processes)")
    memory = torch.cuda.get_device_properties(device).total_memory / 1e9 if cuda else ref.memory_gb
    return replace(
        ref,
        name=f"{name} (measured)" if cuda else "cpu dry run",
        memory_gb=memory,
        gemm=gemm,
        attention=attention,
        grouped_gemm=grouped,
        copy_gbps=copy,
        wgrad_fp32_slowdown=slowdown if cuda else ref.wgrad_fp32_slowdown,
        nvlink=nvlink,
        source=f"mcore-train plan --calibrate on {name}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}",
        assumptions=[f"measured: {', '.join(measured)}; everything else from the shipped {base} calibration"],
    )
