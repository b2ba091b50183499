"""Mamba-2 (``Mamba2ForCausalLM``): ``backbone.*`` names, one norm and one ``mixer`` per layer, all copies.

Our layer ``i`` holds ``input_norm`` (HF ``backbone.layers.i.norm``) and the ``mamba`` mixer (HF ``...mixer``, whose
tensor names are ours: ``in_proj``, ``conv1d``, ``A_log``, ``D``, ``dt_bias``, ``norm``, ``out_proj``).
"""

from __future__ import annotations

from mcore.bridge.errors import BridgeError
from mcore.bridge.mappings.base import FamilyMapping, TensorRule
from mcore.bridge.mappings.config_rules import Field, family_rules
from mcore.bridge.mappings.ssm_rules import Alias, Expand, LayerPattern, TimeStepLimit

L = "backbone.layers.{layer}"


def mamba_tensors(hf_mixer: str, ours: str = "layers.{layer}.mamba") -> tuple[TensorRule, ...]:
    """The Mamba-2 mixer's tensors under ``ours`` from HF's ``hf_mixer`` (both with ``{layer}``)."""
    m = hf_mixer
    rules = [TensorRule(f"{ours}.{n}", (f"{m}.{n}",)) for n in ("in_proj.weight", "conv1d.weight", "A_log", "D")]
    rules += [TensorRule(f"{ours}.{n}", (f"{m}.{n}",)) for n in ("dt_bias", "out_proj.weight")]
    rules.append(TensorRule(f"{ours}.norm.weight", (f"{m}.norm.weight",), when="mamba_rms_norm"))
    rules.append(TensorRule(f"{ours}.conv1d.bias", (f"{m}.conv1d.bias",), when="use_conv_bias"))
    rules.append(TensorRule(f"{ours}.in_proj.bias", (f"{m}.in_proj.bias",), when="mamba_proj_bias"))
    rules.append(TensorRule(f"{ours}.out_proj.bias", (f"{m}.out_proj.bias",), when="projectors_bias"))
    return tuple(rules)


TENSORS = (
    TensorRule("embedding.weight", ("backbone.embeddings.weight",), "vocab"),
    TensorRule("layers.{layer}.input_norm.weight", (f"{L}.norm.weight",)),
    *mamba_tensors(f"{L}.mixer"),
    TensorRule("final_norm.weight", ("backbone.norm_f.weight",)),
    TensorRule("output.weight", ("lm_head.weight",), "vocab", unless="tie_word_embeddings"),
)


def _all_mamba(hf: dict) -> list[tuple[str, str]]:
    return [("mamba2", "none")] * hf["num_hidden_layers"]


def _render_all_mamba(pairs: list[tuple[str, str]]) -> dict:
    if any(p != ("mamba2", "none") for p in pairs):
        raise BridgeError(f"Mamba2ForCausalLM layers are all mamba2 mixers without MLP; the model has {pairs}")
    return {}


CONFIG = family_rules(
    "mamba2",
    (
        Field("vocab_size"),
        Field("hidden_size"),
        Field("num_hidden_layers"),
        LayerPattern((), _all_mamba, _render_all_mamba),
        Alias("num_heads", ("mamba_num_heads", "num_attention_heads", "num_key_value_heads"), 128),
        Alias("head_dim", ("mamba_head_dim", "head_dim"), 64),
        Alias("state_size", ("ssm_state_size",), 128),
        Expand(default=2),
        Alias("layer_norm_epsilon", ("rms_norm_eps",), 1e-5),
        Field("n_groups", 8),
        Field("conv_kernel", 4),
        Field("chunk_size", 256),
        Field("use_conv_bias", True),
        Alias("use_bias", ("mamba_proj_bias", "projectors_bias"), False),
        TimeStepLimit(),
        Field("tie_word_embeddings", False),
        Field("hidden_act", "silu"),
        Field("initializer_range", 0.1),
    ),
)

MAPPING = FamilyMapping(
    name="mamba2",
    hf_model_type="mamba2",
    tensors=TENSORS,
    config=CONFIG,
    description="Mamba-2 (SSD mixer in every layer, no attention, no MLP): Mamba-Codestral, state-spaces/mamba2",
)
