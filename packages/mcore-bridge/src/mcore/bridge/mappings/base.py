"""The vocabulary a family mapping is written in: tensor rules and the family record.

A family file (``llama.py``, ``qwen2.py``...) is data: a tuple of :class:`TensorRule` saying which Hugging Face
tensors make each mcore parameter and how (``copy``, the grouped ``qkv`` fusion, the ``gate_up`` fusion, or a
``vocab`` tensor padded to the padded vocabulary), and a tuple of config rules (``config_rules.py``).
Patterns use ``{layer}`` for the layer index.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from mcore.bridge.mappings.config_rules import ConfigRule

Op = Literal[
    "copy", "qkv", "gate_up", "vocab", "experts", "experts_gate_up",
    "gate_up_interleaved", "bias_interleaved", "transposed",  # stacked experts (mcore.bridge.stacked_experts)
]  # fmt: skip
# ``experts`` stacks one HF tensor per expert into [E, ...]; ``experts_gate_up`` stacks each expert's gate and up
# rows fused ([E, 2F, H]): their patterns use ``{expert}`` and expand to num_experts tensors each.
_SOURCES_PER_OP = {"copy": 1, "vocab": 1, "qkv": 3, "gate_up": 2, "experts": 1, "experts_gate_up": 2}
_SOURCES_PER_OP.update(gate_up_interleaved=1, bias_interleaved=1, transposed=1)
EXPERT_OPS = ("experts", "experts_gate_up")


@dataclass(frozen=True)
class TensorRule:
    """One mcore parameter and the Hugging Face tensors it is made of.

    ``when`` names a boolean ``TransformerConfig`` field that must be true for the tensor to exist (biases,
    qk-norm), ``unless`` one that must be false (``output.weight`` exists unless the embeddings are tied).
    """

    mcore: str
    hf: tuple[str, ...]
    op: Op = "copy"
    when: str | None = None
    unless: str | None = None
    mlp: str | None = None  # per-layer rule only for layers whose MLP part is this ("dense" / "moe")

    def __post_init__(self) -> None:
        if self.op not in _SOURCES_PER_OP:
            raise ValueError(f"TensorRule {self.mcore!r}: op must be one of {list(_SOURCES_PER_OP)}, got {self.op!r}")
        if len(self.hf) != _SOURCES_PER_OP[self.op]:
            raise ValueError(
                f"TensorRule {self.mcore!r}: op {self.op!r} takes {_SOURCES_PER_OP[self.op]} HF tensors, "
                f"got {len(self.hf)}"
            )
        per_layer = "{layer}" in self.mcore
        if any(("{layer}" in h) != per_layer for h in self.hf):
            raise ValueError(
                f"TensorRule {self.mcore!r}: HF patterns {self.hf} must use {{layer}} exactly when it does"
            )

        if (self.op in EXPERT_OPS) != all("{expert}" in h for h in self.hf) or (
            self.op not in EXPERT_OPS and any("{expert}" in h for h in self.hf)
        ):
            raise ValueError(f"TensorRule {self.mcore!r}: HF patterns use {{expert}} exactly for the expert ops")

    @property
    def per_layer(self) -> bool:
        return "{layer}" in self.mcore

    def applies(self, config: Any) -> bool:
        if self.when is not None and not getattr(config, self.when):
            return False
        return not (self.unless is not None and getattr(config, self.unless))


@dataclass(frozen=True)
class FamilyMapping:
    """Everything the bridge knows about one family: HF identity, tensor rules and config rules."""

    name: str  # the mcore family (TransformerConfig.model_type and mcore.models.families name)
    hf_model_type: str
    tensors: tuple[TensorRule, ...]
    config: tuple[ConfigRule, ...]
    description: str = ""
    # HF class names that read as this family; () takes the family's HF_ARCHITECTURE from mcore.models.families.
    hf_architectures: tuple[str, ...] = ()
    # Multi-token-prediction depths (DeepSeek-V3), stored as HF layers num_hidden_layers + k: rules whose {layer} is
    # k in the mcore name and num_hidden_layers + k in the HF names; each depth's decoder layer uses the per-layer
    # rules of the last layer. ``mtp_copies``: (mcore name, HF pattern) of the shared tensors the checkpoints repeat
    # in every depth (read and dropped on import, written from the main model's tensor on export).
    mtp_tensors: tuple[TensorRule, ...] = ()
    mtp_copies: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if not self.hf_architectures:
            from mcore.models.families import hf_architecture

            object.__setattr__(self, "hf_architectures", (hf_architecture(self.name),))
        names = [r.mcore for r in self.tensors]
        if len(set(names)) != len(names):
            raise ValueError(f"family {self.name!r}: duplicate mcore tensor rules")
        # One HF per-layer tensor may feed different modules in different layers (Nemotron-H's one norm per layer
        # is our input_norm or mlp_norm by layer type); steps_for checks that no expanded tensor is used twice.
        hf = [(h, r.mcore.split(".")[2] if r.per_layer else None) for r in self.tensors for h in r.hf]
        if len(set(hf)) != len(hf):
            raise ValueError(f"family {self.name!r}: an HF tensor is consumed by two rules")
        keys = [k for rule in self.config for k in rule.hf_keys]
        if len(set(keys)) != len(keys):
            raise ValueError(f"family {self.name!r}: an HF config key is handled by two config rules")
        fields = [f for rule in self.config for f in rule.mcore_fields]
        if len(set(fields)) != len(fields):
            raise ValueError(f"family {self.name!r}: a TransformerConfig field is set by two config rules")
