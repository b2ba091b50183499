"""The tile sweep of our flash-attention kernels (``benchmarks/attention.py --sweep``).

Per case it times each kernel on its own at every candidate configuration: the forward, the dK/dV kernel
(which also stores dQ when every document fits in its key block: short documents) and the separate dQ kernel,
plus dK/dV with atomic dQ on the long document; each candidate's output is checked against a reference that is
not ours (SDPA on the documents as a batch; torch's plain reference where SDPA cannot express the case) before
its time counts. Then the best per kernel are combined and the whole forward and backward are timed with them
beside the current defaults of ``mcore.kernels.triton.flash_configs``.

Triton compiles each configuration once (seconds each): with ``jobs > 0`` a pool of processes compiles them all
into Triton's on-disk cache first, so the measuring process only loads them.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import multiprocessing
import traceback

import torch

# (block_m, block_n, warps, stages[, one_loop[, pack_gqa]]); kv: block_m = keys per program, dq/fwd: block_m =
# queries. The first of each list is the default of ``flash_configs`` (from the 5be4d1b sweep, recorded there);
# the others explore around it: deeper pipelines, 16 warps for the 128/256-key dK/dV blocks (which spill at 8),
# ``True, True`` rows pack the GQA group's 4 heads into the tiles' rows, ``False`` rows are the three-loop kernels.
P = (True, True)
D128 = {
    "fwd": [(64, 64, 4, 3), (64, 64, 4, 3, *P), (64, 64, 4, 4), (64, 32, 4, 3), (128, 128, 8, 3),
            (128, 128, 8, 3, *P), (128, 64, 8, 3), (128, 64, 8, 3, *P), (128, 128, 8, 4), (128, 64, 8, 3, False)],
    "kv": [(128, 32, 8, 3), (128, 32, 8, 3, *P), (128, 32, 8, 4), (128, 32, 8, 2), (128, 64, 8, 3),
           (128, 64, 8, 3, *P), (128, 32, 16, 3), (128, 64, 16, 3), (128, 16, 8, 3), (64, 64, 8, 3), (32, 64, 4, 3),
           (256, 32, 16, 2), (64, 64, 8, 2, False)],
    "dq": [(128, 64, 8, 3), (128, 64, 8, 3, *P), (128, 64, 8, 4), (128, 128, 8, 3), (64, 32, 4, 3),
           (64, 32, 4, 3, *P), (64, 64, 4, 3, *P), (128, 32, 4, 3), (128, 32, 8, 3), (128, 128, 16, 3),
           (128, 64, 8, 2, False)],
    "kv-atomic": [(128, 32, 8, 3)],
}  # fmt: skip
# Short documents (128 x 128, 32 x 512): a program visits one to four blocks, so software-pipeline stages
# mostly cost shared memory (fewer programs per SM); fewer stages, smaller tiles and 2-4 warps are explored. The
# 5be4d1b defaults come first; the current ones (from this list's 2884fd8 sweep) are among the others.
SHORT = {
    "fwd": [(64, 64, 4, 3), (64, 64, 4, 2), (64, 64, 4, 1), (64, 64, 4, 2, *P), (64, 128, 4, 2), (64, 32, 4, 2),
            (64, 32, 4, 3), (32, 64, 4, 2), (32, 32, 2, 2), (128, 64, 8, 2), (128, 64, 4, 2), (64, 64, 8, 2),
            (128, 128, 8, 2), (128, 64, 8, 2, *P)],
    "kv": [(128, 32, 8, 3), (128, 32, 8, 2), (128, 32, 8, 1), (128, 32, 4, 2), (128, 16, 8, 2), (128, 16, 4, 2),
           (128, 64, 8, 2), (128, 32, 8, 2, *P), (128, 16, 8, 2, *P), (128, 32, 16, 2), (64, 32, 4, 2),
           (64, 64, 4, 2), (128, 64, 8, 3)],
    "dq": [(64, 32, 4, 3), (64, 32, 4, 2), (64, 64, 4, 2), (64, 32, 4, 2, *P), (32, 64, 4, 2), (32, 32, 2, 2),
           (64, 16, 4, 2), (128, 32, 8, 2), (128, 64, 8, 2), (64, 64, 4, 3, *P)],
}  # fmt: skip
SHORT_CASES = ("128x128", "32x512")
WINDOW = {
    "fwd": [(64, 64, 4, 3), (64, 64, 4, 3, *P), (128, 64, 8, 3), (64, 32, 4, 3)],
    "kv": [(128, 32, 8, 3), (128, 32, 8, 3, *P), (128, 64, 8, 3), (64, 32, 8, 3)],
    "dq": [(64, 32, 4, 3), (64, 32, 4, 3, *P), (128, 32, 8, 3), (128, 64, 8, 3)],
}
MLA = {  # q/k head dim 192 is padded to 256 inside the kernels
    "fwd": [(128, 64, 8, 2), (128, 64, 8, 2, *P), (128, 64, 8, 3), (64, 64, 4, 2)],
    "kv": [(64, 32, 8, 2), (64, 32, 8, 2, *P), (128, 32, 8, 2), (128, 32, 16, 2), (64, 64, 8, 2)],
    "dq": [(128, 32, 8, 2), (128, 32, 8, 2, *P), (128, 64, 8, 2), (128, 32, 16, 2)],
}
DRY = {"fwd": [(16, 16, 1, 1), (32, 16, 1, 1)], "kv": [(16, 16, 1, 1), (32, 16, 1, 1)],
       "dq": [(16, 16, 1, 1), (32, 16, 1, 1)], "kv-atomic": [(16, 16, 1, 1)]}  # fmt: skip
# Cases with few documents first where the targets are (short documents), the long ones after.
SWEEP_ORDER = ["128x128", "32x512", "1x16384", "4x4096", "4x4096 sinks window128", "1x16384 mla 192/128"]
TOLERANCE = 2e-2


def candidates(case, dry: bool) -> dict[str, list[tuple[int, int, int, int]]]:
    name, _, _, kwargs, d_qk, d_v = case
    if dry:
        return DRY
    if d_qk != d_v or d_qk > 128:
        return MLA
    if kwargs:
        return WINDOW
    if name in SHORT_CASES:
        return SHORT
    table = dict(D128)
    if name != "1x16384":
        table.pop("kv-atomic")
    return table


@dataclasses.dataclass
class CaseData:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    sinks: torch.Tensor | None
    dout: torch.Tensor
    layout: object
    scale: float
    out: torch.Tensor
    lse: torch.Tensor
    delta: torch.Tensor
    lse2: torch.Tensor
    reference: dict | None = None


def prepare(case, shape, with_reference: bool) -> CaseData:
    from mcore.kernels.attention_layout import AttentionLayout
    from mcore.kernels.triton.flash_attention import flash_forward
    from mcore.kernels.triton.flash_backward import preprocess

    name, docs, length, kwargs, d_qk, d_v = case
    tokens = docs * length
    gen = torch.Generator(device=shape.device).manual_seed(0)
    make = lambda h, d: torch.randn(1, tokens, h, d, device=shape.device, dtype=shape.dtype, generator=gen)  # noqa: E731
    q, k, v = make(shape.heads, d_qk), make(shape.kv_heads, d_qk), make(shape.kv_heads, d_v)
    dout = make(shape.heads, d_v)
    sinks = torch.randn(shape.heads, device=shape.device, generator=gen) if kwargs.get("sinks") else None
    window = kwargs.get("window_size")
    bounds = None if docs == 1 else list(range(0, tokens + 1, length))
    layout = AttentionLayout.from_documents(1, tokens, tokens, causal=True, window_size=window, bounds=bounds)
    scale = d_qk**-0.5
    out, lse = flash_forward(q, k, v, layout, scale, sinks)
    delta, lse2 = preprocess(out, dout, lse, None)
    data = CaseData(q, k, v, sinks, dout, layout, scale, out, lse, delta, lse2)
    if with_reference:
        data.reference = _reference(data, docs, length, window, shape)
    return data


def _reference(data: CaseData, docs: int, length: int, window, shape) -> dict:
    """Output and gradients from torch: SDPA on the documents as a batch (the plain reference on the CPU or
    with sinks/window, which SDPA cannot express), in the inputs' dtype."""
    from mcore.kernels import attention

    backend = "sdpa" if data.sinks is None and window is None and shape.device == "cuda" else "reference"
    batched = lambda t: t.detach().reshape(docs, length, *t.shape[2:]).requires_grad_()  # noqa: E731
    leaves = [batched(t) for t in (data.q, data.k, data.v)]
    sinks = None if data.sinks is None else data.sinks.detach().requires_grad_()
    out = attention(*leaves, sinks=sinks, window_size=window, softmax_scale=data.scale, backend=backend)
    inputs = leaves + ([sinks] if sinks is not None else [])
    grads = torch.autograd.grad(out, inputs, data.dout.reshape(out.shape))
    flat = lambda t: t.reshape(1, docs * length, *t.shape[2:])  # noqa: E731
    ref = {"out": flat(out.detach()), "dq": flat(grads[0]), "dk": flat(grads[1]), "dv": flat(grads[2])}
    if sinks is not None:
        ref["dsinks"] = grads[3]
    return ref


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def run_candidate(data: CaseData, kind: str, config):
    """Run one kernel once at ``config``; returns (fn to time, {name: (ours, reference key)} to check)."""
    from mcore.kernels.triton import flash_backward as fb
    from mcore.kernels.triton.flash_attention import flash_forward
    from mcore.kernels.triton.flash_backward_kernels import DQ_ATOMIC, DQ_SEPARATE, DQ_STORE
    from mcore.kernels.triton.flash_configs import fused_dq_possible

    q, k, v, layout = data.q, data.k, data.v, data.layout
    if kind == "fwd":
        results = {}
        fn = lambda: results.__setitem__("out", flash_forward(q, k, v, layout, data.scale, data.sinks, config)[0])  # noqa: E731
        fn()
        return fn, lambda: {"out": results["out"]}, {}
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    if kind == "dq":  # as the backward runs it: computing and storing the row statistics (equal values)
        dq = torch.empty_like(q)
        stats = fb.RowStats(data.out, data.lse, None, store_delta=False)
        fn = lambda: fb.launch_dq(  # noqa: E731
            q, k, v, data.dout, data.lse2, data.delta, dq, layout, data.scale, config, stats=stats
        )
        fn()
        return fn, lambda: {"dq": dq}, {}
    if kind == "kv-atomic":
        mode = DQ_ATOMIC
    else:
        mode = DQ_STORE if fused_dq_possible(layout, config.block_m) else DQ_SEPARATE
    dq = torch.zeros(q.shape, device=q.device, dtype=torch.float32 if mode == DQ_ATOMIC else q.dtype)
    args = (q, k, v, data.dout, data.lse2, data.delta, dq, dk, dv, layout, data.scale, config, mode)
    # Storing dQ, the kernel computes the row statistics itself (as the backward runs it); otherwise it reads them.
    stats = fb.RowStats(data.out, data.lse, None, data.sinks is not None) if mode == DQ_STORE else None
    fn = lambda: fb.launch_kv(*args, stats=stats)  # noqa: E731
    fn()
    outputs = lambda: {"dk": dk, "dv": dv, **({"dq": dq} if mode != DQ_SEPARATE else {})}  # noqa: E731
    return fn, outputs, {"fused_dq": mode == DQ_STORE}


