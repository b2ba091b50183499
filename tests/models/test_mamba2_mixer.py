"""The ``mamba2`` mixer part against transformers' torch path (``Mamba2Mixer`` and ``NemotronHMamba2Mixer``) on
tiny random weights: outputs and parameter gradients, packed documents equal to separate runs, selective
recompute, TP rule, accounting."""

from __future__ import annotations

import pytest
import torch
import transformers

from mcore.models.config import TransformerConfig
from mcore.models.layers.mamba2 import Mamba2Mixer, mamba2_parameters
from mcore.models.parts.registry import MIXERS, PartContext

SIZES = dict(hidden_size=32, mamba_num_heads=4, mamba_head_dim=8, ssm_state_size=6, n_groups=2, chunk_size=4)


def our_config(**overrides) -> TransformerConfig:
    fields = dict(
        intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, vocab_size=64, layer_types=["mamba2"],
        rms_norm_eps=1e-5, **SIZES,
    )  # fmt: skip
    return TransformerConfig(**{**fields, **overrides})


def hf_mixer(kind: str, config: TransformerConfig, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    common = dict(hidden_size=config.hidden_size, n_groups=config.n_groups, conv_kernel=config.conv_kernel,
                  chunk_size=config.chunk_size, layer_norm_epsilon=config.rms_norm_eps, use_conv_bias=True)  # fmt: skip
    if kind == "mamba2":
        hf_cfg = transformers.Mamba2Config(
            num_heads=config.mamba_num_heads, head_dim=config.mamba_head_dim, state_size=config.ssm_state_size,
            expand=config.mamba_d_inner // config.hidden_size, num_hidden_layers=1, **common,
        )  # fmt: skip
        mixer = transformers.models.mamba2.modeling_mamba2.Mamba2Mixer(hf_cfg, layer_idx=0)
    else:
        hf_cfg = transformers.NemotronHConfig(
            mamba_num_heads=config.mamba_num_heads, mamba_head_dim=config.mamba_head_dim,
            ssm_state_size=config.ssm_state_size, layers_block_type=["mamba"], num_hidden_layers=1, **common,
        )  # fmt: skip
        mixer = transformers.models.nemotron_h.modeling_nemotron_h.NemotronHMamba2Mixer(hf_cfg, layer_idx=0)
    with torch.no_grad():  # redraw what HF sets to constants, so that a mapping slip cannot hide
        for name, p in mixer.named_parameters():
            if name in ("D", "norm.weight") or name.endswith("bias"):
                p.uniform_(0.5, 1.5)
    return mixer.eval()


def ours_from(hf: torch.nn.Module, config: TransformerConfig, recompute=None) -> Mamba2Mixer:
    ours = Mamba2Mixer(config, 0, PartContext(recompute=recompute))
    missing = set(dict(ours.named_parameters())) ^ set(dict(hf.named_parameters()))
    assert not missing, f"parameter names differ from HF's: {sorted(missing)}"
    ours.load_state_dict(hf.state_dict())
    return ours


@pytest.mark.parametrize("kind", ["mamba2", "nemotron_h"])
@pytest.mark.parametrize("seq", [7, 12])
def test_mixer_equals_hf_torch_path_outputs_and_grads(kind, seq):
    config = our_config()
    hf = hf_mixer(kind, config, seed=seq)
    ours = ours_from(hf, config)
    x = torch.randn(2, seq, config.hidden_size)
    ref = hf(x.clone())
    out = ours(x.transpose(0, 1).clone(), None).transpose(0, 1)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    weight = torch.randn_like(ref)
    (ref * weight).sum().backward()
    (out * weight).sum().backward()
    hf_grads = {n: p.grad for n, p in hf.named_parameters()}
    for name, p in ours.named_parameters():
        scale = max(1.0, hf_grads[name].abs().max().item())
        torch.testing.assert_close(p.grad, hf_grads[name], rtol=1e-4, atol=1e-5 * scale, msg=name)


def test_packed_documents_equal_separate_hf_runs_and_selective_recompute_is_exact():
    config = our_config()
    hf = hf_mixer("mamba2", config, seed=3)
    ours = ours_from(hf, config)
    recomputed = ours_from(hf, config, recompute="selective")
    x = torch.randn(1, 11, config.hidden_size)
    cu = torch.tensor([0, 3, 4, 11], dtype=torch.int32)
    with torch.no_grad():
        ref = torch.cat([hf(x[:, a:b]) for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)], dim=1)
    x_sb = x.transpose(0, 1).clone().requires_grad_()
    out = ours(x_sb, None, cu_seqlens=cu)
    torch.testing.assert_close(out.transpose(0, 1), ref, rtol=1e-5, atol=1e-5)
    out.square().sum().backward()
    x2 = x.transpose(0, 1).clone().requires_grad_()
    out2 = recomputed(x2, None, cu_seqlens=cu)
    out2.square().sum().backward()
    assert torch.equal(out, out2) and torch.equal(x_sb.grad, x2.grad)
    assert not torch.allclose(ours(x_sb, None), out)  # packing matters: without it the documents mix


def test_part_is_registered_and_counts_its_parameters():
    config = our_config(mamba_proj_bias=True, projectors_bias=True)
    spec = MIXERS.get("mamba2")
    module = spec.build(config, 0, PartContext())
    assert spec.attribute == "mamba"
    assert spec.parameters(config, 0) == mamba2_parameters(config) == sum(p.numel() for p in module.parameters())
    assert module.A_log.dtype == module.D.dtype == module.dt_bias.dtype == torch.float32
    bf16 = Mamba2Mixer(config, 0, PartContext(params_dtype=torch.bfloat16))
    assert bf16.in_proj.weight.dtype == torch.bfloat16 and bf16.A_log.dtype == torch.float32
    assert spec.sequence_flops(config, 0, 16) > 0


def test_config_validation_and_tp_rule():
    with pytest.raises(ValueError, match="ssm_state_size must be set"):
        our_config(ssm_state_size=None)
    with pytest.raises(ValueError, match="n_groups .3. must divide mamba_num_heads"):
        our_config(n_groups=3)
    with pytest.raises(ValueError, match="time_step_limit"):
        our_config(time_step_limit=(1.0, 0.5))
    # Not validated (nor needed) when no layer is mamba2.
    TransformerConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, vocab_size=64)
    config = our_config()
    assert config.valid_tensor_parallel_sizes(8) == [1, 2]
    with pytest.raises(ValueError, match="must divide n_groups"):
        config.check_tensor_parallel(4)
    assert TransformerConfig.from_dict(config.to_dict()) == config


def test_flops_follow_the_hf_hybrid_baseline_convention():
    from mcore.models.accounting import model_flops_per_token
    from mcore.models.families import get_config

    # shared/bench/hf_hybrid_baseline.py's formula for nemotronh8b4l, written out.
    h, d_inner, g, n, heads, ffn, vocab, seq, chunk = 4096, 8192, 8, 128, 128, 21504, 131072, 4096, 128
    mamba_w = h * (2 * d_inner + 2 * g * n + heads) + d_inner * h
    attn_w = h * 128 * (32 + 16) + 32 * 128 * h
    weights = 2 * mamba_w + attn_w + 2 * h * ffn + h * vocab
    expected = 6 * weights + 12 * 32 * 128 * seq + 6 * 2 * (2 * chunk * d_inner + 4 * d_inner * n)
    assert model_flops_per_token(get_config("nemotron-h-8b-4l"), seq) == expected
