# ruff: noqa  (one-off checks, kept as run beside the session's results)
"""Block-wise fp8 on the GPU against the same fp8 operands multiplied in float64 (the reference backend), at the
110M convergence model's shapes; row-wise beside it. Then one LowPrecisionLinear fwd+bwd per recipe on CUDA vs the
reference backend (same quantized values): y, dx, dw errors against the unquantized float64 op."""

import json, sys, torch
from mcore.kernels.quantization import E4M3, quantize_fp8, Quantized
from mcore.kernels.fp8_casts import quantize_dual
from mcore.kernels.fp8_gemm import scaled_matmul
from mcore.kernels.low_precision_linear import LowPrecisionLinear, Recipe

torch.manual_seed(0)
dev = "cuda" if torch.cuda.is_available() else "cpu"
out = {}


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def operand(rows, cols, outliers=True):
    t = torch.randn(rows, cols, device=dev) * 0.02
    if outliers:  # a few large channels and rows, as activations and gradients have
        t[:, torch.randint(0, cols, (4,))] *= 30
        t[torch.randint(0, rows, (8,)), :] *= 10
    return t.bfloat16()


def ref_mm(a: Quantized, b: Quantized):
    return (
        scaled_matmul(a, b, out_dtype=torch.float32, backend="reference")
        if False
        else (a.dequantize(torch.float64) @ b.dequantize(torch.float64).t())
    )


T = 16384 if dev == "cuda" else 256
cases = {  # name: (M, K, N, granularity of a, of b)
    "fwd 1x128x128x128 (x@W, K=1024)": (T, 1024, 2816, "1x128", "128x128"),
    "fwd 1x128x128x128 (down, K=2816)": (T, 2816, 1024, "1x128", "128x128"),
    "dgrad 1x128x128x128 (g@W^T, K=2816)": (T, 2816, 1024, "1x128", "128x128"),
    "wgrad 1x128x1x128 (K=tokens 16384)": (2816, T, 1024, "1x128", "1x128"),
    "wgrad 1x128x1x128 (K=tokens, N=2816)": (1024, T, 2816, "1x128", "1x128"),
    "fwd row (K=1024)": (T, 1024, 2816, "row", "row"),
    "wgrad row (K=tokens 16384)": (2816, T, 1024, "row", "row"),
}
for name, (m, k, n, ga, gb) in cases.items():
    a_hp, b_hp = operand(m, k), operand(n, k)
    qa = quantize_dual(a_hp, E4M3, ga, transposed=False)[0]
    qb = quantize_dual(b_hp, E4M3, gb, transposed=False)[0]
    exact_q = ref_mm(qa, qb)
    res = {}
    for od in (torch.bfloat16, torch.float32):
        y = scaled_matmul(qa, qb, out_dtype=od)
        res[str(od)] = rel(y, exact_q)
    res["quant_vs_hp"] = rel(exact_q, a_hp.double() @ b_hp.double().t())
    out[name] = res
    print(name, res, flush=True)

# the whole linear, bf16 on CUDA: default backend vs reference backend, same inputs
for recipe in ("rowwise", "blockwise", "tensorwise"):
    x = operand(T, 1024).requires_grad_(True)
    w = (torch.randn(2816, 1024, device=dev) * 0.02).bfloat16().requires_grad_(True)
    g = operand(T, 2816)
    res = {}
    ys = {}
    for backend in (None, "reference"):
        xx, ww = x.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
        lin = LowPrecisionLinear(Recipe(recipe), backend=backend)
        y = lin(xx, ww)
        y.backward(g)
        ys[backend] = (y.detach(), xx.grad, ww.grad)
    exact_y = x.detach().double() @ w.detach().double().t()
    exact_dx = g.double() @ w.detach().double()
    exact_dw = g.double().t() @ x.detach().double()
    for i, (nm, ex) in enumerate((("y", exact_y), ("dx", exact_dx), ("dw", exact_dw))):
        res[nm + " cuda"] = rel(ys[None][i], ex)
        res[nm + " ref"] = rel(ys["reference"][i], ex)
        res[nm + " cuda-vs-ref"] = rel(ys[None][i], ys["reference"][i])
    out["linear " + recipe] = res
    print("linear", recipe, {k: round(v, 5) for k, v in res.items()}, flush=True)
json.dump(out, open(sys.argv[1], "w"), indent=1)