def sweep_case(case, shape, time_ms, dry: bool, totals_only: bool = False) -> list[dict]:
    """Rows of (case, kernel, config, ms, check) for every candidate, then the best combination end to end
    (``totals_only``: just the defaults' totals, with and without the preprocess pass)."""
    from mcore.kernels.triton.flash_configs import FlashConfig

    data = prepare(case, shape, with_reference=True)
    rows = []
    for kind, configs in {} if totals_only else candidates(case, dry).items():
        for tiles in configs:
            row = {"case": case[0], "kernel": kind, "config": list(tiles)}
            try:
                fn, outputs, extra = run_candidate(data, kind, FlashConfig(*tiles))
                row.update(extra)
                if kind == "kv-atomic":  # accumulating: check one fresh call, then time
                    outputs()["dq"].zero_()
                    fn()
                row["errors"] = {name: _rel(t, data.reference[name]) for name, t in outputs().items()}
                row["ok"] = all(err < TOLERANCE for err in row["errors"].values())
                row["ms"] = time_ms(fn)
            except Exception as exc:  # e.g. out of shared memory for this tile: recorded, the sweep goes on
                row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            rows.append(row)
    rows.extend(_totals(data, case, rows, time_ms))
    return rows


def best_configs(rows: list[dict], case_name: str) -> dict[str, dict]:
    """Fastest checked row per kernel; dK/dV ranked with the best dQ added unless it stores dQ itself."""
    ok = [r for r in rows if r["case"] == case_name and r.get("ok") and "ms" in r]
    best = {}
    for kind in ("fwd", "dq"):
        pool = [r for r in ok if r["kernel"] == kind]
        if pool:
            best[kind] = min(pool, key=lambda r: r["ms"])
    dq_ms = best["dq"]["ms"] if "dq" in best else float("inf")
    pool = [r for r in ok if r["kernel"] == "kv"]
    if pool:
        best["kv"] = min(pool, key=lambda r: r["ms"] + (0.0 if r.get("fused_dq") else dq_ms))
    return best


