"""Packed documents in the step's time model (``Layout.document_lengths``): attention is the sum over documents
of each one's causal work at the calibration's packed-kernel rate for its length."""

from __future__ import annotations

import pytest

from mcore.train.config import load_config
from mcore.train.plan import layout_of
from mcore.train.planning.calibration import BACKWARD_ATTENTION_RATIO, load_calibration
from mcore.train.planning.cluster import PRESETS, Network
from mcore.train.planning.layout import Layout
from mcore.train.planning.shape import ModelShape
from mcore.train.planning.time_model import TimeModel

SHAPE = ModelShape(hidden=4096, ffn=14336, layers=2, heads=32, kv_heads=8, head_dim=128, vocab=128256)
NET = Network(PRESETS["h200-node"])
H200 = load_calibration("h200-sxm")


def _attention(layout: Layout) -> tuple[float, float]:
    cost = TimeModel(SHAPE, layout, NET).layer_cost(0)
    return cost.forward["attention"], cost.backward["attention"]


def test_packed_attention_is_the_sum_over_documents_at_each_length_rate():
    lengths = (512, 512, 1024, 2048)
    fwd, bwd = _attention(Layout(seq_length=4096, micro_batch=2, document_lengths=lengths))
    width = 2 * 32 * 128  # score and value widths over all query heads
    expected_f = expected_b = 0.0
    for n in lengths:
        f, b = H200.packed_attention_seconds(2.0 * 2 * n * n / 2 * width, n)
        expected_f, expected_b = expected_f + f, expected_b + b
    assert fwd == pytest.approx(expected_f, rel=1e-12) and bwd == pytest.approx(expected_b, rel=1e-12)
    # the same tokens as one document: 4x the pairs of four 1,024-token documents, at a faster rate
    one_f, _ = _attention(Layout(seq_length=4096, micro_batch=2))
    quarter_f, _ = _attention(Layout(seq_length=4096, micro_batch=2, document_lengths=(1024,) * 4))
    assert quarter_f < one_f / 2


def test_packed_rate_interpolates_between_calibrated_lengths_and_falls_back():
    flops = 1e12
    f128, b128 = H200.packed_attention_seconds(flops, 128)
    f512, b512 = H200.packed_attention_seconds(flops, 512)
    f256, b256 = H200.packed_attention_seconds(flops, 256)
    assert f512 < f256 < f128 and b512 < b256 < b128
    assert f256 == pytest.approx((f128 * f512) ** 0.5, rel=1e-9)  # log-log: the geometric mean half-way
    h100 = load_calibration("h100-sxm")  # no packed curve: the one-document curve, split 1 : 2.5
    f, b = h100.packed_attention_seconds(flops, 512)
    assert b / f == pytest.approx(BACKWARD_ATTENTION_RATIO)
    assert f + b == pytest.approx(h100.attention_seconds(flops * 3.5, 512))


def test_document_lengths_validated():
    with pytest.raises(ValueError, match="sum to 1000, not seq_length 4096"):
        Layout(seq_length=4096, document_lengths=(500, 500))
    with pytest.raises(ValueError, match="tuple of ints >= 1"):
        Layout(seq_length=4096, document_lengths=(4096, 0))
    with pytest.raises(ValueError, match="packed_attention points"):
        H200.__class__(**{**H200.to_dict(), "packed_attention": [[128, 10.0]]})


def test_plan_of_a_packed_mock_config_costs_its_documents():
    """``data.packing`` on mock data: the plan takes the documents of the sample mcore-train draws (their
    lengths sum to the sequence), and attention costs less than one causal document of the whole sequence."""
    overrides = ["data.mock=true", "data.seq_length=256", "train.global_batch_size=1", "train.micro_batch_size=1"]
    packed = layout_of(load_config(overrides=[*overrides, "data.packing=true"]), 1)
    plain = layout_of(load_config(overrides=overrides), 1)
    assert plain.document_lengths == () and len(packed.document_lengths) > 1
    assert sum(packed.document_lengths) == 256
    shape = ModelShape.from_config(load_config(overrides=overrides).model)
    packed_cost = TimeModel(shape, packed, NET).layer_cost(0)
    plain_cost = TimeModel(shape, plain, NET).layer_cost(0)
    assert packed_cost.forward["attention"] < plain_cost.forward["attention"]
    assert packed_cost.forward["gemm"] == plain_cost.forward["gemm"]
