"""SSD scan, causal conv1d and the gated norm against references that are not ours: a sequential float64 scan
of the recurrence (outputs, final states, gradients through autograd of that scan), ``F.conv1d`` run on each
document alone, and the gated norm written out per group in float64."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from mcore.kernels import causal_conv1d, gated_rms_norm, ssd_scan
from mcore.kernels.ssd import seq_idx_from_cu_seqlens


def sequential_scan(x, dt, A, B, C, D, dt_bias, initial, seq_idx):
    """Token-by-token float64 recurrence; the state resets where seq_idx changes."""
    b, length, h, p = x.shape
    g, n = B.shape[2:]
    rep = h // g
    x, dt, A, B, C, D, dt_bias = (t.double() for t in (x, dt, A, B, C, D, dt_bias))
    dt = F.softplus(dt + dt_bias)
    B, C = B.repeat_interleave(rep, dim=2), C.repeat_interleave(rep, dim=2)
    state = torch.zeros(b, h, p, n, dtype=torch.float64, device=x.device) if initial is None else initial.double()
    ys = []
    for t in range(length):
        if t > 0:
            keep = (seq_idx[:, t] == seq_idx[:, t - 1]).double()[:, None, None, None]
            state = state * keep
        decay = torch.exp(dt[:, t] * A)[:, :, None, None]
        state = decay * state + (dt[:, t, :, None, None] * x[:, t, :, :, None] * B[:, t, :, None, :])
        ys.append(torch.einsum("bhpn,bhn->bhp", state, C[:, t]) + D[:, None] * x[:, t])
    return torch.stack(ys, dim=1), state


def make_inputs(b, length, h, p, g, n, seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=dtype)  # noqa: E731
    x, dt, B, C = r(b, length, h, p), r(b, length, h), r(b, length, g, n), r(b, length, g, n)
    A = -torch.exp(torch.rand(h, generator=gen) * 2 - 1)
    D, dt_bias = r(h).float(), r(h).float() * 0.5
    initial = r(b, h, p, n).float()
    return x, dt, A, B, C, D, dt_bias, initial


def docs_to_seq_idx(b, length, cuts):
    """``cuts``: token offsets (within the flattened b * length tokens) where a new document starts."""
    cu = torch.tensor([0, *cuts, b * length], dtype=torch.int32)
    return cu, seq_idx_from_cu_seqlens(cu, b, length)


# (batch, seqlen, chunk, document starts over the flattened tokens): boundaries inside chunks, on chunk
# boundaries, a one-token document, a row boundary that is not a document boundary is impossible (rows start docs).
CASES = [
    (2, 13, 4, [13]),
    (1, 16, 4, [3, 4, 11]),
    (2, 9, 8, [5, 9, 10]),
    (1, 11, 16, [1, 2, 7]),
    (1, 12, 3, []),
]


@pytest.mark.parametrize("b,length,chunk,cuts", CASES)
def test_ssd_equals_sequential_scan_outputs_states_and_grads(b, length, chunk, cuts):
    h, p, g, n = 4, 3, 2, 5
    inputs = make_inputs(b, length, h, p, g, n, seed=length * 31 + chunk)
    cu, seq_idx = docs_to_seq_idx(b, length, cuts)
    # The initial state feeds each row's first document only; rows of one document see it all the way.
    leaves = [t.clone().double().requires_grad_() for t in inputs]
    ref_y, ref_state = sequential_scan(*leaves, seq_idx)
    ours = [t.detach().clone().requires_grad_() for t in inputs]
    x, dt, A, B, C, D, dt_bias, initial = ours
    y, state = ssd_scan(
        x,
        dt,
        A,
        B,
        C,
        chunk_size=chunk,
        D=D,
        dt_bias=dt_bias,
        initial_states=initial,
        cu_seqlens=cu,
        return_final_states=True,
    )
    torch.testing.assert_close(y.double(), ref_y, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state.double(), ref_state, rtol=1e-5, atol=1e-5)
    gen = torch.Generator().manual_seed(7)
    gy, gs = torch.randn(y.shape, generator=gen), torch.randn(state.shape, generator=gen)
    ((y * gy).sum() + (state * gs).sum()).backward()
    ((ref_y * gy.double()).sum() + (ref_state * gs.double()).sum()).backward()
    for name, mine, ref in zip(["x", "dt", "A", "B", "C", "D", "dt_bias", "initial"], ours, leaves, strict=True):
        torch.testing.assert_close(mine.grad.double(), ref.grad, rtol=1e-4, atol=1e-5, msg=name)


def test_ssd_seq_idx_and_cu_seqlens_agree_and_packed_equals_separate():
    h, p, g, n = 2, 4, 1, 3
    x, dt, A, B, C, D, dt_bias, _ = make_inputs(1, 10, h, p, g, n, seed=3)
    cu, seq_idx = docs_to_seq_idx(1, 10, [6])
    kw = dict(chunk_size=4, D=D, dt_bias=dt_bias)
    packed = ssd_scan(x, dt, A, B, C, cu_seqlens=cu, **kw)
    assert torch.equal(packed, ssd_scan(x, dt, A, B, C, seq_idx=seq_idx, **kw))
    for lo, hi in ((0, 6), (6, 10)):
        alone = ssd_scan(x[:, lo:hi], dt[:, lo:hi], A, B[:, lo:hi], C[:, lo:hi], **kw)
        torch.testing.assert_close(packed[:, lo:hi], alone, rtol=1e-5, atol=1e-6)


def test_ssd_bf16_inputs_give_bf16_close_to_fp32():
    inputs = make_inputs(1, 8, 2, 4, 1, 4, seed=5)
    x, dt, A, B, C, D, dt_bias, _ = inputs
    ref = ssd_scan(x, dt, A, B, C, chunk_size=4, D=D, dt_bias=dt_bias)
    low = [t.bfloat16() for t in (x, dt, B, C)]
    y = ssd_scan(low[0], low[1], A, low[2], low[3], chunk_size=4, D=D, dt_bias=dt_bias)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), ref, rtol=0.1, atol=0.1 * ref.abs().max().item())


def test_ssd_bad_input_names_the_tensor():
    x, dt, A, B, C, *_ = make_inputs(1, 4, 2, 2, 1, 2, seed=1)
    with pytest.raises(ValueError, match="dt must be"):
        ssd_scan(x, dt[:, :3], A, B, C, chunk_size=2)
    with pytest.raises(ValueError, match="groups .1. must divide heads|B and C"):
        ssd_scan(x, dt, A, B, C[:, :, :, :1], chunk_size=2)
    with pytest.raises(ValueError, match="chunk_size"):
        ssd_scan(x, dt, A, B, C, chunk_size=0)
    with pytest.raises(ValueError, match="cu_seqlens must start at 0"):
        ssd_scan(x, dt, A, B, C, chunk_size=2, cu_seqlens=torch.tensor([0, 3], dtype=torch.int32))


@pytest.mark.parametrize("cuts", [[], [3], [1, 2, 6]])
@pytest.mark.parametrize("bias", [True, False])
def test_causal_conv1d_equals_f_conv1d_per_document(cuts, bias):
    b, length, dim, k = 1, 9, 6, 4
    gen = torch.Generator().manual_seed(len(cuts) + bias)
    x = torch.randn(b, length, dim, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(dim, k, generator=gen, dtype=torch.float64, requires_grad=True)
    bb = torch.randn(dim, generator=gen, dtype=torch.float64, requires_grad=True) if bias else None
    cu, seq_idx = docs_to_seq_idx(b, length, cuts)
    out = causal_conv1d(x, w, bb, seq_idx=seq_idx if cuts else None)
    bounds = [0, *cuts, length]
    ref = []
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        seg = x[:, lo:hi].transpose(1, 2)
        ref.append(F.silu(F.conv1d(seg, w[:, None, :], bb, padding=k - 1, groups=dim)[..., : hi - lo]))
    ref = torch.cat(ref, dim=2).transpose(1, 2)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    grads = torch.autograd.grad(out.square().sum(), [x, w])
    ref_grads = torch.autograd.grad(ref.square().sum(), [x, w])
    for mine, theirs in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-12, atol=1e-12)


def test_causal_conv1d_states_continue_a_sequence():
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(2, 7, 5, generator=gen)
    w, bias = torch.randn(5, 4, generator=gen), torch.randn(5, generator=gen)
    whole = causal_conv1d(x, w, bias)
    tail = causal_conv1d(x[:, 4:], w, bias, conv_states=x[:, 1:4].transpose(1, 2))
    torch.testing.assert_close(tail, whole[:, 4:], rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="conv_states must be"):
        causal_conv1d(x, w, bias, conv_states=x[:, :2].transpose(1, 2))


@pytest.mark.parametrize("norm_before_gate", [False, True])
def test_gated_rms_norm_per_group_in_float64(norm_before_gate):
    gen = torch.Generator().manual_seed(int(norm_before_gate))
    x, z = torch.randn(3, 12, generator=gen), torch.randn(3, 12, generator=gen)
    w = torch.randn(12, generator=gen)
    out = gated_rms_norm(x, z, w, group_size=4, eps=1e-5, norm_before_gate=norm_before_gate)
    xd, zd = x.double(), z.double()
    gated = xd * zd * torch.sigmoid(zd)
    h = xd if norm_before_gate else gated
    expected = []
    for i in range(3):
        part = h[:, 4 * i : 4 * i + 4]
        expected.append(part / torch.sqrt(part.pow(2).mean(-1, keepdim=True) + 1e-5))
    expected = torch.cat(expected, dim=1)
    if norm_before_gate:
        expected = expected * zd * torch.sigmoid(zd)
    torch.testing.assert_close(out.double(), expected * w.double(), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="group_size"):
        gated_rms_norm(x, z, w, group_size=5)


def test_ssd_dt_limit_clamps():
    x, dt, A, B, C, D, dt_bias, _ = make_inputs(1, 6, 2, 2, 1, 2, seed=9)
    lo, hi = 0.2, 0.5
    y = ssd_scan(x, dt, A, B, C, chunk_size=4, dt_bias=dt_bias, dt_limit=(lo, hi))
    clamped = torch.log(torch.expm1(F.softplus(dt + dt_bias).clamp(lo, hi)))  # inverse softplus of the clamp
    y2 = ssd_scan(x, clamped, A, B, C, chunk_size=4)
    assert math.isfinite(y.abs().max().item())
    torch.testing.assert_close(y, y2, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("cuts", [[], [2, 37]])
@pytest.mark.parametrize("bias,activation", [(True, "silu"), (False, None)])
def test_triton_causal_conv1d_equals_reference_forward_and_backward(interpreter, spy, cuts, bias, activation):
    from mcore.kernels.conv import reference_conv1d

    launched = spy("mcore.kernels.triton.conv", "conv_forward"), spy("mcore.kernels.triton.conv", "conv_backward")

    b, length, dim, k = 2, 40, 70, 4  # length and dim not multiples of the tile
    gen = torch.Generator().manual_seed(len(cuts))
    x = torch.randn(b, length, dim, generator=gen).requires_grad_()
    w = torch.randn(dim, k, generator=gen).requires_grad_()
    bb = torch.randn(dim, generator=gen).requires_grad_() if bias else None
    seq_idx = docs_to_seq_idx(b, length, cuts)[1] if cuts else None
    out = causal_conv1d(x, w, bb, activation=activation, seq_idx=seq_idx, backend="triton")
    ref = reference_conv1d(x, w, bb, activation=activation, seq_idx=seq_idx)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    gy = torch.randn(out.shape, generator=gen)
    leaves = [t for t in (x, w, bb) if t is not None]
    grads = torch.autograd.grad((out * gy).sum(), leaves)
    ref_grads = torch.autograd.grad((ref * gy).sum(), leaves)
    for mine, theirs in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-4)
    assert [len(calls) for calls in launched] == [1, 1]


@pytest.mark.gpu
def test_triton_causal_conv1d_on_cuda_equals_float64_reference(cuda_triton):
    from mcore.kernels.conv import reference_conv1d

    x = torch.randn(1, 4096, 1280, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(1280, 4, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    seq_idx = (torch.arange(4096, device="cuda") >= 1000).to(torch.int32)[None]
    out = causal_conv1d(x, w, None, seq_idx=seq_idx)
    ref = reference_conv1d(x.double(), w.double(), None, seq_idx=seq_idx)
    torch.testing.assert_close(out.double(), ref, rtol=2e-2, atol=2e-2)
    dx, dw = torch.autograd.grad(out.float().sum(), [x, w])
    rdx, rdw = torch.autograd.grad(ref.sum(), [x, w])
    torch.testing.assert_close(dx.double(), rdx.double(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(dw.double(), rdw.double(), rtol=2e-2, atol=2e-2 * rdw.abs().max().item())
