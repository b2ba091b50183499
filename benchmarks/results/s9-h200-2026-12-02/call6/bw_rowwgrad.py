# ruff: noqa  (one-off checks, kept as run beside the session's results)
"""GPU, 110M model, 500 steps, seed 1: block-wise forward and dgrad, but the wgrad operands (x^T, g^T) row-wise
(per channel over all tokens) instead of 1x128 along the tokens. Is the token-tiled wgrad the block-wise gap?"""

import json, os, sys, tempfile
from pathlib import Path

sys.path.insert(0, "benchmarks")
import mcore.kernels.low_precision_linear as lpl
from mcore.kernels.fp8_casts import quantize_dual
from mcore.kernels.quantization import E4M3, fp8_dtype

orig = lpl.LowPrecisionLinear.quantize_operands


def quantize_operands(self, t, tensor, dims, *, transposed=True):
    if tensor == "w":
        return orig(self, t, tensor, dims, transposed=transposed)
    dtype = fp8_dtype(self.recipe.grad_format) if tensor == "g" else E4M3
    q = quantize_dual(t, dtype, "1x128", transposed=False)[0]
    q_t = quantize_dual(t, dtype, "row", transposed=True)[1] if transposed else None
    return q, q_t


lpl.LowPrecisionLinear.quantize_operands = quantize_operands

import low_precision_convergence as lpc
from _common import run_spec
from real_text import build_corpus

data_path, info = build_corpus(Path(tempfile.mkdtemp()), 32 * 2**20)
spec = lpc.build_spec("fp8-blockwise", 500, "cuda", "medium", data_path, seed=1)
res, rt = run_spec(spec)
losses = res["losses"]
print(json.dumps({"final": sum(losses[-20:]) / 20, "vs_baseline_seed1": sum(losses[-20:]) / 20 / 1.5601 - 1}))
json.dump({"losses": losses}, open(sys.argv[1], "w"))
