"""The tensor operations between layouts: fused grouped QKV against a head-by-head construction of the contract's
layout, [gate; up], vocabulary padding; every split is the exact inverse."""

from __future__ import annotations

import pytest
import torch

from mcore.bridge.transforms import fuse_gate_up, fuse_qkv, pad_vocab, split_gate_up, split_qkv


def _reference_qkv(q, k, v, heads, kv_heads, d):
    rows = []
    for g in range(kv_heads):
        for h in range(g * heads // kv_heads, (g + 1) * heads // kv_heads):
            rows.append(q[h * d : (h + 1) * d])
        rows += [k[g * d : (g + 1) * d], v[g * d : (g + 1) * d]]
    return torch.cat(rows)


@pytest.mark.parametrize("heads,kv_heads,d", [(4, 4, 8), (8, 2, 6), (6, 1, 4), (12, 3, 16)])
@pytest.mark.parametrize("trailing", [(10,), ()])  # weights and biases
def test_qkv_fusion_follows_the_contract_and_splits_back_exactly(heads, kv_heads, d, trailing):
    g = torch.Generator().manual_seed(heads * 100 + kv_heads)
    q = torch.randn(heads * d, *trailing, generator=g, dtype=torch.float64)
    k = torch.randn(kv_heads * d, *trailing, generator=g, dtype=torch.float64)
    v = torch.randn(kv_heads * d, *trailing, generator=g, dtype=torch.float64)
    fused = fuse_qkv(q, k, v, num_heads=heads, num_kv_heads=kv_heads, head_dim=d)
    assert torch.equal(fused, _reference_qkv(q, k, v, heads, kv_heads, d))
    q2, k2, v2 = split_qkv(fused, num_heads=heads, num_kv_heads=kv_heads, head_dim=d)
    assert torch.equal(q2, q) and torch.equal(k2, k) and torch.equal(v2, v)
    assert q2.is_contiguous() and k2.is_contiguous() and v2.is_contiguous()


def test_qkv_fusion_rejects_wrong_row_counts():
    q, k = torch.rand(16, 4), torch.rand(8, 4)
    with pytest.raises(ValueError, match="v has 4 rows, expected 8"):
        fuse_qkv(q, k, torch.rand(4, 4), num_heads=4, num_kv_heads=2, head_dim=4)


def test_gate_up_and_vocabulary_padding_round_trip():
    g = torch.Generator().manual_seed(1)
    gate, up = torch.randn(6, 5, generator=g).to(torch.bfloat16), torch.randn(6, 5, generator=g).to(torch.bfloat16)
    fused = fuse_gate_up(gate, up)
    assert torch.equal(fused[:6], gate) and torch.equal(fused[6:], up)
    gate2, up2 = split_gate_up(fused)
    assert torch.equal(gate2, gate) and torch.equal(up2, up) and gate2.is_contiguous() and up2.is_contiguous()

    embedding = torch.randn(300, 8, generator=g)
    padded = pad_vocab(embedding, 384)
    assert padded.shape == (384, 8) and torch.equal(padded[:300], embedding) and not padded[300:].any()
    with pytest.raises(ValueError, match="cannot pad 300 vocabulary rows down to 256"):
        pad_vocab(embedding, 256)