def _totals(data: CaseData, case, rows, time_ms) -> list[dict]:
    """The whole forward and the whole backward (preprocess, allocations, sinks included), best vs defaults."""
    from mcore.kernels.triton.flash_attention import flash_forward
    from mcore.kernels.triton.flash_backward import flash_backward
    from mcore.kernels.triton.flash_configs import FlashConfig, KernelConfigs

    best = best_configs(rows, case[0])
    choices = {"defaults": (None, True), "defaults-preprocess": (None, False)}
    if {"fwd", "kv", "dq"} <= set(best):
        chosen = KernelConfigs(*(FlashConfig(*best[kind]["config"]) for kind in ("fwd", "kv", "dq")))
        # the same tiles with the separate preprocess pass: what computing the row statistics in-kernel saves
        choices.update({"best": (chosen, True), "best-preprocess": (chosen, False)})
    out_rows = []
    for label, (configs, fuse_stats) in choices.items():
        row = {"case": case[0], "kernel": f"total-{label}"}
        if configs is not None:
            row["config"] = {kind: best[kind]["config"] for kind in ("fwd", "kv", "dq")}
        try:
            fwd = lambda c=configs: flash_forward(  # noqa: E731
                data.q, data.k, data.v, data.layout, data.scale, data.sinks, c.forward if c else None
            )
            bwd = lambda c=configs, fused=fuse_stats: flash_backward(  # noqa: E731
                data.q, data.k, data.v, data.out, data.lse, data.dout, data.layout, data.scale, data.sinks,
                deterministic=True, configs=c, fuse_stats=fused,
            )  # fmt: skip
            dq, dk, dv, dsinks = bwd()
            got = {"out": fwd()[0], "dq": dq, "dk": dk, "dv": dv, **({"dsinks": dsinks} if dsinks is not None else {})}
            row["errors"] = {name: _rel(t, data.reference[name]) for name, t in got.items()}
            row["ok"] = all(err < TOLERANCE for err in row["errors"].values())
            row["fwd_ms"], row["bwd_ms"] = time_ms(fwd), time_ms(bwd)
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            traceback.print_exc()
        out_rows.append(row)
    return out_rows


