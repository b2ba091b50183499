"""Our Triton flash attention (interpreter on CPU, compiled on CUDA) against a float64 reference: every
feature, forward, LSE and gradients (sinks included), plus the layout building blocks of ring attention."""

import math

import pytest
import torch

from mcore.kernels import attention
from mcore.kernels.attention_blocks import layout_attention, layout_backward, layout_forward, merge_partials
from mcore.kernels.attention_layout import AttentionLayout
from mcore.kernels.triton.flash_schedule import build_blocks

CU = [0, 7, 40, 45, 57, 80]  # 5 documents over 2 rows of 40, crossing 16-token blocks, a boundary at 40
# Documents of at most 16 tokens (the interpreter's key block; x8 on the GPU: at most 128): dQ is stored by the
# dK/dV kernel, the dQ kernel does not run.
SHORT_CU = [0, 7, 16, 20, 32, 40, 45, 57, 64, 80]

CASES = {
    "causal_mha": dict(s=40, n_kv=4),
    "causal_gqa_sbhd": dict(s=40, n_kv=2, layout="sbhd"),
    "full_mqa": dict(s=24, n_kv=1, causal=False),
    "window": dict(s=40, n_kv=2, window_size=5),
    "long_window": dict(s=64, n_kv=2, window_size=40),
    "documents": dict(s=40, n_kv=1, cu_seqlens=CU),
    "documents_bidirectional": dict(s=40, n_kv=2, causal=False, cu_seqlens=CU),
    "sinks": dict(s=24, n_kv=2, sinks=True),
    "window_documents_sinks": dict(s=40, n_kv=2, window_size=6, cu_seqlens=CU, sinks=True, softmax_scale=0.3),
    "mla_head_dims": dict(s=40, n_kv=4, d_qk=24, d_v=16, cu_seqlens=CU),
    "short_documents": dict(s=40, n_kv=2, cu_seqlens=SHORT_CU),
    "short_documents_window_sinks": dict(s=40, n_kv=1, window_size=5, cu_seqlens=SHORT_CU, sinks=True),
    "short_documents_bidirectional_mla": dict(s=40, n_kv=2, causal=False, d_qk=24, d_v=16, cu_seqlens=SHORT_CU),
}


def allowed_float64(b, s, s_k, *, causal=True, window_size=None, cu_seqlens=None):
    """[b, s, s_k] visibility from the token positions and documents, written without the library's code."""
    doc = torch.zeros(b * s, dtype=torch.long)
    pos = torch.arange(b * s) % s
    for d, (lo, hi) in enumerate(zip(cu_seqlens or [0, b * s], (cu_seqlens or [0, b * s])[1:])):
        doc[lo:hi] = d if cu_seqlens else torch.arange(lo, hi) // s
    doc_q, pos_q = doc.view(b, s), pos.view(b, s)
    doc_k, pos_k = (doc_q, pos_q) if s_k == s else (torch.zeros(b, s_k, dtype=torch.long), torch.arange(s_k)[None])
    allowed = doc_q[:, :, None] == doc_k[:, None, :]
    if causal:
        allowed &= pos_k[:, None, :] <= pos_q[:, :, None]
    if window_size is not None:
        allowed &= pos_k[:, None, :] > pos_q[:, :, None] - window_size
    return allowed


