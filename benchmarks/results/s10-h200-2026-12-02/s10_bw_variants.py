# ruff: noqa  (one-off experiment, kept beside the session's results)
"""GPU, 110M model, 500 steps, seed 1: which of block-wise's choices makes it train worse than bf16 (+5.67% at
seed 1, session 9)? Each variant changes one tensor's scale granularity (or the scale values) and keeps the rest
of block-wise:

  w-row   weights one scale per row (W along K, W^T along N), given to the GEMM as 1x128 scales repeated
  x-row   activations of the forward one scale per token (repeated as 1x128); x^T stays 1x128 along tokens
  g-row   gradients of dgrad one scale per token (repeated as 1x128); g^T stays 1x128 along tokens
  pow2    every block scale a power of two (Transformer Engine's Float8BlockScaling default, DeepSeek's UE8M0)
  rowwise the row-wise recipe itself at this seed (its gap is known at seed 1234 only)
  blockwise the recipe unchanged (repeat of session 9's call 4)

python s10_bw_variants.py OUT variant[,variant...]
"""

import json, os, sys, tempfile, time
from pathlib import Path

sys.path.insert(0, "benchmarks")
import torch
import mcore.kernels.low_precision_linear as lpl
import mcore.kernels.quantization as qz
from mcore.kernels.fp8_casts import quantize_dual
from mcore.kernels.quantization import E4M3, Quantized, fp8_dtype

orig = lpl.LowPrecisionLinear.quantize_operands
orig_scale = qz.scale_from_amax


