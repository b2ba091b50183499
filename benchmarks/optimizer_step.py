"""The optimizer step of a large model under each precision-aware choice: mcore's fused ``adamw_step_`` (clip
multiplier read on the device, bf16 parameters written in the same pass) with the gradient and the two moments each
in fp32 or bf16 (``optim.main_grads_dtype`` / ``exp_avg_dtype`` / ``exp_avg_sq_dtype``), against what the fp32 one
replaces, torch's fused AdamW + the clip multiply (``_foreach_mul_``) + the master -> bf16 copy.

Shapes: ``gptoss4l`` (gpt-oss-20b layers x 4: 4.45 B parameters, the #21 shape whose step spends 39.4 ms in AdamW)
and ``8b4l`` (Llama-3-8B layers x 4, 1.9 B). Memory bound: bytes per element are 8 (fp32 master read and written)
+ the gradient's + 2 x each moment's + 2 (bf16 parameter written): 30 with every state in fp32, 20 with all bf16;
the torch sequence moves ~48. Each combination is first checked against the reference backend on a probe tensor
(1M elements, the same inputs: master and fp32 moments within 2e-6, bf16 moments within one bf16 ulp more), then
timed: CUDA-event means over 5 steps after 2 warm-ups. Exit status 1 when a check fails.

::

    python benchmarks/optimizer_step.py --shape gptoss4l --json OUT.json   # one GPU, ~90 GB, ~60 s with start-up
    python benchmarks/optimizer_step.py --dry-run --json OUT.json          # CPU, tiny tensors, reference backend
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

# (grad, exp_avg, exp_avg_sq) dtypes: all fp32 (today's default), bf16 gradients only, bf16 moments only, all bf16
COMBOS = ("fp32/fp32/fp32", "bf16/fp32/fp32", "fp32/bf16/bf16", "bf16/bf16/bf16", "bf16/bf16/fp32")
PROBE = 1 << 20  # elements of the check's tensor (dry run: 1 << 14, for Triton's interpreter)


def shapes_8b4l() -> list[int]:
    """Element counts of the 8b4l parameters (hidden 4096, ffn 14336, 8 kv heads of 128, vocab 128256, 4 layers)."""
    h, f, kv, vocab = 4096, 14336, 1024, 128256
    per_layer = [h * (h + 2 * kv), h * h, 2 * f * h, f * h, h, h]
    return [vocab * h] + per_layer * 4 + [h, vocab * h]


def shapes_gptoss4l() -> list[int]:
    """Element counts of gpt-oss-20b x 4 layers (hidden 2880, 64 query heads and 8 kv heads of 64, 32 experts of
    2880 with biases, vocab 201088, untied): 4,451,017,664 in all, mcore's parameter count of that config."""
    h, q, kv, e, f, vocab = 2880, 64 * 64, 8 * 64, 32, 2880, 201088
    attention = [h * q, q, h * kv, kv, h * kv, kv, q * h, h, 64]  # q, k, v, o with biases, the sinks
    experts = [h * e, e, e * h * 2 * f, e * 2 * f, e * f * h, e * h]  # router, gate_up, down with biases
    return [vocab * h] + (attention + experts + [h, h]) * 4 + [h, vocab * h]


SHAPES = {"gptoss4l": shapes_gptoss4l, "8b4l": shapes_8b4l, "tiny": lambda: [4097, 33 * 7, 1, 2 * 4096 + 5]}


def bytes_per_element(combo: str) -> int:
    g, m, v = (2 if d == "bf16" else 4 for d in combo.split("/"))
    return 8 + g + 2 * (m + v) + 2


def parse_combos(text: str) -> list[str]:
    combos = [c.strip() for c in text.split(",") if c.strip()]
    for c in combos:
        parts = c.split("/")
        if len(parts) != 3 or any(p not in ("fp32", "bf16") for p in parts):
            raise ValueError(f"--combos entry {c!r}: want GRAD/EXP_AVG/EXP_AVG_SQ, each fp32 or bf16")
    return combos


def _check(torch, adamw_step_, combo: str, device: str, backend: str, probe: int) -> dict:
    """One step on a probe tensor with ``backend`` against the reference backend, from the same random state."""
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16}
    g_dt, m_dt, v_dt = (dt[d] for d in combo.split("/"))
    gen = torch.Generator(device=device).manual_seed(1)
    p = torch.randn(probe, device=device, generator=gen)
    g = (torch.randn(probe, device=device, generator=gen) * 1e-2).to(g_dt)
    m = (torch.randn(probe, device=device, generator=gen) * 1e-2).to(m_dt)
    v = (torch.rand(probe, device=device, generator=gen) * 1e-4).to(v_dt)
    outs = {}
    for name in (backend, "reference"):
        state = [p.clone(), m.clone(), v.clone()]
        adamw_step_([state[0]], [g], [state[1]], [state[2]], steps=3, lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8,
                    weight_decay=0.1, backend=name)  # fmt: skip
        outs[name] = state
    got, ref = outs[backend], outs["reference"]
    master_err = ((got[0] - ref[0]).abs().max() / ref[0].abs().max()).item()
    ok = master_err <= 2e-6
    moment_errs = []
    for a, b in zip(got[1:], ref[1:]):
        a, b, bf16 = a.float(), b.float(), a.dtype == torch.bfloat16
        # fp32: a few ulps of the tensor's scale; bf16: one ulp of the value (a rounding boundary crossed) on top
        excess = (a - b).abs() - 2e-6 * b.abs().max() - (torch.finfo(torch.bfloat16).eps * b.abs() if bf16 else 0)
        moment_errs.append(((a - b).abs().max() / b.abs().max()).item())
        ok = ok and bool((excess <= 0).all())
    return {"master_rel_err": master_err, "moment_rel_errs": moment_errs, "ok": ok}


