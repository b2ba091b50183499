"""The planner's host-offload terms: activation offload's copy stream, optimizer offload's piece choice and step."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from mcore.models.families import get_config
from mcore.parallel.offload import _choose
from mcore.train.config import load_config
from mcore.train.plan import layout_of
from mcore.train.planning.cluster import PRESETS, Network
from mcore.train.planning.layout import Layout
from mcore.train.planning.memory import activation_bytes_per_layer, activation_parts_per_layer, stage_memory
from mcore.train.planning.offload_cost import (
    activation_offload_seconds,
    last_host_chunk,
    offloaded_pieces,
    optimizer_offload_seconds,
)
from mcore.train.planning.shape import ModelShape
from mcore.train.planning.step import predict_step

H200 = Network(PRESETS["h200-node"])
LLAMA1B = ModelShape.from_config(get_config("llama3.2-1b"))
BASE = Layout(micro_batch=2, global_batch=2, seq_length=4096, distributed_optimizer=True)


def test_copy_stream_replay_by_hand():
    # two layers, forward 1 s and backward 2 s each, 3 s of copy each way per layer
    gbps = 1 / 3 * 1e-9  # one byte takes 3 s
    # D2H: layer 0 in [0, 3], layer 1 in [3, 6]; backward begins at 2 + 0.5; layer 1's fetch waits for the copy
    # stream: [6, 9], layer 0's prefetch [9, 12]; backward of layer 1 [9, 11], of layer 0 [12, 14]; without offload
    # the backward would end at 2.5 + 4 = 6.5
    assert activation_offload_seconds([1, 1], [2, 2], [1, 1], 0.5, gbps) == pytest.approx(14 - 6.5)
    assert activation_offload_seconds([1, 1], [2, 2], [0, 0], 0.5, gbps) == 0.0
    # copies much faster than compute hide, but for the last layer's fetch, which its backward waits for
    assert activation_offload_seconds([1, 1], [2, 2], [1e-3, 1e-3], 0.5, gbps) == pytest.approx(3e-3)


def test_activation_parts_add_up_and_offload_moves_them():
    parts = activation_parts_per_layer(LLAMA1B, BASE, 0)
    assert set(parts) == {"input_norm", "attention", "mlp_norm", "mlp"}
    assert sum(parts.values()) == pytest.approx(activation_bytes_per_layer(LLAMA1B, BASE, 0))
    plain = stage_memory(LLAMA1B, BASE)[0]
    some = stage_memory(LLAMA1B, BASE.replace(activation_offload=("attention", "mlp")))[0]
    whole = stage_memory(LLAMA1B, BASE.replace(activation_offload=("layer",)))[0]
    saved = LLAMA1B.layers * (parts["attention"] + parts["mlp"])
    assert plain.activations - some.activations == pytest.approx(saved)
    assert whole.activations < some.activations
    fast = predict_step(LLAMA1B, BASE, H200)
    slow = predict_step(LLAMA1B, BASE.replace(activation_offload=("layer",)), H200)
    assert slow.breakdown["activation_offload"] > 0 and slow.step_s > fast.step_s


def test_activation_offload_is_checked_and_spelled_as_mcore_train_does():
    with pytest.raises(ValueError, match="activation_offload must be a tuple of"):
        Layout(activation_offload=("attn",))
    with pytest.raises(ValueError, match="activation_offload must be a tuple of"):
        Layout(activation_offload="layer")
    bad = BASE.replace(activation_offload=("mlp",), recompute="full")
    assert any("activation_offload with full recompute" in p for p in bad.problems(LLAMA1B))
    layout = BASE.replace(activation_offload=("attention", "mlp"))
    config = load_config(None, ["model=llama3.2-1b", "data.seq_length=4096", *layout.overrides()])
    assert layout_of(config, 1).activation_offload == ("attention", "mlp")


@pytest.mark.parametrize("fraction", [0.1, 0.25, 0.5, 0.9, 1.0])
def test_offloaded_pieces_follow_host_offload_choice(fraction):
    layout = BASE.replace(optimizer_offload_fraction=fraction)
    pieces = offloaded_pieces(LLAMA1B, layout.replace(optimizer_offload_fraction=1.0), 0, [(0, LLAMA1B.layers)], 1)
    chosen = offloaded_pieces(LLAMA1B, layout, 0, [(0, LLAMA1B.layers)], 1)
    real = _choose([SimpleNamespace(lo=0, hi=int(p)) for p in pieces], fraction)  # mcore.parallel.offload's rule
    assert len(chosen) == len(real) and chosen == pieces[: len(real)]
    assert sum(pieces) == pytest.approx(LLAMA1B.total_parameters(), rel=1e-6)


def test_optimizer_offload_step_terms():
    chunk = 32 * 2**20
    assert last_host_chunk([chunk, 10.0]) == 10.0 and last_host_chunk([2.0 * chunk]) == 2.0 * chunk
    # 1 G elements at 2 G/s on the host, the last chunk (10 elements) back for free, copies down hidden
    assert optimizer_offload_seconds([1e9 - 10, 10], 1.0, 0.1, 2.0, 50.0) == pytest.approx(0.5 - 0.1, rel=1e-6)
    # the gradient copies not hidden by the last backward (4 GB at 50 GB/s = 80 ms, 30 ms of backward)
    slow = optimizer_offload_seconds([1e9 - 10, 10], 0.03, 0.0, 2.0, 50.0)
    assert slow == pytest.approx(0.05 + 0.5, rel=1e-6)
    assert optimizer_offload_seconds([], 1.0, 0.1, 2.0, 50.0) == 0.0
    steps = [predict_step(LLAMA1B, BASE.replace(optimizer_offload_fraction=f), H200).step_s for f in (0, 0.5, 1.0)]
    assert steps == sorted(steps) and steps[0] < steps[2]
