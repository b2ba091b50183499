"""RoPE: tables against Hugging Face transformers, apply_rotary against HF's apply_rotary_pos_emb in float64,
the Triton kernel (interpreter) against the torch reference, forward and backward."""

from __future__ import annotations

import math

import pytest
import torch

from mcore.kernels import apply_rotary, rope_cos_sin, rope_inv_freq

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig  # noqa: E402
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb  # noqa: E402

TRITON_ROTARY = "mcore.kernels.triton.rotary"

# (head_dim, rope_theta, rope_scaling, max_position_embeddings), as found in real configs or close to them.
ROPE_CONFIGS = {
    "default": (64, 10000.0, None, 2048),
    "default_explicit": (128, 1e6, {"rope_type": "default"}, 32768),
    "linear": (32, 10000.0, {"rope_type": "linear", "factor": 2.0}, 4096),
    "linear_legacy_type_key": (48, 10000.0, {"type": "linear", "factor": 4}, 4096),
    "llama3": (
        128,
        500000.0,
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        131072,
    ),
    "llama3_original_from_max_positions": (
        64,
        500000.0,
        {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
        8192,
    ),
    "yarn_qwen_legacy": (128, 1e6, {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}, 131072),
    "yarn_deepseek_mscale": (
        64,
        10000.0,
        {
            "rope_type": "yarn",
            "factor": 40,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 0.707,
            "mscale_all_dim": 1.0,
        },
        163840,
    ),
    "yarn_no_truncate_explicit_attention_factor": (
        80,
        150000.0,
        {
            "rope_type": "yarn",
            "factor": 16.0,
            "original_max_position_embeddings": 4096,
            "truncate": False,
            "attention_factor": 0.8,
            "beta_fast": 16,
            "beta_slow": 2,
        },
        65536,
    ),
    "yarn_factor_from_max_positions": (
        64,
        10000.0,
        {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 4096},
        16384,
    ),
}


def _hf_config(head_dim, theta, scaling, max_positions) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=head_dim * 4,
        num_attention_heads=4,
        head_dim=head_dim,
        rope_theta=theta,
        rope_scaling=dict(scaling) if scaling is not None else None,  # HF edits the dict it is given
        max_position_embeddings=max_positions,
    )


def _hf_inv_freq(config: LlamaConfig) -> tuple[torch.Tensor, float]:
    rope_type = config.rope_parameters["rope_type"]
    if rope_type == "default":
        return LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    return ROPE_INIT_FUNCTIONS[rope_type](config)


# ---------------------------------------------------------------- tables vs transformers


