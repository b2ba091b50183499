"""The optimizer step of a 1.9B-parameter model (the ``8b4l`` shape: fp32 masters and moments, bf16 parameters):
mcore's fused ``adamw_step_`` (clip multiplier read on the device, bf16 parameters written in the same pass)
against what it replaces, torch's fused AdamW + the clip multiply (``_foreach_mul_``) + the master -> bf16 copy.

Memory bound: bytes per element are 30 for ours (read grad, master, exp_avg, exp_avg_sq; write those three and
the bf16 parameter) and ~48 for the torch sequence. Times are CUDA-event means over 5 steps after 2 warm-ups.

::

    python benchmarks/optimizer_step.py --json OUT.json     # one GPU, ~60 GB of memory
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def shapes_8b4l() -> list[int]:
    """Element counts of the 8b4l parameters (hidden 4096, ffn 14336, 8 kv heads of 128, vocab 128256, 4 layers)."""
    h, f, kv, vocab = 4096, 14336, 1024, 128256
    per_layer = [h * (h + 2 * kv), h * h, 2 * f * h, f * h, h, h]
    return [vocab * h] + per_layer * 4 + [h, vocab * h]


def main() -> None:
    import torch

    from mcore.kernels import adamw_step_

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    dev = "cuda"
    sizes = shapes_8b4l()
    n = sum(sizes)
    gen = torch.Generator(device=dev).manual_seed(0)
    params = [torch.randn(s, device=dev, generator=gen) for s in sizes]
    grads = [torch.randn(s, device=dev, generator=gen) for s in sizes]
    exp_avgs = [torch.zeros(s, device=dev) for s in sizes]
    exp_avg_sqs = [torch.zeros(s, device=dev) for s in sizes]
    model = [torch.empty(s, device=dev, dtype=torch.bfloat16) for s in sizes]
    coef = torch.tensor(0.5, device=dev)
    hyper = {"lr": 1e-4, "weight_decay": 0.1, "eps": 1e-8}

    def ours(k: int) -> None:
        adamw_step_(
            params, grads, exp_avgs, exp_avg_sqs, steps=k, beta1=0.9, beta2=0.95, grad_multiplier=coef,
            model_params=model, **hyper,
        )  # fmt: skip

    torch_opt = torch.optim.AdamW(params, betas=(0.9, 0.95), fused=True, **hyper)
    for p, g in zip(params, grads):
        p.grad = g

    def torch_sequence(k: int) -> None:
        torch._foreach_mul_(grads, coef)
        torch_opt.step()
        for m, p in zip(model, params):
            m.copy_(p)

    results = {"elements": n, "tensors": len(sizes), "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__}
    runs = (("mcore adamw_step_", ours, 30), ("torch fused AdamW + clip + copy", torch_sequence, 48))
    for name, fn, bytes_per in runs:
        for k in (1, 2):
            fn(k)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for k in range(3, 8):
            fn(k)
        end.record()
        torch.cuda.synchronize()
        ms = start.elapsed_time(end) / 5
        results[name] = {"ms": ms, "bytes_per_element": bytes_per, "effective_TBps": bytes_per * n / ms / 1e9}
        print(f"{name}: {ms:.2f} ms per step ({bytes_per} B/element -> {bytes_per * n / ms / 1e9:.2f} TB/s)")
    print(json.dumps(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