def dense_float64(q, k, v, allowed, scale, sinks=None):
    """(out, lse) in float64 head by head from a boolean [b, s, s_k] mask; rows seeing nothing give (0, -inf)."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[2] // k.shape[2]
    outs, lses = [], []
    for h in range(q.shape[2]):
        scores = (q[:, :, h] @ k[:, :, h // group].transpose(1, 2)) * scale
        scores = scores.masked_fill(~allowed, float("-inf"))
        if sinks is not None:
            scores = torch.cat([scores, sinks[h].double().expand(*scores.shape[:2], 1)], dim=-1)
        lse = torch.logsumexp(scores, dim=-1)
        probs = torch.exp(scores - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
        outs.append(probs[..., : k.shape[1]] @ v[:, :, h // group])
        lses.append(lse)
    return torch.stack(outs, dim=2), torch.stack(lses, dim=2)


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _make(b, s, heads, d, layout="bshd", dtype=torch.float32, device="cpu"):
    if layout == "sbhd":
        return torch.randn(s, b, heads, d, device=device).to(dtype).transpose(0, 1)
    return torch.randn(b, s, heads, d, device=device).to(dtype)


def _run_case(case, device, dtype, deterministic, with_lse_grad):
    s, n_kv, hq = case["s"], case["n_kv"], 4
    cu = case.get("cu_seqlens")
    b = 2 if cu is None else cu[-1] // s
    d_qk, d_v = case.get("d_qk", 16), case.get("d_v", 16)
    lay = case.get("layout", "bshd")
    q, k = _make(b, s, hq, d_qk, lay, dtype, device), _make(b, s, n_kv, d_qk, lay, dtype, device)
    v = _make(b, s, n_kv, d_v, lay, dtype, device)
    kwargs = {key: case[key] for key in ("causal", "window_size", "softmax_scale") if key in case}
    if cu is not None:
        kwargs["cu_seqlens"] = torch.tensor(cu, dtype=torch.int32)
    sinks = torch.randn(hq, device=device) if case.get("sinks") else None
    leaves = [t.detach().requires_grad_() for t in (q, k, v)] + ([sinks.requires_grad_()] if sinks is not None else [])
    out, lse = attention(
        *leaves[:3], sinks=sinks, return_lse=True, deterministic=deterministic, backend="triton", **kwargs
    )
    ref_leaves = [t.detach().double().cpu().requires_grad_() for t in leaves]
    allowed = allowed_float64(
        b, s, s, causal=case.get("causal", True), window_size=case.get("window_size"), cu_seqlens=cu
    )
    scale = case.get("softmax_scale", 1 / math.sqrt(d_qk))
    ref_out, ref_lse = dense_float64(*ref_leaves[:3], allowed, scale, ref_leaves[3] if sinks is not None else None)
    grad_out, grad_lse = torch.randn_like(ref_out), torch.randn_like(ref_lse)
    loss = (out.double().cpu() * grad_out).sum() + ((lse.double().cpu() * grad_lse).sum() if with_lse_grad else 0)
    ref_loss = (ref_out * grad_out).sum() + ((ref_lse * grad_lse).sum() if with_lse_grad else 0)
    loss.backward()
    ref_loss.backward()
    return out, lse, ref_out, ref_lse, leaves, ref_leaves


@pytest.mark.parametrize("case_name", list(CASES))
def test_triton_vs_float64(case_name, interpreter):
    case = CASES[case_name]
    deterministic = case_name in ("causal_mha", "window_documents_sinks", "mla_head_dims")
    with_lse_grad = case_name in ("documents", "window_documents_sinks", "full_mqa")
    out, lse, ref_out, ref_lse, leaves, ref_leaves = _run_case(
        case, interpreter, torch.float32, deterministic, with_lse_grad
    )
    assert out.shape == ref_out.shape and lse.dtype == torch.float32
    assert _rel(out, ref_out) < 1e-5
    assert _rel(lse, ref_lse) < 1e-6
    for name, got, want in zip(["q", "k", "v", "sinks"], leaves, ref_leaves):
        assert _rel(got.grad, want.grad) < 1e-5, name


@pytest.mark.parametrize("deterministic", [True, False])
def test_short_documents_store_dq_in_the_kv_kernel(deterministic, interpreter, spy, forbid):
    """Every document fits in one key block: the dK/dV kernel writes dQ (no dQ kernel, no atomics)."""
    from mcore.kernels.triton.flash_backward_kernels import DQ_STORE

    calls = spy("mcore.kernels.triton.flash_backward", "launch_kv")
    forbid("mcore.kernels.triton.flash_backward", "launch_dq")
    case = CASES["short_documents_window_sinks"]
    out, lse, ref_out, ref_lse, leaves, ref_leaves = _run_case(case, interpreter, torch.float32, deterministic, True)
    assert [call[0][-1] for call in calls] == [DQ_STORE]
    for name, got, want in zip(["q", "k", "v", "sinks"], leaves, ref_leaves):
        assert _rel(got.grad, want.grad) < 1e-5, name


@pytest.mark.parametrize("case_name", ["window_documents_sinks", "short_documents_window_sinks"])
def test_packed_gqa_heads(case_name, interpreter, monkeypatch):
    """Tiles whose rows are (query, head) pairs of a GQA group (groups of 2 and 4 here; the second case also
    stores dQ from the dK/dV kernel) give the same outputs, LSE and gradients as one head per tile."""
    from mcore.kernels.triton import flash_attention as fa
    from mcore.kernels.triton import flash_backward as fb

    config = fb.FlashConfig(16, 16, 1, 1, True, True)
    assert fb.gqa_pack(config, 4, 16) == 4 and fb.gqa_pack(config, 3, 16) == 1 and fb.gqa_pack(config, 32, 16) == 1
    monkeypatch.setattr(fa, "forward_config", lambda *args: config)
    monkeypatch.setattr(fb, "backward_configs", lambda *args: (config, config))
    for deterministic in (True, False):
        out, lse, ref_out, ref_lse, leaves, ref_leaves = _run_case(
            CASES[case_name], interpreter, torch.float32, deterministic, True
        )
        assert _rel(out, ref_out) < 1e-5 and _rel(lse, ref_lse) < 1e-6
        for name, got, want in zip(["q", "k", "v", "sinks"], leaves, ref_leaves):
            assert _rel(got.grad, want.grad) < 1e-5, (name, deterministic)


def test_fused_dq_needs_one_key_block_per_query():
    from mcore.kernels.triton.flash_configs import fused_dq_possible

    short = AttentionLayout.from_documents(2, 40, 40, causal=True, bounds=SHORT_CU)
    assert fused_dq_possible(short, 16) and not fused_dq_possible(short, 8)  # a 12-token document needs 16
    assert not fused_dq_possible(AttentionLayout.from_documents(2, 40, 40, causal=True, bounds=CU), 16)
    assert fused_dq_possible(AttentionLayout.from_documents(2, 16, 16, causal=False), 16)
    *_, ring = _ring_layouts()  # queries paired with two key segments, positions shifted: not fusable
    assert not fused_dq_possible(ring, 64)
    cross = AttentionLayout(1, 8, 12, False, None, ((0, 0, 8, 0, 0, 12, 0),))
    assert not fused_dq_possible(cross, 16)


def test_table_keys_by_head_dim_and_visible_span():
    from mcore.kernels.triton.flash_configs import _TABLE, kernel_configs, longest_key_span

    docs = AttentionLayout.from_documents(1, 16384, 16384, causal=True, bounds=docs_bounds(4096))
    window = AttentionLayout.from_documents(1, 16384, 16384, causal=True, window_size=128, bounds=docs_bounds(4096))
    assert longest_key_span(docs) == 4096 and longest_key_span(window) == 128
    assert kernel_configs(128, 128, 4096, False) == _TABLE[(128, None)]
    assert kernel_configs(128, 128, 128, False) == _TABLE[(128, 128)]
    assert kernel_configs(64, 64, 512, False) == _TABLE[(64, 1024)]
    assert kernel_configs(192, 128, 16384, False) == _TABLE[(256, None)]


def test_set_entry_replaces_one_bucket():
    from mcore.kernels.triton.flash_configs import FlashConfig, KernelConfigs, kernel_configs, set_entry

    tiles = KernelConfigs(FlashConfig(32, 32, 2, 2), FlashConfig(128, 16, 4, 2), FlashConfig(64, 16, 4, 2))
    previous = set_entry(128, 128, 100, tiles)
    try:
        assert kernel_configs(128, 128, 128, False) == tiles and kernel_configs(128, 128, 129, False) != tiles
    finally:
        assert set_entry(128, 128, 128, previous) == tiles
    assert kernel_configs(128, 128, 128, False) == previous
    with pytest.raises(TypeError, match="set_entry: configs must be a KernelConfigs"):
        set_entry(128, 128, 128, tiles.kv)


def docs_bounds(length, tokens=16384):
    return list(range(0, tokens + 1, length))


def test_bad_tile_configs():
    from mcore.kernels.triton.flash_configs import FlashConfig

    with pytest.raises(ValueError, match=r"block_n must be a power of two >= 16, got 48"):
        FlashConfig(64, 48, 4, 2)
    with pytest.raises(ValueError, match=r"num_stages must be an int >= 1, got 0"):
        FlashConfig(64, 64, 4, 0)


def test_deterministic_backward_is_bitwise_repeatable(interpreter):
    case = CASES["window_documents_sinks"]
    grads = []
    for _ in range(2):
        torch.manual_seed(7)
        *_, leaves, _ = _run_case(case, interpreter, torch.float32, True, False)
        grads.append([t.grad.clone() for t in leaves])
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_cross_attention_triton(interpreter):
    q, k, v = torch.randn(2, 20, 4, 16), torch.randn(2, 33, 2, 16), torch.randn(2, 33, 2, 16)
    out = attention(q, k, v, causal=False, backend="triton")
    ref, _ = dense_float64(q, k, v, torch.ones(2, 20, 33, dtype=torch.bool), 0.25)
    assert _rel(out, ref) < 1e-5


def test_schedule_visits_only_document_tiles():
    """Each query block is paired with its own document's keys only, and blocks come heaviest first."""
    layout = AttentionLayout.from_documents(2, 40, 40, causal=True, bounds=CU)
    blocks, segments = build_blocks(layout, "q", 16)
    docs = [(lo // 40, lo % 40, hi - lo) for lo, hi in zip(CU, CU[1:])]
    assert sum(-(-n // 16) for _, _, n in docs) == blocks.shape[0]
    visible = []
    for row, start, rows, first, lo, hi in blocks.tolist():
        doc = next(d for d in docs if d[0] == row and d[1] <= start < d[1] + d[2])
        assert start + rows <= doc[1] + doc[2]
        assert segments[lo:hi].tolist() == [[doc[1], doc[2], 0]]
        visible.append(first + rows)  # keys 0..last visible under the causal rule
    assert visible == sorted(visible, reverse=True)


def _ring_layouts():
    """Two disjoint key sets of a CP-like step: queries at positions 8.. see an earlier chunk whole and
    their own chunk causally; queries 20..23 are in no pair (they see nothing)."""
    pairs_a = ((0, 0, 8, 8, 8, 8, 8), (1, 0, 12, 0, 0, 12, 0))  # own chunk: diagonal
    pairs_b = ((0, 0, 8, 8, 0, 8, 0), (0, 8, 12, 24, 0, 8, 0))  # earlier chunk: whole
    make = lambda pairs: AttentionLayout(2, 24, 16, True, 10, pairs)  # noqa: E731
    return make(pairs_a), make(pairs_b), make(pairs_a + pairs_b)


@pytest.mark.parametrize("backend", ["reference", "triton", pytest.param("triton-cuda", marks=pytest.mark.gpu)])
def test_layout_blocks_merge_and_backward_from_full_lse(backend, request):
    device = "cpu"
    if backend == "triton":
        request.getfixturevalue("interpreter")
    elif backend == "triton-cuda":  # the ring-attention blocks compiled: position offsets, rows in no pair
        device, backend = request.getfixturevalue("cuda_triton"), "triton"
    lay_a, lay_b, lay_all = _ring_layouts()
    q, k, v = (torch.randn(shape, device=device) for shape in ((2, 24, 4, 16), (2, 16, 2, 16), (2, 16, 2, 8)))
    sinks = torch.randn(4, device=device)
    out_a, lse_a = layout_forward(q, k, v, lay_a, 0.3, sinks, backend=backend)
    out_b, lse_b = layout_forward(q, k, v, lay_b, 0.3, None, backend=backend)
    out, lse = merge_partials(out_a, lse_a, out_b, lse_b)
    ref_leaves = [t.double().cpu().requires_grad_() for t in (q, k, v, sinks)]
    ref_out, ref_lse = dense_float64(*ref_leaves[:3], lay_all.dense_mask(), 0.3, ref_leaves[3])
    # Rows in no pair see only the sink: output 0, lse = sink.
    assert _rel(out.cpu(), ref_out) < 1e-5 and _rel(lse.cpu(), ref_lse) < 1e-6
    assert (out[0, 20:] == 0).all() and torch.allclose(lse[0, 20:], sinks.expand(4, 4))
    dout = torch.randn_like(ref_out)
    (ref_out * dout).sum().backward()
    out, dout_dev = out.to(q.dtype), dout.float().to(device)
    grads_a = layout_backward(q, k, v, out, lse, dout_dev, lay_a, 0.3, sinks, backend=backend)
    grads_b = layout_backward(q, k, v, out, lse, dout_dev, lay_b, 0.3, None, backend=backend)
    for i, name in enumerate("qkv"):
        assert _rel((grads_a[i] + grads_b[i]).cpu(), ref_leaves[i].grad) < 1e-5, name
    assert _rel(grads_a[3].cpu(), ref_leaves[3].grad) < 1e-5


def test_layout_attention_autograd_and_rows_in_no_pair():
    layout = AttentionLayout(1, 10, 10, False, None, ((0, 0, 6, 0, 2, 5, 0),))
    q, k, v = (torch.randn(1, 10, 2, 8, requires_grad=True) for _ in range(3))
    out, lse = layout_attention(q, k, v, layout, softmax_scale=0.5)
    assert (out[0, 6:] == 0).all() and torch.isneginf(lse[0, 6:]).all()
    allowed = torch.zeros(1, 10, 10, dtype=torch.bool)
    allowed[0, :6, 2:7] = True
    ref_out, ref_lse = dense_float64(q, k, v, allowed, 0.5)
    assert _rel(out, ref_out) < 1e-5 and _rel(lse[0, :6], ref_lse[0, :6]) < 1e-6
    (out.sum() + lse[0, :6].sum()).backward()
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = dense_float64(*leaves, allowed, 0.5)
    (ref_out.sum() + ref_lse[0, :6].sum()).backward()
    for got, want in zip((q, k, v), leaves):
        assert _rel(got.grad, want.grad) < 1e-5


def test_bad_layouts():
    with pytest.raises(ValueError, match=r"runs outside the 8 queries / 8 keys"):
        AttentionLayout(1, 8, 8, True, None, ((0, 4, 6, 0, 0, 4, 0),))
    with pytest.raises(ValueError, match=r"two different query segments overlap in row 0"):
        AttentionLayout(1, 8, 8, True, None, ((0, 0, 4, 0, 0, 4, 0), (0, 2, 4, 2, 4, 4, 4)))
    with pytest.raises(ValueError, match=r"window_size needs causal=True"):
        AttentionLayout(1, 8, 8, False, 3, ())
    layout = AttentionLayout.from_documents(1, 8, 8, causal=True)
    with pytest.raises(ValueError, match=r"layout is for batch 1, 8 queries and 8 keys, but q has shape \(1, 6"):
        layout_forward(torch.randn(1, 6, 2, 4), torch.randn(1, 6, 2, 4), torch.randn(1, 6, 2, 4), layout, 1.0)


# ---------------------------------------------------------------------------------------------- CUDA


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case_name", list(CASES))
def test_gpu_triton_vs_float64(case_name, dtype, cuda_triton):
    case = dict(CASES[case_name])
    case["s"] *= 8  # several 128-row blocks
    if "cu_seqlens" in case:
        case["cu_seqlens"] = [x * 8 for x in case["cu_seqlens"]]
    if "window_size" in case:
        case["window_size"] *= 8
    case.update(d_qk=192, d_v=128) if case_name == "mla_head_dims" else case.update(d_qk=128, d_v=128)
    for deterministic in (False, True):
        out, lse, ref_out, ref_lse, leaves, ref_leaves = _run_case(case, cuda_triton, dtype, deterministic, True)
        assert _rel(out.cpu(), ref_out) < 1.5e-2
        assert _rel(lse.cpu(), ref_lse) < 1e-3
        for name, got, want in zip(["q", "k", "v", "sinks"], leaves, ref_leaves):
            assert _rel(got.grad.cpu(), want.grad) < 3e-2, name


@pytest.mark.parametrize(
    "tiles,one_loop", [((32, 16), True), ((16, 32), True), ((32, 16), False)], ids=["tall", "wide", "three_loops"]
)
def test_unequal_tile_shapes(tiles, one_loop, interpreter, monkeypatch):
    """The GPU tiles differ between the two sides (128 x 64); the clipping of ranges must not assume squares.
    Both loop structures (one loop masking its edge blocks, or edge/interior/diagonal loops) give the same."""
    from mcore.kernels.triton import flash_attention as fa
    from mcore.kernels.triton import flash_backward as fb

    config = fa.FlashConfig(*tiles, 1, 1, one_loop)
    monkeypatch.setattr(fa, "forward_config", lambda *args: config)
    monkeypatch.setattr(fb, "backward_configs", lambda *args: (config, config))
    case = dict(CASES["window_documents_sinks"], s=40)
    for deterministic in (True, False):
        out, lse, ref_out, ref_lse, leaves, ref_leaves = _run_case(
            case, interpreter, torch.float32, deterministic, True
        )
        assert _rel(out, ref_out) < 1e-5 and _rel(lse, ref_lse) < 1e-6
        for name, got, want in zip(["q", "k", "v", "sinks"], leaves, ref_leaves):
            assert _rel(got.grad, want.grad) < 1e-5, (name, deterministic)


def _table_cases():
    from mcore.kernels.triton.flash_configs import _TABLE

    for dim, longest in _TABLE:
        d_qk, d_v = (192, 128) if dim == 256 else (dim, dim)
        length = {128: 128, 1024: 512}.get(longest, 1536)  # a document inside each length bucket
        yield pytest.param(d_qk, d_v, length, id=f"d{dim}-len{longest}")


@pytest.mark.gpu
@pytest.mark.parametrize("d_qk,d_v,length", list(_table_cases()))
def test_gpu_every_table_entry_against_float64(d_qk, d_v, length, cuda_triton):
    """Each default configuration of flash_configs compiles and is right on CUDA (bf16, documents, GQA)."""
    docs = 3072 // length if length < 1536 else 1
    case = dict(s=docs * length, n_kv=2, d_qk=d_qk, d_v=d_v)
    if docs > 1:
        case.update(s=length * 2, cu_seqlens=list(range(0, docs * length + 1, length)))
    out, lse, ref_out, ref_lse, leaves, ref_leaves = _run_case(case, cuda_triton, torch.bfloat16, True, True)
    assert _rel(out.cpu(), ref_out) < 1.5e-2 and _rel(lse.cpu(), ref_lse) < 1e-3
    for name, got, want in zip(["q", "k", "v"], leaves, ref_leaves):
        assert _rel(got.grad.cpu(), want.grad) < 3e-2, name


@pytest.mark.parametrize(
    "case_name,deterministic",
    [("window_documents_sinks", True), ("short_documents_window_sinks", False), ("mla_head_dims", True)],
    ids=["dq_kernel_first", "kv_kernel_stores_dq", "mla"],
)
def test_row_stats_computed_in_the_kernels(case_name, deterministic, interpreter, spy):
    """Without a preprocess pass (delta and lse2 from the dQ kernel, or in the dK/dV kernel that stores dQ)
    the gradients equal float64's (sinks' included, an lse gradient arriving) and the preprocess path's."""
    from mcore.kernels.triton import flash_backward as fb

    calls = spy("mcore.kernels.triton.flash_backward", "preprocess")
    torch.manual_seed(3)
    out, lse, ref_out, ref_lse, leaves, ref_leaves = _run_case(
        CASES[case_name], interpreter, torch.float32, deterministic, True
    )
    assert calls == []
    for name, got, want in zip(["q", "k", "v", "sinks"], leaves, ref_leaves):
        assert _rel(got.grad, want.grad) < 1e-5, name
    case = CASES[case_name]
    cu = case.get("cu_seqlens")
    layout = AttentionLayout.from_documents(
        cu[-1] // case["s"], case["s"], case["s"], causal=True, window_size=case.get("window_size"), bounds=cu
    )
    q, k, v = (t.detach() for t in leaves[:3])
    sinks = leaves[3].detach() if len(leaves) > 3 else None
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    scale = case.get("softmax_scale", q.shape[-1] ** -0.5)
    args = (q, k, v, out.detach(), lse.detach(), dout, layout, scale, sinks)
    fused = fb.flash_backward(*args, dlse=dlse, deterministic=deterministic)
    separate = fb.flash_backward(*args, dlse=dlse, deterministic=deterministic, fuse_stats=False)
    assert len(calls) == 1
    for got, want in zip(fused, separate):
        assert (got is None and want is None) or _rel(got, want) < 1e-6


def test_rows_in_no_pair_with_sinks_and_an_lse_gradient_keep_the_preprocess(interpreter, spy):
    """Rows that see only the sink get delta = -dlse from the preprocess pass; the fused kernels never visit
    them, so that case runs the pass (and its sinks' gradient is float64's)."""
    calls = spy("mcore.kernels.triton.flash_backward", "preprocess")
    lay_a, _, _ = _ring_layouts()
    q, k, v = torch.randn(2, 24, 4, 16), torch.randn(2, 16, 2, 16), torch.randn(2, 16, 2, 8)
    sinks = torch.randn(4)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    out, lse = layout_attention(*leaves[:3], lay_a, softmax_scale=0.3, sinks=leaves[3], backend="triton")
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    ((out * dout).sum() + (lse * dlse).sum()).backward()
    assert len(calls) == 1
    ref = [t.double().requires_grad_() for t in (q, k, v, sinks)]
    ref_out, ref_lse = dense_float64(*ref[:3], lay_a.dense_mask(), 0.3, ref[3])
    ((ref_out * dout.double()).sum() + (ref_lse * dlse.double()).sum()).backward()
    for got, want in zip(leaves, ref):
        assert _rel(got.grad, want.grad) < 1e-5
