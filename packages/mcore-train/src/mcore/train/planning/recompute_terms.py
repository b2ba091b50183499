"""What ``train.recompute_modules`` (Megatron's ``--recompute-modules``) takes off a layer's saved activations
and adds to its backward, for the memory and time models.

The memory model (``memory.activation_parts_per_layer``) splits a layer's saved values per token into pieces; a
recomputed module drops these (what ``mcore.models`` discards, measured by ``tests/models/test_recompute_modules``):

- ``layernorm``: both norms' outputs (``2 x rep``; their inputs, the residual stream, stay);
- ``mla_up_proj`` (MLA): q, k and v (``(2 x score_width + attention_width) / tp``); the latents and the attention
  output (the output projection's input) stay;
- ``core_attn``: flash attention's fp32 log-sum-exp (q, k, v are the checkpoint's inputs and the output is the
  output projection's input, so they stay);
- ``mlp`` (dense layers): the MLP's hidden values; ``moe`` (MoE layers): everything the MoE layer keeps (routed
  rows, the experts' hidden values, the shared expert, dispatch buffers, router probabilities);
  ``shared_experts``: the shared expert's hidden values;
- ``moe_act``: nothing: mcore's experts never keep their activation (the memory model still counts it in the
  routed rows, ``3 x moe_ffn`` for gated experts; see the report of issue #17).

Recompute runs the module's forward again in backward (``recomputed_forward``); for ``moe`` that includes its two
forward all-to-alls. ``selective`` without a list keeps the memory model's validated formula for attention models;
MLA models always use these terms (with MLA's default, ``core_attn`` + ``mla_up_proj``).
"""

from __future__ import annotations

from typing import Any

from mcore.models.recompute import recomputes
from mcore.train.planning.layout import Layout
from mcore.train.planning.shape import ModelShape


def uses_module_terms(shape: ModelShape, layout: Layout) -> bool:
    """Whether the layout's recompute is priced by module (an explicit list, or MLA under ``selective``)."""
    return layout.recompute == "selective" and (layout.recompute_modules is not None or shape.is_mla)


def layout_recomputes(layout: Layout, module: str) -> bool:
    return recomputes(layout.recompute, layout.recompute_modules, module)


def dropped_per_token(shape: ModelShape, layout: Layout, pieces: dict[str, float]) -> tuple[float, float, bool]:
    """(values per token the attention part no longer keeps, the MLP part's, whether the log-sum-exp goes), from
    the memory model's ``pieces`` (``norm_output``; ``routed``, ``shared``, ``dispatch`` or ``dense``)."""
    attention = mlp = 0.0
    if layout_recomputes(layout, "layernorm"):  # each norm's output is the input its part's first linear keeps
        attention, mlp = attention + pieces["norm_output"], mlp + pieces["norm_output"]
    if shape.is_mla and layout_recomputes(layout, "mla_up_proj"):
        attention += (2 * shape.score_width() + shape.attention_width) / layout.tp
    if layout_recomputes(layout, "mlp"):
        mlp += pieces.get("dense", 0.0)
    if layout_recomputes(layout, "moe"):
        mlp += pieces.get("routed", 0.0) + pieces.get("shared", 0.0) + pieces.get("dispatch", 0.0)
    elif layout_recomputes(layout, "shared_experts"):
        mlp += pieces.get("shared", 0.0)
    return attention, mlp, layout_recomputes(layout, "core_attn")


def recomputed_forward(model: Any, index: int, cost: Any) -> None:
    """Add to ``cost``'s backward the forward of what layer ``index`` recomputes (module terms only); ``model`` is
    the ``time_model.TimeModel`` pricing it, ``cost`` its ``OpCost`` (not imported: time_model imports this)."""
    s, lay = model.shape, model.layout
    new_cost = type(cost)
    again = new_cost()
    linears = {lin.name: lin for lin in s.attention_linears()}
    if s.is_mla and layout_recomputes(lay, "mla_up_proj"):
        model._linears(again, [linears[n] for n in ("q_up", "q", "kv_up") if n in linears], model.tokens)
    if layout_recomputes(lay, "core_attn"):
        attention = new_cost()
        model._attention(attention, index)
        again.forward["attention"] = attention.forward.get("attention", 0.0)
    moe = s.is_moe_layer(index)
    if not moe and layout_recomputes(lay, "mlp"):
        model._linears(again, s.dense_mlp_linears(), model.tokens)
    if moe and layout_recomputes(lay, "moe"):
        model._linears(again, [lin for lin in s.layer_linears(index) if lin.name not in linears], model.tokens)
        model._experts(again)
        model._ep_comm(again)
    elif moe and s.shared_ffn and layout_recomputes(lay, "shared_experts"):
        model._linears(again, s.dense_mlp_linears(s.shared_ffn), model.tokens)
    if layout_recomputes(lay, "layernorm"):  # two norms: read and write the hidden states of each
        rep = s.hidden / lay.tp if lay.sequence_parallel else s.hidden
        again.add("F", "memory", model.gpu.memory_seconds(4 * rep * model.tokens * model.dtype))
    for key, seconds in again.forward.items():
        cost.add("B", key, seconds)
