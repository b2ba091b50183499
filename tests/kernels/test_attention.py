"""attention: every backend against an independent float64 reference, which is itself checked against HF code."""

import importlib
import math
import types

import pytest
import torch

from mcore.kernels import attention

# The module itself, by its import path: the package attribute of the same name is the function.
attn_module = importlib.import_module("mcore.kernels.attention")
torch_backends = importlib.import_module("mcore.kernels.attention_torch")

B, S, HQ, D = 2, 24, 4, 16
CU_SEQLENS = [0, 7, 24, 31, 40, 48]  # 5 documents over B * S = 48 tokens, a boundary at S = 24

CASES = {
    "causal_mha": dict(n_kv=4, causal=True),
    "causal_gqa": dict(n_kv=2, causal=True),
    "full_mqa": dict(n_kv=1, causal=False),
    "window": dict(n_kv=2, causal=True, window_size=5),
    "documents": dict(n_kv=2, causal=True, cu_seqlens=CU_SEQLENS),
    "documents_bidirectional": dict(n_kv=1, causal=False, cu_seqlens=CU_SEQLENS),
    "sinks": dict(n_kv=2, causal=True, sinks=True),
    "window_documents_sinks": dict(n_kv=2, causal=True, window_size=4, cu_seqlens=CU_SEQLENS, sinks=True),
    "scale_sinks_full": dict(n_kv=4, causal=False, sinks=True, softmax_scale=0.37),
}


def _allowed(b, s, *, causal, window_size, cu_seqlens):
    """[b, s, s] bool: the visibility rule, with each token's document read off the boundary list."""
    doc_of = torch.zeros(b * s, dtype=torch.long)
    if cu_seqlens is not None:
        for d, (lo, hi) in enumerate(zip(cu_seqlens, cu_seqlens[1:])):
            doc_of[lo:hi] = d
    doc_of = doc_of.view(b, s)
    i = torch.arange(s).view(1, s, 1)
    j = torch.arange(s).view(1, 1, s)
    allowed = doc_of[:, :, None] == doc_of[:, None, :]
    if causal:
        allowed = allowed & (j <= i)
    if window_size is not None:
        allowed = allowed & (j > i - window_size)
    return allowed


