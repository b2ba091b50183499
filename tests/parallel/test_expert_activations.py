"""``GroupedExperts``' activations: ``relu2`` (Nemotron-H's non-gated squared ReLU, input projection ``up``) beside
the gated ``swiglu`` (``gate_up``), each against a float64 loop over the experts, in both GEMM modes and sliced over
etp; the options that need gated experts refuse relu2 ones by name."""

from __future__ import annotations

import pytest
import torch

from mcore.parallel.expert_biases import use_gpt_oss_options
from mcore.parallel.expert_parallel import GroupedExperts, MoEConfig, MoELayer

OFFSETS = [3, 3, 9, 11]  # an expert without rows, then 2 rows of no expert
ROWS, H, F = 13, 8, 6


def _float64_experts(x, w_in, down, offsets, activation):
    """The experts one by one in float64: ``down_g(act(w_in_g x))`` on each expert's rows; other rows zero."""
    out = torch.zeros(x.shape[0], down.shape[1], dtype=torch.float64)
    start = 0
    for g, end in enumerate(offsets):
        h = x[start:end] @ w_in[g].t()
        if activation == "swiglu":
            a = torch.nn.functional.silu(h[:, : h.shape[1] // 2]) * h[:, h.shape[1] // 2 :]
        else:
            a = torch.relu(h).square()
        out[start:end] = a @ down[g].t()
        start = end
    return out


@pytest.mark.parametrize("gemm", ["grouped", "per_expert"])
@pytest.mark.parametrize("activation", ["swiglu", "relu2"])
def test_experts_match_float64(activation, gemm):
    torch.manual_seed(0)
    experts = GroupedExperts(len(OFFSETS), H, F, gemm=gemm, activation=activation)
    experts.reset_parameters(torch.Generator().manual_seed(1))
    name = "gate_up" if activation == "swiglu" else "up"
    assert experts.input_name == name and experts.input_weight is getattr(experts, name)
    assert experts.input_weight.shape == (len(OFFSETS), (2 if activation == "swiglu" else 1) * F, H)
    assert {n for n, _ in experts.named_parameters()} == {name, "down"}
    x = torch.randn(ROWS, H, requires_grad=True)
    y = experts(x, torch.tensor(OFFSETS, dtype=torch.int32))
    x64 = x.detach().double().requires_grad_(True)
    w64 = experts.input_weight.detach().double().requires_grad_(True)
    d64 = experts.down.detach().double().requires_grad_(True)
    want = _float64_experts(x64, w64, d64, OFFSETS, activation)
    torch.testing.assert_close(y.double(), want, rtol=1e-6, atol=1e-6)
    probe = torch.randn(ROWS, H)
    (y * probe).sum().backward()
    (want * probe.double()).sum().backward()
    for got, ref in ((x.grad, x64.grad), (experts.input_weight.grad, w64.grad), (experts.down.grad, d64.grad)):
        torch.testing.assert_close(got.double(), ref, rtol=1e-6, atol=1e-6)


def test_relu2_experts_slice_over_etp_like_a_column_then_row_pair():
    full_up, full_down = torch.randn(2, F, H), torch.randn(2, H, F)
    x = torch.randn(7, H)
    offsets = torch.tensor([4, 7], dtype=torch.int32)
    whole = GroupedExperts(2, H, F, activation="relu2")
    whole.load_full_experts(full_up, full_down)
    parts = []
    for rank in range(2):
        part = GroupedExperts(2, H, F, etp=2, etp_rank=rank, activation="relu2")
        part.load_full_experts(full_up, full_down)
        assert torch.equal(part.up, full_up[:, rank * F // 2 : (rank + 1) * F // 2])
        assert part.up.partition_blocks is None and part.up.partition_dim == 1
        parts.append(part(x, offsets))
    # the etp ranks' partial down outputs sum to the whole experts' output (the dispatcher's etp reduction)
    torch.testing.assert_close(parts[0] + parts[1], whole(x, offsets), rtol=1e-5, atol=1e-6)


def test_moe_layer_builds_the_configured_activation():
    cfg = MoEConfig(hidden_size=H, num_experts=4, topk=2, moe_intermediate_size=F, activation="relu2")
    layer = MoELayer(cfg)
    assert layer.experts.activation_name == "relu2" and layer.experts.up.shape == (4, F, H)
    with pytest.raises(ValueError, match=r"MoEConfig.activation must be one of \['swiglu', 'relu2'\], got 'gelu'"):
        MoEConfig(hidden_size=H, num_experts=4, topk=2, moe_intermediate_size=F, activation="gelu")
    with pytest.raises(ValueError, match="activation must be one of"):
        GroupedExperts(2, H, F, activation="silu")
    with pytest.raises(ValueError, match="need gated SwiGLU experts, not 'relu2' ones"):
        use_gpt_oss_options(layer, router_bias=False, expert_biases=True, activation=None)