def as_1x128(q):
    if q is None:
        return None
    cols = q.data.shape[1]
    return Quantized(q.data, q.scale.reshape(-1, 1).expand(-1, -(-cols // 128)).contiguous(), "1x128")


def make_patch(variant):
    def quantize_operands(self, t, tensor, dims, *, transposed=True):
        dtype = fp8_dtype(self.recipe.grad_format) if tensor == "g" else E4M3
        if variant == "w-row" and tensor == "w":
            q, q_t = quantize_dual(t, dtype, "row", transposed=transposed)
            return as_1x128(q), as_1x128(q_t)
        if (variant == "x-row" and tensor == "x") or (variant == "g-row" and tensor == "g"):
            q = quantize_dual(t, dtype, "row", transposed=False)[0]
            q_t = quantize_dual(t, dtype, "1x128", transposed=True)[1] if transposed else None
            return as_1x128(q), q_t
        if variant == "pow2":
            gran = "128x128" if tensor == "w" else "1x128"
            return quantize_dual(t, dtype, gran, transposed=transposed, backend="reference")
        if variant == "refcasts":
            gran = "128x128" if tensor == "w" else "1x128"
            return quantize_dual(t, dtype, gran, transposed=transposed, backend="reference")
        return orig(self, t, tensor, dims, transposed=transposed)

    return quantize_operands


STATS = []


def compare_patch():
    """Triton casts vs the torch reference's bits, cuBLAS GEMMs vs the float64 product of the same fp8 operands, on
    the training run's own tensors (the first steps)."""

    def quantize_operands(self, t, tensor, dims, *, transposed=True):
        q, q_t = orig(self, t, tensor, dims, transposed=transposed)
        if len(STATS) < 4000:
            dtype = fp8_dtype(self.recipe.grad_format) if tensor == "g" else E4M3
            gran = "128x128" if tensor == "w" else "1x128"
            r, r_t = quantize_dual(t, dtype, gran, transposed=transposed, backend="reference")
            for name, a, b in (("q", q, r), ("q_t", q_t, r_t)):
                if a is None:
                    continue
                bad = (a.data.view(torch.uint8) != b.data.view(torch.uint8)).sum().item()
                sbad = (a.scale != b.scale).sum().item()
                STATS.append(
                    {
                        "kind": "cast",
                        "layer": self.name,
                        "tensor": tensor + "." + name,
                        "shape": list(t.shape),
                        "data_mismatch": bad,
                        "scale_mismatch": sbad,
                        "amax": t.abs().max().item(),
                    }
                )
        return q, q_t

    def matmul(self, a, b, out_dtype, fast_accum=False, out=None):
        y = orig_matmul(self, a, b, out_dtype, fast_accum=fast_accum, out=out)
        if len(STATS) < 4000:
            exact = a.dequantize(torch.float64) @ b.dequantize(torch.float64).t()
            err = ((y.double() - exact).norm() / exact.norm().clamp_min(1e-300)).item()
            STATS.append(
                {
                    "kind": "gemm",
                    "layer": self.name,
                    "pair": [a.granularity, b.granularity],
                    "shape": [a.shape[0], b.shape[0], a.shape[1]],
                    "out": str(y.dtype),
                    "rel_err": err,
                }
            )
        return y

    return quantize_operands, matmul


orig_matmul = lpl.LowPrecisionLinear.matmul


def pow2_scale(amax, fmax):
    mult, _ = orig_scale(amax, fmax)
    mult = torch.exp2(torch.floor(torch.log2(mult)))
    return mult, torch.ones_like(mult).div(mult)


import low_precision_convergence as lpc
from _common import run_spec
from real_text import build_corpus

out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
data_path, info = build_corpus(Path(tempfile.mkdtemp()), float(os.environ.get("MB", 32)) * 2**20)
for variant in sys.argv[2].split(","):
    lpl.LowPrecisionLinear.quantize_operands = orig
    lpl.LowPrecisionLinear.matmul = orig_matmul
    qz.scale_from_amax = orig_scale
    steps = int(os.environ.get("STEPS", 500))
    plain = {
        "rowwise": "fp8-rowwise",
        "tensorwise": "fp8-tensorwise",
        "delayed": "fp8-delayed",
        "baseline": "baseline",
        "baseline-perturbed": "baseline",
    }
    config = plain.get(variant, "fp8-blockwise")
    # a perturbation of the bf16 baseline: cuBLAS may not reduce in bf16 (different kernels / reduction order)
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = variant != "baseline-perturbed"
    if variant == "compare":
        lpl.LowPrecisionLinear.quantize_operands, lpl.LowPrecisionLinear.matmul = compare_patch()
        steps = 6
    elif variant == "refgemm":
        lpl.LowPrecisionLinear.matmul = lambda self, a, b, out_dtype, fast_accum=False, out=None: lpl.scaled_matmul(
            a, b, out_dtype=out_dtype, backend="reference", out=out
        )
    elif variant.startswith("blockwise"):
        pass
    elif variant not in plain:
        lpl.LowPrecisionLinear.quantize_operands = make_patch(variant)
    if variant == "pow2":
        qz.scale_from_amax = pow2_scale
    t0 = time.time()
    spec = lpc.build_spec(
        config, steps, os.environ.get("DEV", "cuda"), os.environ.get("MODEL", "medium"), data_path, seed=1
    )
    res, rt = run_spec(spec)
    losses = res["losses"]
    final = sum(losses[-20:]) / 20
    row = {
        "variant": variant,
        "final": final,
        "vs_bf16_seed1_500_steps_1.5601": final / 1.5601 - 1,
        "steps": steps,
        "wall_s": time.time() - t0,
    }
    print(json.dumps(row), flush=True)
    if variant == "compare":
        (out / "compare.json").write_text(json.dumps(STATS))
        casts = [r for r in STATS if r["kind"] == "cast"]
        gemms = [r for r in STATS if r["kind"] == "gemm"]
        print(
            json.dumps(
                {
                    "casts": len(casts),
                    "casts_with_data_mismatch": sum(r["data_mismatch"] > 0 for r in casts),
                    "casts_with_scale_mismatch": sum(r["scale_mismatch"] > 0 for r in casts),
                    "gemms": len(gemms),
                    "gemm_max_rel_err_fp32": max([r["rel_err"] for r in gemms if "float32" in r["out"]], default=None),
                    "gemm_max_rel_err_bf16": max([r["rel_err"] for r in gemms if "bfloat16" in r["out"]], default=None),
                }
            ),
            flush=True,
        )
        STATS.clear()
        continue
    (out / f"{variant}.json").write_text(json.dumps({**row, "result": res}, default=str))
