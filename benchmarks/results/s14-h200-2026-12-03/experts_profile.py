# ruff: noqa  (a device call's one-off measurement script, kept as run beside its results)
"""(session 8's script, leaf gradients reset per step) Where the fp8 grouped GEMM's time goes (mixtral2l expert shapes): kernel table of one fwd+bwd, bf16 vs fp8."""

import json
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from mcore.kernels.fp8_grouped_gemm import fp8_grouped_gemm
from mcore.kernels.grouped_gemm import grouped_gemm

dev = "cuda"
experts, hidden, ffn, rows = 8, 4096, 14336, 16384
offsets = torch.arange(1, experts + 1, device=dev, dtype=torch.int32) * (rows // experts)
out = {}
for name, (n, k) in {"gate_up": (2 * ffn, hidden), "down": (hidden, ffn)}.items():
    x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(experts, n, k, device=dev, dtype=torch.bfloat16) * 0.02).requires_grad_()
    g = torch.randn(rows, n, device=dev, dtype=torch.bfloat16)
    for impl, fn in (("bf16", grouped_gemm), ("fp8", fp8_grouped_gemm)):

        def step():
            x.grad = w.grad = None  # no gradient accumulation add in the table (session 8's script had one)
            fn(x, w, offsets).backward(g)

        for _ in range(3):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                step()
            torch.cuda.synchronize()
        rows_ = []
        for e in prof.key_averages():
            t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
            if t > 0:
                rows_.append((t / 3 / 1e3, e.count // 3, e.key[:120]))
        rows_.sort(reverse=True)
        print(f"== {name} {impl}: total {sum(r[0] for r in rows_):.2f} ms")
        for r in rows_[:20]:
            print("  %8.3f ms %3d  %s" % r)
        out[f"{name}-{impl}"] = rows_
# raw GEMM rates of _scaled_grouped_mm on pre-quantized operands (forward shape only)
for name, (n, k) in {"gate_up": (2 * ffn, hidden), "down": (hidden, ffn)}.items():
    a = torch.randn(rows, k, device=dev).to(torch.float8_e4m3fn)
    b = torch.randn(experts, n, k, device=dev).to(torch.float8_e4m3fn)
    sa = torch.ones(rows, device=dev)
    sb = torch.ones(experts, n, device=dev)
    f = lambda: torch._scaled_grouped_mm(a, b.transpose(-2, -1), sa, sb, offs=offsets, out_dtype=torch.bfloat16)
    for _ in range(3):
        f()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(10):
        f()
    e.record()
    e.synchronize()
    ms = s.elapsed_time(e) / 10
    abf = a.to(torch.bfloat16)
    bbf = b.to(torch.bfloat16)
    fb = lambda: torch._grouped_mm(abf, bbf.transpose(-2, -1), offs=offsets)
    for _ in range(3):
        fb()
    s.record()
    for _ in range(10):
        fb()
    e.record()
    e.synchronize()
    msb = s.elapsed_time(e) / 10
    fl = 2 * rows * n * k
    print(f"raw fwd {name}: fp8 {ms:.3f} ms {fl / ms / 1e9:.0f} TFLOP/s; bf16 {msb:.3f} ms {fl / msb / 1e9:.0f}")
json.dump(out, open(sys.argv[1], "w"), indent=1)
