# ruff: noqa  (a device call's one-off measurement script, kept as run beside its results)
"""Host time of one fp8 linear forward+backward per recipe at a tiny shape (GPU work negligible), and the CPU ops
behind it (torch.profiler, self CPU time)."""

import time

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from mcore.kernels.low_precision_linear import LowPrecisionLinear, Recipe

dev = "cuda"
x = torch.randn(256, 256, device=dev, dtype=torch.bfloat16, requires_grad=True)
w = torch.randn(256, 256, device=dev, dtype=torch.bfloat16, requires_grad=True)
g = torch.randn(256, 256, device=dev, dtype=torch.bfloat16)
impls = {"bf16": lambda: F.linear(x, w)}
for r in ("tensorwise", "delayed", "rowwise", "blockwise"):
    impls[r] = (lambda layer: lambda: layer(x, w))(LowPrecisionLinear(Recipe(r)))
for name, fn in impls.items():
    for _ in range(5):
        fn().backward(g)
    torch.cuda.synchronize()
    n = 200
    t0 = time.perf_counter()
    for _ in range(n):
        fn().backward(g)
    host = (time.perf_counter() - t0) / n
    torch.cuda.synchronize()
    print(f"{name}: {1e6 * host:.1f} us per forward+backward (host)", flush=True)
for name in ("tensorwise", "delayed", "rowwise"):
    fn = impls[name]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(20):
            fn().backward(g)
    torch.cuda.synchronize()
    print(f"== {name}: CPU ops, self time per call (us), count per call")
    rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:22]
    for e in rows:
        print(f"  {e.self_cpu_time_total / 20:8.1f} {e.count / 20:5.1f}  {e.key[:90]}")
