"""Tensor rules of the MoE families' expert layers, in the names of the Hub's files (per-expert tensors; transformers
5 merges them into 3-D tensors only when it loads a model) and our stacked ``[E, ...]`` parameters.
"""

from __future__ import annotations

from dataclasses import replace

from mcore.bridge.mappings.base import TensorRule
from mcore.bridge.mappings.llama_layout import DOWN, GATE_UP, L, M

ROUTER = "layers.{layer}.mlp.router.weight"
EXPERTS_GATE_UP = "layers.{layer}.mlp.experts.gate_up"
EXPERTS_DOWN = "layers.{layer}.mlp.experts.down"

# Mixtral: block_sparse_moe.gate and experts.{i}.w1 (gate) / w3 (up) / w2 (down)
B = f"{L}.block_sparse_moe"
MIXTRAL_EXPERTS = (
    TensorRule(ROUTER, (f"{B}.gate.weight",)),
    TensorRule(
        EXPERTS_GATE_UP, (f"{B}.experts.{{expert}}.w1.weight", f"{B}.experts.{{expert}}.w3.weight"), "experts_gate_up"
    ),
    TensorRule(EXPERTS_DOWN, (f"{B}.experts.{{expert}}.w2.weight",), "experts"),
)

# Qwen2-MoE / Qwen3-MoE / OLMoE: mlp.gate and mlp.experts.{i}.{gate,up,down}_proj; layers listed in
# mlp_only_layers keep the dense MLP's names
QWEN_EXPERTS = (
    TensorRule(ROUTER, (f"{M}.gate.weight",), mlp="moe"),
    TensorRule(
        EXPERTS_GATE_UP,
        (f"{M}.experts.{{expert}}.gate_proj.weight", f"{M}.experts.{{expert}}.up_proj.weight"),
        "experts_gate_up",
        mlp="moe",
    ),
    TensorRule(EXPERTS_DOWN, (f"{M}.experts.{{expert}}.down_proj.weight",), "experts", mlp="moe"),
)
DENSE_GATE_UP = replace(GATE_UP, mlp="dense")
DENSE_DOWN = replace(DOWN, mlp="dense")

# Qwen2-MoE's shared expert and its sigmoid gate
S = f"{M}.shared_expert"
SHARED_EXPERT = (
    TensorRule(
        "layers.{layer}.mlp.shared_expert.gate_up.weight",
        (f"{S}.gate_proj.weight", f"{S}.up_proj.weight"),
        "gate_up",
        mlp="moe",
    ),
    TensorRule("layers.{layer}.mlp.shared_expert.down.weight", (f"{S}.down_proj.weight",), mlp="moe"),
    TensorRule("layers.{layer}.mlp.shared_expert_gate.weight", (f"{M}.shared_expert_gate.weight",), mlp="moe"),
)