@pytest.mark.parametrize("name", sorted(ROPE_CONFIGS))
def test_inv_freq_equals_transformers(name):
    head_dim, theta, scaling, max_positions = ROPE_CONFIGS[name]
    want, want_factor = _hf_inv_freq(_hf_config(head_dim, theta, scaling, max_positions))
    got, got_factor = rope_inv_freq(head_dim, theta, scaling, max_positions)
    assert got.dtype == torch.float32 and got.shape == (head_dim // 2,)
    assert torch.equal(got, want), (got - want).abs().max()
    assert math.isclose(got_factor, want_factor, rel_tol=1e-12)


def test_scaling_changes_the_frequencies():
    # Guards the comparison above against a vacuous pass: each scaled type differs from plain RoPE.
    for name in ("linear", "llama3", "yarn_qwen_legacy"):
        head_dim, theta, scaling, max_positions = ROPE_CONFIGS[name]
        scaled, _ = rope_inv_freq(head_dim, theta, scaling, max_positions)
        plain, _ = rope_inv_freq(head_dim, theta)
        assert not torch.allclose(scaled, plain), name


@pytest.mark.parametrize("name", ["default", "llama3", "yarn_deepseek_mscale"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cos_sin_equal_transformers(name, dtype):
    head_dim, theta, scaling, max_positions = ROPE_CONFIGS[name]
    config = _hf_config(head_dim, theta, scaling, max_positions)
    position_ids = torch.randint(0, max_positions, (3, 37))
    want_cos, want_sin = LlamaRotaryEmbedding(config)(torch.empty(1, dtype=dtype), position_ids)
    inv_freq, factor = rope_inv_freq(head_dim, theta, scaling, max_positions)
    cos, sin = rope_cos_sin(inv_freq, position_ids, factor, dtype=dtype)
    assert cos.shape == (3, 37, head_dim) and cos.dtype == dtype
    assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)


def test_cos_sin_layout_and_attention_factor():
    inv_freq = torch.rand(8) + 0.01
    positions = torch.randint(0, 1000, (5,))
    cos, sin = rope_cos_sin(inv_freq, positions, attention_factor=1.25)
    angles = positions.double()[:, None] * inv_freq.double()
    torch.testing.assert_close(cos[:, :8].double(), 1.25 * angles.cos(), rtol=0, atol=1e-4)
    torch.testing.assert_close(sin[:, 8:].double(), 1.25 * angles.sin(), rtol=0, atol=1e-4)
    assert torch.equal(cos[:, :8], cos[:, 8:])


def test_yarn_factor_defaults_to_context_ratio():
    head_dim, theta, scaling, max_positions = ROPE_CONFIGS["yarn_factor_from_max_positions"]
    explicit = dict(scaling, factor=max_positions / scaling["original_max_position_embeddings"])
    assert torch.equal(
        rope_inv_freq(head_dim, theta, scaling, max_positions)[0], rope_inv_freq(head_dim, theta, explicit)[0]
    )


@pytest.mark.parametrize(
    "kwargs, error, pattern",
    [
        (
            dict(head_dim=64, rope_theta=1e4, rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
            ValueError,
            "dynamic.*'default', 'linear', 'llama3', 'yarn'",
        ),
        (dict(head_dim=64, rope_theta=1e4, rope_scaling={"type": "longrope"}), ValueError, "longrope"),
        (dict(head_dim=63, rope_theta=1e4), ValueError, "even.*63"),
        (dict(head_dim=64, rope_theta=-1.0), ValueError, "rope_theta"),
        (dict(head_dim=64, rope_theta=1e4, rope_scaling={"rope_type": "linear"}), ValueError, "'factor'"),
        (dict(head_dim=64, rope_theta=1e4, rope_scaling={"rope_type": "linear", "factor": 0}), ValueError, "factor"),
        (
            dict(
                head_dim=64,
                rope_theta=1e4,
                rope_scaling={"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0},
            ),
            ValueError,
            "original_max_position_embeddings",
        ),
        (
            dict(
                head_dim=64,
                rope_theta=1e4,
                rope_scaling={"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0},
                max_position_embeddings=8192,
            ),
            ValueError,
            "low_freq_factor",
        ),
        (dict(head_dim=64, rope_theta=1e4, rope_scaling={"rope_type": "linear", "factr": 2}), ValueError, "factr"),
        (
            dict(head_dim=64, rope_theta=1e4, rope_scaling={"rope_type": "linear", "type": "yarn", "factor": 2}),
            ValueError,
            "type",
        ),
        (dict(head_dim=64, rope_theta=1e4, rope_scaling={"rope_theta": 5e5}), ValueError, "disagrees"),
        (dict(head_dim=64, rope_theta=1e4, rope_scaling={"partial_rotary_factor": 0.5}), ValueError, "partial"),
        (
            dict(
                head_dim=64,
                rope_theta=1e4,
                rope_scaling={"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 4096},
            ),
            ValueError,
            "max_position_embeddings",
        ),
    ],
)
def test_inv_freq_bad_config(kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        rope_inv_freq(**kwargs)


def test_cos_sin_bad_input():
    inv_freq = torch.rand(8)
    with pytest.raises(TypeError, match="integer"):
        rope_cos_sin(inv_freq, torch.rand(4))
    with pytest.raises(TypeError, match="1-D"):
        rope_cos_sin(torch.rand(2, 8), torch.arange(4))
    with pytest.raises(ValueError, match="meta"):
        rope_cos_sin(inv_freq.to("meta"), torch.arange(4))
    with pytest.raises(TypeError, match="dtype"):
        rope_cos_sin(inv_freq, torch.arange(4), dtype=torch.float64)


# ---------------------------------------------------------------- apply_rotary: reference vs HF in float64


def _tables(leading: tuple[int, ...], head_dim: int, dtype=torch.float32, device="cpu", generic=False):
    """cos/sin of shape leading + (head_dim,). ``generic`` draws unrelated halves (not cat(f, f)) so that
    the two halves of the rotation are tested independently."""
    if generic:
        return (torch.randn(leading + (head_dim,), dtype=dtype, device=device) for _ in range(2))
    inv_freq, _ = rope_inv_freq(head_dim, 10000.0)
    positions = torch.randint(0, 4096, leading)
    cos, sin = rope_cos_sin(inv_freq, positions, dtype=dtype)
    return cos.to(device), sin.to(device)


def _run(q, k, cos, sin, dq, dk, backend):
    q_ = q.detach().clone().requires_grad_(True)
    k_ = k.detach().clone().requires_grad_(True)
    q_out, k_out = apply_rotary(q_, k_, cos, sin, backend=backend)
    torch.autograd.backward((q_out, k_out), (dq, dk))
    return q_out.detach(), k_out.detach(), q_.grad, k_.grad


def _hf_float64(q, k, cos, sin, dq, dk, unsqueeze_dim):
    q_ = q.detach().double().requires_grad_(True)
    k_ = k.detach().double().requires_grad_(True)
    q_out, k_out = apply_rotary_pos_emb(q_, k_, cos.double(), sin.double(), unsqueeze_dim=unsqueeze_dim)
    torch.autograd.backward((q_out, k_out), (dq.double(), dk.double()))
    return q_out.detach(), k_out.detach(), q_.grad, k_.grad


@pytest.mark.parametrize("generic", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_matches_hf_float64(generic, dtype, assert_close):
    b, s, hq, hk, d = 2, 9, 6, 2, 32
    q, k = torch.randn(b, s, hq, d, dtype=dtype), torch.randn(b, s, hk, d, dtype=dtype)
    dq, dk = torch.randn_like(q), torch.randn_like(k)
    cos, sin = _tables((b, s), d, dtype, generic=generic)
    got = _run(q, k, cos, sin, dq, dk, "reference")
    want = _hf_float64(q, k, cos, sin, dq, dk, unsqueeze_dim=2)
    for g, w in zip(got, want):
        assert g.dtype == dtype
        assert_close(g, w, dtype)


def test_reference_sequence_first_layout(assert_close):
    # Megatron's [s, b, H, D] with one cos row per position, shared over the batch.
    s, b, hq, hk, d = 7, 3, 4, 4, 16
    q, k = torch.randn(s, b, hq, d), torch.randn(s, b, hk, d)
    dq, dk = torch.randn_like(q), torch.randn_like(k)
    cos, sin = _tables((s,), d)
    got = _run(q, k, cos[:, None], sin[:, None], dq, dk, "reference")
    # HF broadcasts cos [s, 1, 1, D] after unsqueezing at dim 2.
    want = _hf_float64(q, k, cos[:, None], sin[:, None], dq, dk, unsqueeze_dim=2)
    for g, w in zip(got, want):
        assert_close(g, w, torch.float32)


def test_backward_inverts_forward_for_unit_tables(assert_close):
    # With cos^2 + sin^2 = 1 the rotation is orthogonal: its transpose (the backward) undoes it.
    q, k = torch.randn(4, 5, 3, 24), torch.randn(4, 5, 1, 24)
    cos, sin = _tables((4, 5), 24)
    from mcore.kernels.rotary import reference_rotary

    q_rot, k_rot = reference_rotary(q, k, cos, sin, backward=False)
    q_back, k_back = reference_rotary(q_rot, k_rot, cos, sin, backward=True)
    assert_close(q_back, q)
    assert_close(k_back, k)
    assert not torch.allclose(q_rot, q)


# ---------------------------------------------------------------- Triton (interpreter) vs reference


def _layout(name: str, dtype, device):
    """q, k, cos, sin for one input layout; returns also whether the layout must be preserved."""
    d = 32
    if name == "batch_first":
        q, k = torch.randn(2, 5, 4, d, dtype=dtype, device=device), torch.randn(2, 5, 2, d, dtype=dtype, device=device)
        cos, sin = _tables((2, 5), d, dtype, device)
    elif name == "sequence_first_as_transposed_view":
        q = torch.randn(5, 2, 4, d, dtype=dtype, device=device).transpose(0, 1)
        k = torch.randn(5, 2, 1, d, dtype=dtype, device=device).transpose(0, 1)
        cos, sin = (t[:, None].transpose(0, 1) for t in _tables((5,), d, dtype, device))
    elif name == "heads_sliced_from_fused_qkv":
        # [s, b, (q_heads + 2) * d] projection output: q and k are strided views into it, not copies.
        qkv = torch.randn(6, 2, (3 + 2) * d, dtype=dtype, device=device)
        q = qkv[..., : 3 * d].unflatten(-1, (3, d))
        k = qkv[..., 3 * d : 4 * d].unflatten(-1, (1, d))
        assert q.data_ptr() == qkv.data_ptr() and not q.is_contiguous()
        cos, sin = (t[:, None] for t in _tables((6,), d, dtype, device))
    elif name == "grouped_qkv_5d_views":
        # mcore.models' attention: qkv viewed as [s, b, groups, heads_per_group + 2, d], cos [s, b, 1, d].
        qkv = torch.randn(5, 2, 2, 3 + 2, d, dtype=dtype, device=device)
        q, k, _ = qkv.split([3, 1, 1], dim=3)
        cos, sin = (t[:, :, None] for t in _tables((5, 2), d, dtype, device))
    elif name == "three_leading_dims_broadcast_cos":
        q, k = (
            torch.randn(2, 3, 4, 3, d, dtype=dtype, device=device),
            torch.randn(2, 3, 4, 1, d, dtype=dtype, device=device),
        )
        cos, sin = (t[:, None] for t in _tables((3,), d, dtype, device))
    elif name == "one_leading_dim_generic_tables_odd_half":
        q, k = torch.randn(7, 3, 18, dtype=dtype, device=device), torch.randn(7, 5, 18, dtype=dtype, device=device)
        cos, sin = _tables((7,), 18, dtype, device, generic=True)
    elif name == "fp32_tables_for_low_precision_qk":
        q, k = torch.randn(3, 4, 2, d, dtype=dtype, device=device), torch.randn(3, 4, 2, d, dtype=dtype, device=device)
        cos, sin = _tables((3, 4), d, torch.float32, device)
    else:
        raise AssertionError(name)
    return q, k, cos, sin


LAYOUTS = [
    "batch_first",
    "sequence_first_as_transposed_view",
    "heads_sliced_from_fused_qkv",
    "grouped_qkv_5d_views",
    "three_leading_dims_broadcast_cos",
    "one_leading_dim_generic_tables_odd_half",
    "fp32_tables_for_low_precision_qk",
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_triton_matches_reference(layout, dtype, interpreter, assert_close):
    q, k, cos, sin = _layout(layout, dtype, interpreter)
    dq, dk = torch.randn(q.shape, dtype=dtype), torch.randn(k.shape, dtype=dtype)
    got = _run(q, k, cos, sin, dq, dk, "triton")
    want = _run(q, k, cos, sin, dq, dk, "reference")
    for g, w in zip(got, want):
        assert g.dtype == dtype
        assert_close(g, w, dtype)


def test_triton_against_hf_float64(interpreter, assert_close):
    q, k, cos, sin = _layout("batch_first", torch.float32, interpreter)
    dq, dk = torch.randn_like(q), torch.randn_like(k)
    got = _run(q, k, cos, sin, dq, dk, "triton")
    for g, w in zip(got, _hf_float64(q, k, cos, sin, dq, dk, unsqueeze_dim=2)):
        assert_close(g, w, torch.float32)


def test_triton_keeps_the_sequence_first_layout(interpreter):
    q, k, cos, sin = _layout("sequence_first_as_transposed_view", torch.float32, interpreter)
    q_out, k_out = apply_rotary(q, k, cos, sin, backend="triton")
    assert q_out.stride() == q.stride() and k_out.stride() == k.stride()


def test_dispatch_env_and_keyword(monkeypatch, interpreter, spy):
    calls = spy(TRITON_ROTARY, "rotary")
    q, k, cos, sin = _layout("batch_first", torch.float32, interpreter)
    monkeypatch.setenv("MCORE_KERNELS_BACKEND", "triton")
    apply_rotary(q, k, cos, sin)
    assert len(calls) == 1
    apply_rotary(q, k, cos, sin, backend="reference")
    assert len(calls) == 1


# ---------------------------------------------------------------- bad input


def _bad_cases():
    q, k = torch.randn(2, 5, 4, 16), torch.randn(2, 5, 2, 16)
    cos, sin = torch.randn(2, 5, 16), torch.randn(2, 5, 16)
    return [
        (
            "odd head_dim",
            lambda be: apply_rotary(q[..., :15], k[..., :15], cos[..., :15], sin[..., :15], backend=be),
            ValueError,
            "even.*15",
        ),
        (
            "zero head_dim",
            lambda be: apply_rotary(q[..., :0], k[..., :0], cos[..., :0], sin[..., :0], backend=be),
            ValueError,
            "even.*0",
        ),
        ("k head_dim", lambda be: apply_rotary(q, k[..., :8], cos, sin, backend=be), ValueError, r"\[\.\.\., Hk, 16\]"),
        ("k leading dims", lambda be: apply_rotary(q, k[:, :4], cos, sin, backend=be), ValueError, r"\(2, 4, 2, 16\)"),
        (
            "cos not broadcastable",
            lambda be: apply_rotary(q, k, cos[:, :4], sin[:, :4], backend=be),
            ValueError,
            "broadcast",
        ),
        (
            "cos extra dims",
            lambda be: apply_rotary(q, k, cos[None, None], sin[None, None], backend=be),
            ValueError,
            "broadcast",
        ),
        ("cos/sin shapes", lambda be: apply_rotary(q, k, cos, sin[:1], backend=be), ValueError, "one shape"),
        ("q float64", lambda be: apply_rotary(q.double(), k, cos, sin, backend=be), TypeError, "float64"),
        ("cos int", lambda be: apply_rotary(q, k, cos.int(), sin, backend=be), TypeError, "int32"),
        ("q 1-D", lambda be: apply_rotary(q[0, 0, 0], k, cos, sin, backend=be), ValueError, "heads, head_dim"),
        ("device", lambda be: apply_rotary(q, k.to("meta"), cos, sin, backend=be), ValueError, "meta"),
        (
            "cos requires grad",
            lambda be: apply_rotary(q, k, cos.clone().requires_grad_(), sin, backend=be),
            ValueError,
            "detached",
        ),
    ]


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("case", _bad_cases(), ids=lambda c: c[0])
def test_bad_input(case, backend, forbid):
    _, call, error, pattern = case
    forbid(TRITON_ROTARY, "rotary")
    with pytest.raises(error, match=pattern):
        call(backend)


# ---------------------------------------------------------------- compiled Triton on CUDA


@pytest.mark.gpu
class TestCuda:
    @pytest.mark.parametrize("layout", ["batch_first", "sequence_first"])
    def test_bf16_triton_matches_reference(self, layout, cuda_triton, assert_close):
        s, b, hq, hk, d = 1024, 2, 32, 8, 128
        dtype = torch.bfloat16
        if layout == "batch_first":
            q = torch.randn(b, s, hq, d, dtype=dtype, device=cuda_triton)
            k = torch.randn(b, s, hk, d, dtype=dtype, device=cuda_triton)
            cos, sin = _tables((b, s), d, dtype, cuda_triton)
        else:
            q = torch.randn(s, b, hq, d, dtype=dtype, device=cuda_triton).transpose(0, 1)
            k = torch.randn(s, b, hk, d, dtype=dtype, device=cuda_triton).transpose(0, 1)
            cos, sin = (t[:, None].transpose(0, 1) for t in _tables((s,), d, dtype, cuda_triton))
        dq, dk = (
            torch.randn(q.shape, dtype=dtype, device=cuda_triton),
            torch.randn(k.shape, dtype=dtype, device=cuda_triton),
        )
        got = _run(q, k, cos, sin, dq, dk, "triton")
        want = _run(q, k, cos, sin, dq, dk, "reference")
        for g, w in zip(got, want):
            assert_close(g, w, dtype)

    def test_fp32_against_hf_float64(self, cuda_triton, assert_close):
        q, k, cos, sin = _layout("one_leading_dim_generic_tables_odd_half", torch.float32, cuda_triton)
        dq, dk = torch.randn_like(q), torch.randn_like(k)
        got = _run(q, k, cos, sin, dq, dk, "triton")
        for g, w in zip(got, _hf_float64(q, k, cos, sin, dq, dk, unsqueeze_dim=1)):
            assert_close(g, w, torch.float32)