def attention_float64(q, k, v, *, causal=True, softmax_scale=None, window_size=None, cu_seqlens=None, sinks=None):
    """Head-by-head float64 attention with an explicit sink column; differentiable."""
    q, k, v = q.double(), k.double(), v.double()
    b, s, n_heads, head_dim = q.shape
    group = n_heads // k.shape[2]
    scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale
    allowed = _allowed(b, s, causal=causal, window_size=window_size, cu_seqlens=cu_seqlens).to(q.device)
    heads = []
    for h in range(n_heads):
        kh, vh = k[:, :, h // group], v[:, :, h // group]
        scores = (q[:, :, h] @ kh.transpose(1, 2)) * scale
        scores = scores.masked_fill(~allowed, float("-inf"))
        if sinks is not None:
            scores = torch.cat([scores, sinks[h].double().expand(b, s, 1)], dim=-1)
        weights = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
        probs = weights / weights.sum(dim=-1, keepdim=True)
        heads.append(probs[..., :s] @ vh)
    return torch.stack(heads, dim=2)


def _inputs(case, dtype=torch.float32, device="cpu", layout="bshd", b=B, s=S):
    n_kv = case["n_kv"]

    def make(heads):
        if layout == "sbhd":  # what the models pass: [s, b, h, d] storage viewed as [b, s, h, d]
            return torch.randn(s, b, heads, D, device=device).to(dtype).transpose(0, 1)
        return torch.randn(b, s, heads, D, device=device).to(dtype)

    q, k, v = make(HQ), make(n_kv), make(n_kv)
    kwargs = {key: case[key] for key in ("causal", "window_size", "softmax_scale") if key in case}
    if "cu_seqlens" in case:
        kwargs["cu_seqlens"] = torch.tensor(case["cu_seqlens"], dtype=torch.int32, device=device)
    if case.get("sinks"):
        kwargs["sinks"] = torch.randn(HQ, device=device)
    return q, k, v, kwargs


def _float64_kwargs(kwargs):
    out = dict(kwargs)
    if "cu_seqlens" in out:
        out["cu_seqlens"] = out["cu_seqlens"].tolist()
    return out


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _supported(backend, case):
    return not (backend == "sdpa" and case.get("sinks"))


@pytest.mark.parametrize("layout", ["bshd", "sbhd"])
@pytest.mark.parametrize("backend", ["reference", "sdpa", "flex"])
@pytest.mark.parametrize("case_name", list(CASES))
def test_forward_backward_vs_float64(case_name, backend, layout):
    case = CASES[case_name]
    if not _supported(backend, case):
        pytest.skip("sdpa cannot express sinks (its ValueError is tested in test_bad_input)")
    q, k, v, kwargs = _inputs(case, layout=layout)
    expected_inputs = [t.detach().double().requires_grad_() for t in (q, k, v)]
    sinks64 = kwargs["sinks"].double().requires_grad_() if "sinks" in kwargs else None
    expected = attention_float64(*expected_inputs, **{**_float64_kwargs(kwargs), "sinks": sinks64})
    grad_out = torch.randn_like(expected)

    if backend == "flex":  # torch's FlexAttention has no CPU backward: forward only here
        with torch.no_grad():
            out = attention(q, k, v, backend=backend, **kwargs)
        assert out.shape == (B, S, HQ, D) and out.dtype == q.dtype
        assert _rel(out, expected) < 1e-5
        return

    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    if "sinks" in kwargs:
        kwargs["sinks"].requires_grad_()
    out = attention(*leaves, backend=backend, **kwargs)
    assert out.shape == (B, S, HQ, D) and out.dtype == q.dtype
    assert _rel(out, expected) < 1e-5
    out.backward(grad_out.to(out.dtype))
    expected.backward(grad_out)
    for name, got, want in zip("qkv", leaves, expected_inputs):
        assert _rel(got.grad, want.grad) < 1e-5, name
    if sinks64 is not None:
        assert _rel(kwargs["sinks"].grad, sinks64.grad) < 1e-5


@pytest.mark.parametrize("backend", ["reference", "sdpa", "flex"])
@pytest.mark.parametrize("case_name", ["causal_gqa", "window", "window_documents_sinks"])
def test_bf16_forward(case_name, backend):
    case = CASES[case_name]
    if not _supported(backend, case):
        pytest.skip("sdpa cannot express sinks")
    q, k, v, kwargs = _inputs(case, dtype=torch.bfloat16, layout="sbhd")
    expected = attention_float64(q, k, v, **_float64_kwargs(kwargs))
    with torch.no_grad():
        out = attention(q, k, v, backend=backend, **kwargs)
    assert out.dtype == torch.bfloat16
    assert _rel(out, expected) < 1.5e-2


def _hf_mask(b, s, *, window_size, cu_seqlens):
    """Additive [b, 1, s, s] mask from transformers' own mask functions (positions restart per document)."""
    from transformers import masking_utils as mu

    fn = mu.causal_mask_function
    if window_size is not None:
        fn = mu.sliding_window_causal_mask_function(window_size)
    if cu_seqlens is not None:
        position_ids = torch.zeros(b * s, dtype=torch.long)
        for lo, hi in zip(cu_seqlens, cu_seqlens[1:]):
            position_ids[lo:hi] = torch.arange(hi - lo)
        packed = mu.find_packed_sequence_indices(position_ids.view(b, s))
        fn = mu.and_masks(fn, mu.packed_sequence_mask_function(packed))
    idx = torch.arange(s)
    allowed = fn(torch.arange(b)[:, None, None], torch.tensor(0), idx[None, :, None], idx[None, None, :])
    allowed = allowed.expand(b, s, s)
    return torch.zeros(b, 1, s, s, dtype=torch.float64).masked_fill(~allowed[:, None], torch.finfo(torch.float64).min)


@pytest.mark.parametrize(
    "window_size,cu_seqlens,with_sinks",
    [(None, None, False), (3, None, False), (None, [0, 4, 9, 10, 15, 20], False), (3, [0, 4, 10, 13, 20], True)],
)
def test_float64_reference_matches_hf_eager_attention(window_size, cu_seqlens, with_sinks):
    """The test's float64 reference equals Llama's / GPT-OSS's eager attention with HF-built masks."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward as gpt_oss_eager
    from transformers.models.llama.modeling_llama import eager_attention_forward as llama_eager

    b, s, n_heads, n_kv, head_dim = 2, 10, 4, 2, 8
    q = torch.randn(b, s, n_heads, head_dim, dtype=torch.float64)
    k = torch.randn(b, s, n_kv, head_dim, dtype=torch.float64)
    v = torch.randn(b, s, n_kv, head_dim, dtype=torch.float64)
    sinks = torch.randn(n_heads, dtype=torch.float64) if with_sinks else None
    module = types.SimpleNamespace(num_key_value_groups=n_heads // n_kv, training=False, sinks=sinks)
    mask = _hf_mask(b, s, window_size=window_size, cu_seqlens=cu_seqlens)
    eager = gpt_oss_eager if with_sinks else llama_eager
    hf_out, _ = eager(module, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, head_dim**-0.5)
    ours = attention_float64(q, k, v, window_size=window_size, cu_seqlens=cu_seqlens, sinks=sinks)
    # Llama's eager softmax runs in fp32 whatever the input dtype.
    torch.testing.assert_close(ours, hf_out, rtol=1e-6, atol=1e-6)
    lib = attention(
        q,
        k,
        v,
        window_size=window_size,
        sinks=sinks,
        backend="reference",
        cu_seqlens=None if cu_seqlens is None else torch.tensor(cu_seqlens, dtype=torch.int32),
    )
    torch.testing.assert_close(lib, ours, rtol=1e-12, atol=1e-12)


LONG_CASES = {  # several 128-token flex blocks, a ragged last block, documents crossing block boundaries
    "causal": dict(s=300, causal=True),
    "window": dict(s=300, causal=True, window_size=100),
    "documents": dict(s=300, causal=True, cu_seqlens=[0, 50, 130, 300, 301, 460, 600]),
    "documents_bidirectional": dict(s=300, causal=False, cu_seqlens=[0, 128, 300, 428, 600]),
    "aligned_documents_window": dict(s=512, causal=True, window_size=200, cu_seqlens=[0, 256, 512, 640, 1024]),
}


@pytest.mark.parametrize("case_name", list(LONG_CASES))
def test_flex_block_mask_classification(case_name):
    """Every block holding an allowed pair is visited; a block skipped by the mask function is all allowed."""
    case = LONG_CASES[case_name]
    s, cu = case["s"], case.get("cu_seqlens")
    b = 1 if cu is None else cu[-1] // s
    doc_ids = None if cu is None else torch_backends._document_ids(torch.tensor(cu, dtype=torch.int32), b, s)
    window_size = case.get("window_size")
    mask = torch_backends._flex_block_mask(b, s, case["causal"], window_size, cu, doc_ids, torch.device("cpu"))
    dense = _allowed(b, s, causal=case["causal"], window_size=case.get("window_size"), cu_seqlens=cu)
    n_blocks = -(-s // 128)
    padded = torch.zeros(b, n_blocks * 128, n_blocks * 128, dtype=torch.bool)
    padded[:, :s, :s] = dense
    blocks = padded.view(b, n_blocks, 128, n_blocks, 128)
    any_allowed = blocks.any(dim=(2, 4))
    all_allowed = blocks.all(dim=(2, 4))
    listed = torch.zeros(b, n_blocks, n_blocks, dtype=torch.int32)
    for num, idx, kind in (
        (mask.kv_num_blocks, mask.kv_indices, 1),
        (mask.full_kv_num_blocks, mask.full_kv_indices, 2),
    ):
        for r in range(b):
            for qb in range(n_blocks):
                for kb in idx[r, 0, qb, : num[r, 0, qb]].tolist():
                    assert listed[r, qb, kb] == 0, "a block listed twice"
                    listed[r, qb, kb] = kind
    assert ((listed > 0) >= any_allowed).all(), "a block with allowed pairs is skipped"
    assert ((listed == 2) <= all_allowed).all(), "a block run without the mask function holds masked pairs"
    assert (listed == 2).any() or not all_allowed.any()  # full blocks are recognised where they exist


@pytest.mark.parametrize("case_name", list(LONG_CASES))
def test_flex_forward_long(case_name):
    case = dict(LONG_CASES[case_name])
    s, cu = case.pop("s"), case.pop("cu_seqlens", None)
    b = 1 if cu is None else cu[-1] // s
    q, k, v = torch.randn(b, s, 4, 16), torch.randn(b, s, 2, 16), torch.randn(b, s, 2, 16)
    if cu is not None:
        case["cu_seqlens"] = torch.tensor(cu, dtype=torch.int32)
    with torch.no_grad():
        out = attention(q, k, v, backend="flex", **case)
    expected = attention_float64(q, k, v, **_float64_kwargs(case))
    assert _rel(out, expected) < 1e-5


def test_default_backend_choice_on_cpu(monkeypatch):
    monkeypatch.delenv("MCORE_KERNELS_BACKEND", raising=False)
    q, k, v, _ = _inputs(CASES["causal_gqa"])
    sinks = torch.randn(HQ)
    select = attn_module._select_backend
    assert select(q, k, v, None, None, plain=True) == "sdpa"
    assert select(q, k, v, None, None, plain=False) == "reference"
    assert select(q, k, v, sinks, None, plain=True) == "reference"
    assert select(q, k, v, None, None, plain=True, return_lse=True) == "reference"  # sdpa cannot return it
    assert select(q, k, v, None, "triton", plain=True) == "triton"  # the interpreter runs it on CPU tensors
    assert select(q, k, v, None, "flex", plain=True) == "flex"
    monkeypatch.setenv("MCORE_KERNELS_BACKEND", "reference")
    assert select(q, k, v, None, None, plain=True) == "reference"


def test_default_backend_matches_reference_on_every_case():
    for name, case in CASES.items():
        q, k, v, kwargs = _inputs(case)
        torch.testing.assert_close(
            attention(q, k, v, **kwargs), attention(q, k, v, backend="reference", **kwargs), msg=name
        )


def _bad_calls():
    q = torch.randn(2, 8, 4, 16)
    k = torch.randn(2, 8, 2, 16)
    v = torch.randn(2, 8, 2, 16)
    cu = lambda *xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
    return [
        ((q[0], k, v), {}, ValueError, r"q must be 4-D \[b, s, heads, head_dim\], got shape \(8, 4, 16\)"),
        ((q, k.double(), v), {}, TypeError, r"share a dtype, got torch.float32, torch.float64"),
        ((q.int(), k.int(), v.int()), {}, TypeError, r"q dtype must be one of"),
        ((q, k.to("meta"), v), {}, ValueError, r"one device"),
        ((q, torch.randn(2, 8, 3, 16), torch.randn(2, 8, 3, 16)), {}, ValueError, r"query heads \(4\) .* \(3\)"),
        ((q, k[..., :8], v[..., :8]), {}, ValueError, r"head dims differ: q has 16, k/v have 8"),
        ((q, k, v[:, :4]), {}, ValueError, r"k and v must agree on \[b, s_k, heads\]"),
        ((q, k[:1], v[:1]), {}, ValueError, r"batch sizes differ: q has 2, k/v have 1"),
        ((q, k[:, :5], v[:, :5]), {}, ValueError, r"causal attention needs as many keys as queries, got s=8 and s_k=5"),
        (("q", k, v), {}, TypeError, r"q must be a tensor, got str"),
        ((q, k, v), {"causal": 1}, TypeError, r"causal must be a bool"),
        ((q, k, v), {"window_size": 0}, ValueError, r"window_size must be None or an int >= 1, got 0"),
        ((q, k, v), {"window_size": 4, "causal": False}, ValueError, r"pass causal=True"),
        ((q, k, v), {"softmax_scale": -0.1}, ValueError, r"softmax_scale must be None or a finite float > 0"),
        ((q, k, v), {"cu_seqlens": torch.tensor([0, 8, 16])}, TypeError, r"cu_seqlens must be int32, got torch.int64"),
        ((q, k, v), {"cu_seqlens": [0, 8, 16]}, TypeError, r"cu_seqlens must be an int32 tensor, got list"),
        ((q, k, v), {"cu_seqlens": cu(0, 8, 16)[None]}, ValueError, r"1-D \[n_docs \+ 1\]"),
        ((q, k, v), {"cu_seqlens": cu(1, 8, 16)}, ValueError, r"from 0 to b \* s = 16, got first 1 and last 16"),
        ((q, k, v), {"cu_seqlens": cu(0, 8, 12)}, ValueError, r"got first 0 and last 12"),
        ((q, k, v), {"cu_seqlens": cu(0, 5, 16)}, ValueError, r"boundary at every multiple of s = 8.*missing \[8\]"),
        ((q, k, v), {"cu_seqlens": cu(0, 8, 6, 16)}, ValueError, r"non-decreasing"),
        ((q, k, v), {"cu_seqlens": cu(0, 8, 16).to("meta")}, ValueError, r"on the CPU or on cpu with q, got meta"),
        ((q, k, v), {"cu_seqlens": cu(0, 3, 8, 16), "max_seqlen": 4}, ValueError, r"longest document \(8 tokens\)"),
        ((q, k, v), {"max_seqlen": 7}, ValueError, r"longest document \(8 tokens\), got 7"),
        ((q, k, v), {"sinks": torch.randn(2)}, ValueError, r"sinks must have shape \[Hq\] = \[4\], got \(2,\)"),
        ((q, k, v), {"sinks": torch.ones(4, dtype=torch.long)}, TypeError, r"sinks must be floating point"),
        ((q, k, v), {"sinks": torch.randn(4), "backend": "sdpa"}, ValueError, r"sdpa backend cannot add sinks"),
        ((q, k, v), {"return_lse": True, "backend": "sdpa"}, ValueError, r"sdpa backend cannot return the log-sum"),
        ((q, k, v), {"return_lse": 1}, TypeError, r"return_lse must be a bool, got 1"),
        ((q, k, v), {"deterministic": None}, TypeError, r"deterministic must be a bool, got None"),
        ((q, k, v), {"backend": "cudnn"}, ValueError, r"unknown backend 'cudnn'"),
        ((q.requires_grad_(), k, v), {"backend": "flex"}, ValueError, r"flex backend has no backward on cpu"),
    ]


@pytest.mark.parametrize("args,kwargs,error,match", _bad_calls())
def test_bad_input(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        attention(*args, **kwargs)


def test_cross_attention_without_masks():
    q = torch.randn(2, 5, 4, 16)
    k, v = torch.randn(2, 9, 2, 16), torch.randn(2, 9, 2, 16)
    # The float64 helper builds square masks; with s != s_k and no mask a direct softmax is the reference.
    qg = q.double().view(2, 5, 2, 2, 16)
    probs = torch.softmax(torch.einsum("bqhgd,bkhd->bhgqk", qg, k.double()) / 4.0, dim=-1)
    want = torch.einsum("bhgqk,bkhd->bqhgd", probs, v.double()).reshape(2, 5, 4, 16)
    for backend in ("reference", "sdpa"):
        assert _rel(attention(q, k, v, causal=False, backend=backend), want) < 1e-5


# ---------------------------------------------------------------------------------------------- CUDA


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["default", "sdpa", "flex", "reference", "triton"])
@pytest.mark.parametrize("case_name", ["causal_gqa", "window", "documents", "sinks", "window_documents_sinks"])
def test_gpu_bf16_forward_backward(case_name, backend):
    case = CASES[case_name]
    if not _supported(backend, case):
        pytest.skip("sdpa cannot express sinks")
    q, k, v, kwargs = _inputs(case, dtype=torch.bfloat16, device="cuda", layout="sbhd")
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    expected_inputs = [t.detach().double().cpu().requires_grad_() for t in (q, k, v)]
    sinks64 = kwargs["sinks"].double().cpu().requires_grad_() if "sinks" in kwargs else None
    if "sinks" in kwargs:
        kwargs["sinks"].requires_grad_()
    expected = attention_float64(*expected_inputs, **{**_float64_kwargs(kwargs), "sinks": sinks64})
    out = attention(*leaves, backend=None if backend == "default" else backend, **kwargs)
    assert _rel(out.cpu(), expected) < 1.5e-2
    grad_out = torch.randn_like(expected)
    out.backward(grad_out.to(device="cuda", dtype=out.dtype))
    expected.backward(grad_out)
    for name, got, want in zip("qkv", leaves, expected_inputs):
        assert _rel(got.grad.cpu(), want.grad) < 3e-2, name
    if sinks64 is not None:
        assert _rel(kwargs["sinks"].grad.cpu(), sinks64.grad) < 3e-2


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["flex", "sdpa", "triton"])
@pytest.mark.parametrize("case_name", list(LONG_CASES))
def test_gpu_long_sequences_forward_backward(case_name, backend):
    """Multi-block masks on the device, where FlexAttention skips the blocks the BlockMask leaves out."""
    case = dict(LONG_CASES[case_name])
    s, cu = case.pop("s"), case.pop("cu_seqlens", None)
    b = 1 if cu is None else cu[-1] // s
    leaves = [torch.randn(b, s, h, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for h in (8, 2, 2)]
    expected_inputs = [t.detach().double().cpu().requires_grad_() for t in leaves]
    expected = attention_float64(*expected_inputs, **{**case, "cu_seqlens": cu})
    if cu is not None:  # on the CPU (no sync) for one case, on the device for the others
        host = case_name == "documents"
        case["cu_seqlens"] = torch.tensor(cu, dtype=torch.int32, device="cpu" if host else "cuda")
    out = attention(*leaves, backend=backend, **case)
    assert _rel(out.cpu(), expected) < 1.5e-2
    grad_out = torch.randn_like(expected)
    out.backward(grad_out.to(device="cuda", dtype=out.dtype))
    expected.backward(grad_out)
    for name, got, want in zip("qkv", leaves, expected_inputs):
        assert _rel(got.grad.cpu(), want.grad) < 3e-2, name


@pytest.mark.gpu
def test_gpu_default_backend_choice(monkeypatch):
    monkeypatch.delenv("MCORE_KERNELS_BACKEND", raising=False)
    q, k, v, _ = _inputs(CASES["causal_gqa"], dtype=torch.bfloat16, device="cuda")
    select = attn_module._select_backend
    assert select(q, k, v, None, None, plain=True) == "sdpa"
    assert select(q, k, v, None, None, plain=False) == "triton"
    assert select(q, k, v, None, None, plain=True, return_lse=True) == "triton"
    assert select(q, k, v, torch.randn(HQ, device="cuda"), None, plain=False) == "triton"
    assert select(q.float(), k.float(), v.float(), None, None, plain=False) == "flex"
