"""The Triton SSD backend against the token-by-token float64 scan (outputs, final states, every gradient): chunk
sizes below, at and above one kernel tile (64 rows), documents inside chunks, on chunk edges and one token long,
with and without initial states / final-state gradients; fp16 inputs; CUDA (compiled kernels) on larger shapes."""

from __future__ import annotations

import pytest
import torch

from mcore.kernels import ssd_scan
from tests.kernels.test_ssd import docs_to_seq_idx, make_inputs, sequential_scan

NAMES = ["x", "dt", "A", "B", "C", "D", "dt_bias", "initial"]

# (batch, seqlen, chunk, document starts over the flattened tokens, heads, head_dim, groups, state)
CASES = {
    "docs_in_chunks": (2, 13, 4, [13], 4, 3, 2, 5),
    "one_token_docs": (1, 16, 4, [3, 4, 11], 4, 3, 2, 5),
    "doc_on_chunk_edge": (2, 9, 8, [5, 9, 10], 2, 4, 1, 3),
    "chunk_3_no_docs": (1, 12, 3, [], 2, 5, 2, 6),
    "chunk_80_two_tiles": (1, 150, 80, [70, 100], 2, 3, 1, 4),
    "shorter_than_a_chunk": (2, 5, 16, [2, 5, 9], 2, 3, 1, 4),
}


def _run(case, device, dtype, with_initial=True, with_final=True, docs=True):
    b, length, chunk, cuts, h, p, g, n = case
    inputs = list(make_inputs(b, length, h, p, g, n, seed=length * 7 + chunk))
    for i in (0, 1, 3, 4):  # x, dt, B, C are rounded to the input dtype first: the reference sees those values
        inputs[i] = inputs[i].to(dtype).float()
    seq_idx = docs_to_seq_idx(b, length, cuts)[1] if docs else torch.zeros(b, length, dtype=torch.int32)
    seq_idx = seq_idx.to(device)
    # The float64 reference runs where the kernels run (token by token: on CUDA a few hundred small launches).
    leaves = [t.clone().double().to(device).requires_grad_() for t in inputs]
    ref_y, ref_state = sequential_scan(*leaves[:7], leaves[7] if with_initial else None, seq_idx)
    ours = [t.detach().clone().to(device) for t in inputs]
    for i in (0, 1, 3, 4):  # x, dt, B, C in the input dtype; A, D, dt_bias, initial stay fp32
        ours[i] = ours[i].to(dtype)
    ours = [t.requires_grad_() for t in ours]
    x, dt, A, B, C, D, dt_bias, initial = ours
    y, state = ssd_scan(
        x, dt, A, B, C, chunk_size=chunk, D=D, dt_bias=dt_bias, initial_states=initial if with_initial else None,
        seq_idx=seq_idx if docs else None, return_final_states=True, backend="triton",
    )  # fmt: skip
    assert y.dtype == dtype and state.dtype == torch.float32
    gen = torch.Generator().manual_seed(11)
    gy = torch.randn(y.shape, generator=gen, dtype=torch.float64).to(device)
    gs = torch.randn(state.shape, generator=gen, dtype=torch.float64).to(device)
    loss, ref_loss = (y.double() * gy).sum(), (ref_y * gy).sum()
    if with_final:
        loss, ref_loss = loss + (state.double() * gs).sum(), ref_loss + (ref_state * gs).sum()
    loss.backward()
    ref_loss.backward()
    names = NAMES if with_initial else NAMES[:7]
    grads = {name: (mine.grad, ref.grad) for name, mine, ref in zip(names, ours, leaves)}
    return (y, ref_y), (state, ref_state), grads


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("case", list(CASES))
def test_triton_ssd_equals_sequential_float64(case, interpreter):
    (y, ref_y), (state, ref_state), grads = _run(CASES[case], interpreter, torch.float32)
    assert _rel(y, ref_y) < 1e-5 and _rel(state, ref_state) < 1e-5
    for name, (mine, ref) in grads.items():
        assert _rel(mine, ref) < 2e-5, name


@pytest.mark.parametrize("with_initial,with_final,docs", [(False, False, True), (False, True, False)])
def test_triton_ssd_without_initial_state_or_documents(with_initial, with_final, docs, interpreter):
    (y, ref_y), (state, ref_state), grads = _run(CASES["one_token_docs"], interpreter, torch.float32,
                                                 with_initial, with_final, docs)  # fmt: skip
    assert _rel(y, ref_y) < 1e-5 and _rel(state, ref_state) < 1e-5
    assert set(grads) == set(NAMES if with_initial else NAMES[:7])
    for name, (mine, ref) in grads.items():
        assert _rel(mine, ref) < 2e-5, name


@pytest.mark.parametrize("case", ["docs_in_chunks", "chunk_80_two_tiles"])
def test_torch_state_matmuls_alternative(case, interpreter, monkeypatch):
    """The fp32 torch matmuls for the chunk states and the inter-chunk output (the alternative the benchmark
    times against the Triton kernels) compute the same."""
    import mcore.kernels.ssd_triton as glue

    monkeypatch.setattr(glue, "STATE_MATMULS", "torch")
    (y, ref_y), (state, ref_state), grads = _run(CASES[case], interpreter, torch.float32)
    assert _rel(y, ref_y) < 1e-5 and _rel(state, ref_state) < 1e-5
    for name, (mine, ref) in grads.items():
        assert _rel(mine, ref) < 2e-5, name


def test_triton_ssd_fp16_inputs(interpreter):
    (y, ref_y), (state, ref_state), grads = _run(CASES["docs_in_chunks"], interpreter, torch.float16)
    assert _rel(y, ref_y) < 5e-3 and _rel(state, ref_state) < 5e-3
    for name, (mine, ref) in grads.items():
        assert _rel(mine, ref) < 1e-2, name


def test_ssd_dispatch_picks_triton_only_when_asked_on_cpu(spy, interpreter):
    calls = spy("mcore.kernels.ssd_triton", "ssd_chunked_triton")
    x, dt, A, B, C, D, dt_bias, _ = make_inputs(1, 8, 2, 4, 1, 3, seed=0)
    ssd_scan(x, dt, A, B, C, chunk_size=4, D=D, dt_bias=dt_bias)
    assert not calls
    ssd_scan(x, dt, A, B, C, chunk_size=4, D=D, dt_bias=dt_bias, backend="triton")
    assert len(calls) == 1


# ---------------------------------------------------------------------------------------------- CUDA

GPU_CASES = {
    # Nemotron-H-like: chunk 128, 4 heads per group, head_dim 64, state 128, documents inside and on chunk edges.
    "nemotron_like": (2, 600, 128, [100, 256, 257, 900], 8, 64, 2, 128),
    # Mamba-2-like: chunk 256 (the dCB kernel's tile is 32 x 256), head_dim 64, state 128, one group.
    "mamba2_like": (1, 700, 256, [300], 4, 64, 1, 128),
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(GPU_CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("states", ["triton", "torch"])
def test_gpu_triton_ssd_vs_float64(case, dtype, states, cuda_triton, monkeypatch):
    import mcore.kernels.ssd_triton as glue

    # Each state-matmul path on its own (the default "auto" would hide a failing one behind the other).
    monkeypatch.setattr(glue, "STATE_MATMULS", states)
    (y, ref_y), (state, ref_state), grads = _run(GPU_CASES[case], cuda_triton, dtype)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    assert _rel(y, ref_y) < tol and _rel(state, ref_state) < tol
    for name, (mine, ref) in grads.items():
        assert _rel(mine, ref) < (5e-4 if dtype == torch.float32 else 5e-2), name