_WORKER_DATA: dict = {}


def _compile_task(case, shape, kind: str, tiles) -> str | None:
    """In a pool process: run one candidate once so that Triton compiles it into the on-disk cache."""
    from mcore.kernels.triton.flash_configs import FlashConfig

    on_cuda = shape.device == "cuda"
    if _WORKER_DATA.get("case") != case[0]:
        _WORKER_DATA.clear()
        if on_cuda:
            torch.cuda.empty_cache()
        _WORKER_DATA.update(case=case[0], data=prepare(case, shape, with_reference=False))
    try:
        run_candidate(_WORKER_DATA["data"], kind, FlashConfig(*tiles))
        if on_cuda:
            torch.cuda.synchronize()
    except Exception as exc:
        return f"{case[0]} {kind} {tiles}: {type(exc).__name__}: {str(exc)[:120]}"
    return None


def precompile(cases, shape, jobs: int, dry: bool = False) -> list[str]:
    """Compile every candidate of every case in ``jobs`` processes (Triton caches compiled kernels on disk);
    returns one line per candidate that failed."""
    tasks = [
        (case, kind, tiles) for case in cases for kind, configs in candidates(case, dry).items() for tiles in configs
    ]
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=jobs, mp_context=context) as pool:
        # Tasks of one case go to the same workers in a row, so each worker builds a case's inputs rarely.
        futures = [pool.submit(_compile_task, case, shape, kind, tiles) for case, kind, tiles in tasks]
        return [msg for f in futures if (msg := f.result()) is not None]


def markdown(rows: list[dict], flops_by_case: dict[str, float]) -> str:
    """Per case: the best configuration per kernel, and the totals (defaults vs best) in the issue's TFLOP/s."""
    lines = ["| case | kernel | config (m, n, warps, stages) | ms | note |", "|---|---|---|---:|---|"]
    for case in dict.fromkeys(r["case"] for r in rows):
        for kind, row in best_configs(rows, case).items():
            note = "stores dQ" if row.get("fused_dq") else ""
            lines.append(f"| {case} | {kind} | {tuple(row['config'])} | {row['ms']:.3f} | {note} |")
        for row in (r for r in rows if r["case"] == case and r["kernel"].startswith("total")):
            if "fwd_ms" not in row:
                lines.append(f"| {case} | {row['kernel']} | | | {row.get('error', '')[:80]} |")
                continue
            flops = flops_by_case[case]
            total = 3.5 * flops / (row["fwd_ms"] + row["bwd_ms"]) / 1e9
            note = (
                f"fwd {row['fwd_ms']:.3f} ms {flops / row['fwd_ms'] / 1e9:.0f}, bwd {row['bwd_ms']:.3f} ms "
                f"{2.5 * flops / row['bwd_ms'] / 1e9:.0f}, fwd+bwd {total:.0f} TFLOP/s, ok={row['ok']}"
            )
            lines.append(f"| {case} | {row['kernel']} | {row.get('config', 'flash_configs')} | | {note} |")
    return "\n".join(lines)
