"""One table-driven renaming of a Hugging Face state dict into our parameter names, for the per-family test adapters.

A family is described as data: where HF keeps its embedding, final norm and layers (:class:`ModelNames`), and for
each layer a :class:`LayerTable` of prefix renames (the longest matching HF prefix wins, so rows need no order),
fusions (``q_proj``/``k_proj``/``v_proj`` into our ``qkv``, ``gate_proj``/``up_proj`` into our ``gate_up``, weights
and biases alike) and conversions of single tensors (layout changes). The sources of a fusion or a conversion are
not renamed besides. An HF tensor that no row names is dropped; ``load_hf_weights`` then fails on the parameter it
leaves uncovered (and on any renamed tensor no parameter takes), so a slip in a table is loud.

Written from Hugging Face's module layout, independently of ``mcore.bridge`` (the layer under test's parity must
not depend on the layer above it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from mcore.models.config import TransformerConfig

Rows = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class LayerTable:
    """How the tensors of one HF decoder layer (names relative to ``<prefix>.layers.<i>.``) become ours."""

    # (HF prefix, our prefix): ``self_attn.o_proj.`` -> ``attention.out_proj.`` renames its weight and bias
    renames: Rows = ()
    # (HF attention prefix, ours): ``{q,k,v}_proj.{weight,bias}`` there -> ``qkv.{weight,bias}`` here
    qkv: Rows = ()
    # (HF MLP prefix, ours): ``{gate,up}_proj.{weight,bias}`` there -> ``gate_up.{weight,bias}`` here
    gate_up: Rows = ()
    # (HF name, our name, conversion) for tensors whose layout differs from ours
    converts: tuple[tuple[str, str, Callable[[torch.Tensor], torch.Tensor]], ...] = ()


@dataclass(frozen=True)
class ModelNames:
    """Where an HF causal LM keeps the tensors outside its layers (``lm_head.weight`` is the output layer)."""

    prefix: str = "model"
    embedding: str = "embed_tokens"
    final_norm: str = "norm"


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config: TransformerConfig) -> torch.Tensor:
    """Our fused QKV rows (weight or bias): for each KV head, its query heads' rows, then its key's and value's."""
    groups, d = config.num_key_value_heads, config.head_dim
    rest = q.shape[1:]
    q = q.reshape(groups, config.query_heads_per_kv_head * d, *rest)
    return torch.cat([q, k.reshape(groups, d, *rest), v.reshape(groups, d, *rest)], dim=1).reshape(-1, *rest)


def to_mcore_state(
    hf_state: dict[str, torch.Tensor],
    config: TransformerConfig,
    layer_table: LayerTable | Callable[[int], LayerTable],
    names: ModelNames = ModelNames(),
) -> dict[str, torch.Tensor]:
    """``hf_state`` (a state dict, or HF gradients keyed alike) under our names; ``layer_table`` is one table for
    every layer or ``i -> table`` for families whose layers differ (hybrids)."""
    p = names.prefix
    out = {
        "embedding.weight": hf_state[f"{p}.{names.embedding}.weight"],
        "final_norm.weight": hf_state[f"{p}.{names.final_norm}.weight"],
    }
    if not config.tie_word_embeddings and "lm_head.weight" in hf_state:
        out["output.weight"] = hf_state["lm_head.weight"]
    for i in range(config.num_hidden_layers):
        table = layer_table(i) if callable(layer_table) else layer_table
        hf = f"{p}.layers.{i}."
        layer = {name[len(hf) :]: t for name, t in hf_state.items() if name.startswith(hf)}
        out.update({f"layers.{i}.{name}": t for name, t in _layer_state(layer, table, config).items()})
    return out


def _layer_state(layer: dict[str, torch.Tensor], table: LayerTable, config: TransformerConfig):
    out: dict[str, torch.Tensor] = {}
    used: set[str] = set()
    fusions = [(src, dst + "qkv", ("q", "k", "v")) for src, dst in table.qkv]
    fusions += [(src, dst + "gate_up", ("gate", "up")) for src, dst in table.gate_up]
    for src, dst, parts in fusions:
        for kind in ("weight", "bias"):
            sources = [f"{src}{part}_proj.{kind}" for part in parts]
            if sources[0] not in layer:
                continue
            tensors = [layer[s] for s in sources]
            out[f"{dst}.{kind}"] = fuse_qkv(*tensors, config) if len(parts) == 3 else torch.cat(tensors, dim=0)
            used.update(sources)
    for src, dst, convert in table.converts:
        if src in layer:
            out[dst] = convert(layer[src])
            used.add(src)
    for name, tensor in layer.items():
        matches = [(hf, ours) for hf, ours in table.renames if name.startswith(hf)]
        if name not in used and matches:
            hf, ours = max(matches, key=lambda row: len(row[0]))
            out[ours + name[len(hf) :]] = tensor
    return out


def count_parts(*, mixer: tuple[str, ...], mlp: tuple[str, ...]) -> Callable[..., tuple[int, int]]:
    """An adapter's ``part_parameters``: HF parameters whose name holds one of ``mixer`` / ``mlp``, counted."""

    def parts(model: torch.nn.Module, config: TransformerConfig) -> tuple[int, int]:
        params = dict(model.named_parameters())
        return (
            sum(p.numel() for n, p in params.items() if any(m in n for m in mixer)),
            sum(p.numel() for n, p in params.items() if any(m in n for m in mlp)),
        )

    return parts
