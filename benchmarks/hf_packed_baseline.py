"""The Hugging Face baseline of ``train_throughput.py``'s packed variant: ``hf_baseline.py``'s training step (the
same Llama, fp32 parameters under bf16 autocast, SDPA attention, fused AdamW, eager) fed the rows mcore trains on.

Hugging Face takes packed documents as ``position_ids`` that restart at 0 at each document start (no attention
mask): ``transformers.masking_utils`` then builds a mask that keeps attention inside documents. With SDPA that
mask is a dense ``[b, 1, s, s]`` boolean, so SDPA runs its masked kernel over the whole row (no work is skipped
between documents). Before timing, the script checks on a tiny model, on the same device, that this version of
transformers really separates the documents (packed logits equal to each document run alone); where it does not,
it writes ``{"unsupported": why}`` instead of a number (the orchestrator then reports mcore alone).

Rows: ``--rows FILE.npz`` (``tokens``, ``position_ids``, int64 ``[rows, seq]``, written by
``train_throughput.py``); step ``k`` trains on rows ``(k - 1) * mbs .. k * mbs - 1`` as mcore's step ``k`` does.
Timing as ``hf_baseline.py``: the first step's wall time, 2 warm-up steps, the median of ``--iters`` CUDA-event
timed steps. FLOPs: ``hf_baseline.py``'s per-token formula at each document's length (``packed_documents.py``).

    python benchmarks/hf_packed_baseline.py --shape 1b --rows rows.npz --json hf_1b-packed.json
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _common import SHAPES, write_json
from packed_documents import packed_record

WARMUP = 2  # hf_baseline.py's
PEAK = 989.4e12  # hf_baseline.py's


def llama(shape: dict[str, int]) -> Any:
    """``hf_baseline.py``'s model of ``shape``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=shape["hidden"],
        num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv"],
        intermediate_size=shape["ffn"],
        vocab_size=shape["vocab"],
        max_position_embeddings=shape["seq"],
        attn_implementation="sdpa",
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(cfg)


def packing_problem(device: torch.device) -> str | None:
    """``None`` when a packed row's logits equal its documents' run one by one (tiny fp32 model), else why not."""
    torch.manual_seed(0)
    shape = {"hidden": 64, "layers": 2, "heads": 4, "kv": 2, "ffn": 128, "vocab": 97, "seq": 32}
    model = llama(shape).to(device).eval()
    lengths = (11, 5, 16)
    ids = torch.randint(0, shape["vocab"], (1, sum(lengths)), device=device)
    pos = torch.cat([torch.arange(n, device=device) for n in lengths])[None]
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=pos, use_cache=False).logits[0]
        alone = torch.cat([model(input_ids=d, use_cache=False).logits[0] for d in ids.split(lengths, dim=1)])
    err = (packed - alone).abs().max().item() / alone.abs().max().item()
    if err > 1e-4:
        return f"position_ids restarts do not separate documents with sdpa (relative logit difference {err:.3g})"
    return None


def measure(model: Any, rows: dict[str, np.ndarray], mbs: int, iters: int, device: torch.device) -> dict[str, Any]:
    """First-step wall time, and the median of the timed steps (CUDA events, the host clock on CPU)."""
    cuda = device.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)
    tokens = torch.from_numpy(rows["tokens"]).to(device)
    positions = torch.from_numpy(rows["position_ids"]).to(device)
    step_index = [0]

    def step() -> None:
        lo = step_index[0] * mbs
        ids, pos = tokens[lo : lo + mbs], positions[lo : lo + mbs]
        step_index[0] += 1
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            loss = model(input_ids=ids, position_ids=pos, labels=ids, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    step()
    sync()
    first = time.perf_counter() - t0
    for _ in range(WARMUP):
        step()
    sync()
    times = []
    for _ in range(iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            sync()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t = time.perf_counter()
            step()
            times.append(time.perf_counter() - t)
    peak = (
        torch.cuda.max_memory_allocated(device) if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    )
    return {"step_s": statistics.median(times), "step_times_s": times, "first_step_s": first, "peak_bytes": peak}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=["1b", "8b4l", "tiny"], required=True)
    ap.add_argument("--rows", type=Path, required=True, help="tokens and position_ids (.npz, train_throughput.py's)")
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--dry-run", action="store_true", help="CPU, fp32 (no autocast): the tiny shape")
    args = ap.parse_args(argv)
    import transformers

    shape = SHAPES[args.shape]
    device = torch.device("cpu" if args.dry_run else "cuda")
    record: dict[str, Any] = {"impl": "hf-transformers-packed", "shape": args.shape, **shape}
    record["transformers"] = transformers.__version__
    problem = packing_problem(device)
    if problem is not None:
        write_json(args.json, {**record, "unsupported": problem})
        print(json.dumps({**record, "unsupported": problem}), flush=True)
        return 0
    with np.load(args.rows, allow_pickle=False) as npz:
        rows = {k: npz[k] for k in ("tokens", "position_ids")}
    needed = (1 + WARMUP + args.iters) * shape["mbs"]
    if rows["tokens"].shape != (rows["tokens"].shape[0], shape["seq"]) or rows["tokens"].shape[0] < needed:
        raise SystemExit(f"--rows {args.rows}: need >= {needed} rows of {shape['seq']}, got {rows['tokens'].shape}")
    torch.manual_seed(0)
    model = llama(shape).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    n_matmul = n_params - model.model.embed_tokens.weight.numel()
    m = measure(model, rows, shape["mbs"], args.iters, device)
    tokens_per_s = shape["mbs"] * shape["seq"] / m["step_s"]

    def flops_per_token(n: int) -> float:  # hf_baseline.py's formula at sequence length n
        return 6 * n_matmul + 12 * shape["layers"] * shape["hidden"] * n

    timed = range(2 + WARMUP, 2 + WARMUP + args.iters)
    packed = packed_record(rows["position_ids"], shape["mbs"], timed, flops_per_token, tokens_per_s, PEAK)
    record.update(params=n_params, tokens_per_s=tokens_per_s, step_s=m["step_s"], **packed)
    record.update(peak_mem_gb=m["peak_bytes"] / 1e9, first_step_s=m["first_step_s"], step_times_s=m["step_times_s"])
    record.update(gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", torch=torch.__version__)
    write_json(args.json, record)
    print(json.dumps({k: record[k] for k in ("impl", "shape", "tokens_per_s", "tflops_per_gpu", "mfu")}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
