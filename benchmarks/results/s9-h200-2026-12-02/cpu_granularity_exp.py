# ruff: noqa  (one-off checks, kept as run beside the session's results)
"""Blockwise loss-gap experiment: per-tensor granularity override, CPU emulation. EXP='x,w,g' granularities."""

import os, sys, json

sys.path.insert(0, "/work/main/benchmarks")
import mcore.kernels.low_precision_linear as lpl
import mcore.kernels.fp8_gemm as fg
from mcore.kernels.fp8_casts import quantize_dual
from mcore.kernels.quantization import E4M3, fp8_dtype

gx, gw, gg = (os.environ["EXP"] + ",x,x").split(",")[:3]
fg.PAIRS = {(a, b) for a in ("tensor", "row", "1x128", "128x128") for b in ("tensor", "row", "1x128", "128x128")}
GRAN = {"x": gx, "w": gw, "g": gg}


def quantize_operands(self, t, tensor, dims, *, transposed=True):
    gran = GRAN[tensor]
    dtype = fp8_dtype(self.recipe.grad_format) if tensor == "g" else E4M3
    return quantize_dual(t, dtype, gran, transposed=transposed, backend="reference")


lpl.LowPrecisionLinear.quantize_operands = quantize_operands

import low_precision_convergence as lpc
from _common import run_spec

steps = int(os.environ.get("STEPS", "500"))
name = "baseline" if os.environ["EXP"] == "none" else "fp8-blockwise"
spec = lpc.build_spec(name, steps, "cpu", "demo", "/tmp/bw/text/stdlib")
if os.environ.get("SEED"):
    spec.overrides.append(f"train.seed={os.environ['SEED']}")
res, rt = run_spec(spec)
losses = res.get("losses") or res["loss_curve"]
print(
    json.dumps(
        {
            "exp": os.environ["EXP"],
            "seed": os.environ.get("SEED"),
            "final": sum(losses[-20:]) / 20,
            "last100": sum(losses[-100:]) / 100,
        }
    )
)
