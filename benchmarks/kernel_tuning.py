"""Kernel-level bandwidth sweep of the norm, rotary and GLU Triton kernels (launches the kernels directly,
without autograd), used to pick block sizes. Run on a CUDA machine: `python benchmarks/kernel_tuning.py [--sweep]`.

Every lambda below is timed within the loop iteration that defines it, so late binding is harmless.
"""
# ruff: noqa: B023

import json
import os
import sys

import torch
import triton
from triton.testing import do_bench

import mcore.kernels.triton._common as common
import mcore.kernels.triton.activations as ta
import mcore.kernels.triton.norms as tn
import mcore.kernels.triton.rotary as tr

OUT = os.environ.get("OUT", "/tmp")
dev = torch.device("cuda")
torch.manual_seed(0)
print(torch.__version__, triton.__version__, torch.cuda.get_device_name(), flush=True)
rows = []


def bench(fn):
    return do_bench(fn, warmup=50, rep=200, return_mode="median") * 1e-3


def record(name, seconds, nbytes, copy_bw):
    bw = nbytes / seconds
    rows.append((name, seconds * 1e6, bw / 1e12, bw / copy_bw))
    print(f"{name:60s} {seconds * 1e6:9.1f} us {bw / 1e12:6.2f} TB/s {100 * bw / copy_bw:5.1f}%", flush=True)


# copy ceiling
a = torch.randn(256 * 1024 * 1024, device=dev, dtype=torch.bfloat16)  # 512 MB
b = torch.empty_like(a)
t = bench(lambda: b.copy_(a))
copy_bw = 2 * a.numel() * 2 / t
print(f"copy: {copy_bw / 1e12:.2f} TB/s", flush=True)

bf16 = torch.bfloat16
sweep = "--sweep" in sys.argv

# ---------------- norms
DEFAULT_PPSM, DEFAULT_TILE, DEFAULT_ROPE_TILE = tn.BWD_PROGRAMS_PER_SM, common.TILE_ELEMENTS, tr.ROTARY_TILE_ELEMENTS
heur_nw = common.num_warps_for


def set_nw(mod, nw):
    mod.num_warps_for = heur_nw if nw is None else (lambda _e, nw=nw: nw)


for M, N, has_bias, is_rms in [
    (16384, 4096, False, True),
    (16384, 8192, False, True),
    (16384 * 32, 128, False, True),
    (16384, 4096, True, False),
    (8192, 5120, False, True),
    (16384, 1024, False, True),
]:
    x = torch.randn(M, N, device=dev, dtype=bf16)
    w = torch.rand(N, device=dev, dtype=bf16)
    bb = torch.randn(N, device=dev, dtype=bf16) if has_bias else None
    dy = torch.randn_like(x)
    tag = f"{'rms' if is_rms else 'ln'} {M}x{N}"
    y, mean, rstd = tn.norm_forward(x, w, bb, 1e-5, is_rms, False)
    nb = x.numel() * 2 * 2
    for nw in [None, 4, 8, 16] if sweep else [None]:
        set_nw(tn, nw)
        record(f"{tag} fwd nw={nw}", bench(lambda: tn.norm_forward(x, w, bb, 1e-5, is_rms, False)), nb, copy_bw)
    nbb = x.numel() * 2 * 3
    configs = [(tn.BWD_PROGRAMS_PER_SM, None, None)]
    if sweep:
        tiles = (2048, 4096, 8192) if N <= 1024 else (4096,)
        configs = [(p, nw, t) for p in (1, 2, 4) for nw in (None, 4, 8, 16) for t in tiles]
    for p, nw, tile in configs:
        tn.BWD_PROGRAMS_PER_SM = p
        set_nw(tn, nw)
        if tile:
            common.TILE_ELEMENTS = tile
        record(
            f"{tag} bwd ppsm={p} nw={nw} tile={tile}",
            bench(lambda: tn.norm_backward(dy, x, w, mean, rstd, is_rms, False, has_bias)),
            nbb,
            copy_bw,
        )
    tn.BWD_PROGRAMS_PER_SM = DEFAULT_PPSM
    common.TILE_ELEMENTS = DEFAULT_TILE
    set_nw(tn, None)