def _time(torch, fn, device: str, steps: int) -> float:
    for k in (1, 2):
        fn(k)
    if device != "cuda":
        import time

        t0 = time.perf_counter()
        for k in range(3, 3 + steps):
            fn(k)
        return (time.perf_counter() - t0) * 1e3 / steps
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for k in range(3, 3 + steps):
        fn(k)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / steps


def run(shape: str, combos: list[str], *, dry_run: bool, with_torch: bool) -> dict:
    import torch

    from mcore.kernels import adamw_step_

    device = "cpu" if dry_run else "cuda"
    backend = "reference" if dry_run else "triton"
    # the dry run checks the Triton kernel too when its CPU interpreter is on (timed: the reference)
    check_backend = "triton" if not dry_run or os.environ.get("TRITON_INTERPRET") == "1" else "reference"
    sizes = SHAPES[shape]()
    n = sum(sizes)
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16}
    gen = torch.Generator(device=device).manual_seed(0)
    params = [torch.randn(s, device=device, generator=gen) for s in sizes]
    grads32 = [torch.randn(s, device=device, generator=gen) * 1e-2 for s in sizes]
    model = [torch.empty(s, device=device, dtype=torch.bfloat16) for s in sizes]
    coef = torch.tensor(0.5, device=device)
    hyper = {"lr": 1e-4, "weight_decay": 0.1, "eps": 1e-8, "beta1": 0.9, "beta2": 0.95}
    gpu = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    results = {"shape": shape, "elements": n, "tensors": len(sizes), "gpu": gpu, "torch": torch.__version__,
               "backend": backend, "check_backend": check_backend, "combos": {}}  # fmt: skip
    for combo in combos:
        g_dt, m_dt, v_dt = (dt[d] for d in combo.split("/"))
        grads = grads32 if g_dt == torch.float32 else [g.to(g_dt) for g in grads32]
        exp_avgs = [torch.zeros(s, device=device, dtype=m_dt) for s in sizes]
        exp_avg_sqs = [torch.zeros(s, device=device, dtype=v_dt) for s in sizes]

        def ours(k: int, grads=grads, exp_avgs=exp_avgs, exp_avg_sqs=exp_avg_sqs) -> None:
            adamw_step_(params, grads, exp_avgs, exp_avg_sqs, steps=k, grad_multiplier=coef, model_params=model,
                        backend=backend, **hyper)  # fmt: skip

        check = _check(torch, adamw_step_, combo, device, check_backend, 1 << 14 if dry_run else PROBE)
        ms = _time(torch, ours, device, steps=1 if dry_run else 5)
        nbytes = bytes_per_element(combo)
        results["combos"][combo] = {"ms": ms, "bytes_per_element": nbytes, "effective_TBps": nbytes * n / ms / 1e9,
                                    "check": check}  # fmt: skip
        print(f"{combo}: {ms:.2f} ms per step ({nbytes} B/element -> {nbytes * n / ms / 1e9:.2f} TB/s), check {check}")
        del grads, exp_avgs, exp_avg_sqs, ours
    if with_torch:
        torch_opt = torch.optim.AdamW(params, betas=(0.9, 0.95), lr=1e-4, weight_decay=0.1, eps=1e-8,
                                      fused=device == "cuda")  # fmt: skip
        for p, g in zip(params, grads32):
            p.grad = g

        def torch_sequence(k: int) -> None:
            torch._foreach_mul_(grads32, coef)
            torch_opt.step()
            for m, p in zip(model, params):
                m.copy_(p)

        ms = _time(torch, torch_sequence, device, steps=1 if dry_run else 5)
        results["torch fused AdamW + clip + copy"] = {"ms": ms, "bytes_per_element": 48,
                                                      "effective_TBps": 48 * n / ms / 1e9}  # fmt: skip
        print(f"torch fused AdamW + clip + copy: {ms:.2f} ms per step")
    results["all_checks_ok"] = all(c["check"]["ok"] for c in results["combos"].values())
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=["gptoss4l", "8b4l"], default="gptoss4l")
    ap.add_argument("--combos", default=",".join(COMBOS), help="GRAD/EXP_AVG/EXP_AVG_SQ dtypes, comma-separated")
    ap.add_argument("--skip-torch", action="store_true", help="leave out torch's fused AdamW sequence")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny tensors, the reference backend, one step")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    try:
        combos = parse_combos(args.combos)
    except ValueError as exc:
        ap.error(str(exc))
    results = run("tiny" if args.dry_run else args.shape, combos, dry_run=args.dry_run, with_torch=not args.skip_torch)
    print(json.dumps(results))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0 if results["all_checks_ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