# ---------------- rotary
for b_, s, hq, hk, d, layout in [
    (4, 4096, 32, 8, 128, "bshd"),
    (4, 4096, 32, 8, 128, "sbhd"),
    (8, 2048, 64, 8, 128, "bshd"),
    (4, 4096, 16, 16, 64, "bshd"),
]:
    if layout == "bshd":
        q = torch.randn(b_, s, hq, d, device=dev, dtype=bf16)
        k = torch.randn(b_, s, hk, d, device=dev, dtype=bf16)
        cos = torch.randn(1, s, d, device=dev, dtype=bf16).expand(b_, s, d)
    else:
        q = torch.randn(s, b_, hq, d, device=dev, dtype=bf16).transpose(0, 1)
        k = torch.randn(s, b_, hk, d, device=dev, dtype=bf16).transpose(0, 1)
        cos = torch.randn(s, 1, d, device=dev, dtype=bf16).transpose(0, 1)
    sin = torch.randn_like(cos)
    nb = (q.numel() + k.numel()) * 2 * 2
    tag = f"rope {layout} b{b_} s{s} hq{hq} hk{hk} d{d}"
    for tile in (2048, 4096, 8192, 16384) if sweep else (tr.ROTARY_TILE_ELEMENTS,):
        for nw in (None, 4, 8) if sweep else (None,):
            tr.ROTARY_TILE_ELEMENTS = tile
            set_nw(tr, nw)
            record(f"{tag} fwd tile={tile} nw={nw}", bench(lambda: tr.rotary(q, k, cos, sin, False)), nb, copy_bw)
            record(f"{tag} bwd tile={tile} nw={nw}", bench(lambda: tr.rotary(q, k, cos, sin, True)), nb, copy_bw)
    tr.ROTARY_TILE_ELEMENTS = DEFAULT_ROPE_TILE
    set_nw(tr, None)

# ---------------- glu
for M, n in [(16384, 14336), (16384, 4096), (8192, 1000)]:
    x = torch.randn(M, 2 * n, device=dev, dtype=bf16)
    dy = torch.randn(M, n, device=dev, dtype=bf16)
    for act in ("silu", "gelu_tanh", "gelu"):
        tag = f"glu {act} {M}x{n}"
        record(f"{tag} fwd", bench(lambda: ta.glu_forward(x, act)), M * n * 2 * 3, copy_bw)
        record(f"{tag} bwd", bench(lambda: ta.glu_backward(dy, x, act)), M * n * 2 * 5, copy_bw)

# ---------------- public ops through autograd (fwd+bwd) against eager torch, bf16
from mcore.kernels import rms_norm, swiglu  # noqa: E402


def fwd_bwd(fn, inputs, grad):
    def run():
        for t in inputs:
            t.grad = None
        out = fn()
        out = out[0] if isinstance(out, tuple) else out
        out.backward(grad)

    return run


x = torch.randn(16384, 4096, device=dev, dtype=bf16, requires_grad=True)
w = torch.rand(4096, device=dev, dtype=bf16, requires_grad=True)
g = torch.randn(16384, 4096, device=dev, dtype=bf16)
nb = x.numel() * 2 * 5
for be in ("triton", "reference"):
    record(
        f"autograd rms_norm 16384x4096 {be}", bench(fwd_bwd(lambda: rms_norm(x, w, backend=be), (x, w), g)), nb, copy_bw
    )
record(
    "autograd torch F.rms_norm 16384x4096",
    bench(fwd_bwd(lambda: torch.nn.functional.rms_norm(x, (4096,), w), (x, w), g)),
    nb,
    copy_bw,
)
x = torch.randn(16384, 2 * 14336, device=dev, dtype=bf16, requires_grad=True)
g = torch.randn(16384, 14336, device=dev, dtype=bf16)
nb = 16384 * 14336 * 2 * 8
for be in ("triton", "reference"):
    record(f"autograd swiglu 16384x14336 {be}", bench(fwd_bwd(lambda: swiglu(x, backend=be), (x,), g)), nb, copy_bw)


def eager_swiglu():
    a, b2 = x.chunk(2, -1)
    return torch.nn.functional.silu(a) * b2


record("autograd eager silu(a)*b 16384x14336", bench(fwd_bwd(eager_swiglu, (x,), g)), nb, copy_bw)

print("\nSUMMARY (copy %.2f TB/s)" % (copy_bw / 1e12))
for name, us, tbs, frac in rows:
    print(f"{name:60s} {us:9.1f} us {tbs:6.2f} TB/s {100 * frac:5.1f}%")
with open(os.path.join(OUT, "bench.json"), "w") as f:
    json.dump({"copy_bw": copy_bw, "rows": rows}, f, indent=1)
