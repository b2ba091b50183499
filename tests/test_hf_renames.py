"""The table-driven HF -> mcore renaming that every family's parity test loads its weights through
(``tests/helpers/hf_renames.py``): prefix rows, fusions, conversions, and what is left out."""

from __future__ import annotations

import pytest
import torch

from mcore.models.families import get_config
from tests.helpers.hf_renames import LayerTable, ModelNames, count_parts, fuse_qkv, to_mcore_state

# 11 layers, so that layer 1's prefix is also the start of layer 10's name
CONFIG = get_config("llama-tiny", num_hidden_layers=11)
HEADS, KV_HEADS, D, H = CONFIG.num_attention_heads, CONFIG.num_key_value_heads, CONFIG.head_dim, CONFIG.hidden_size


def _state(layers=range(11), **layer_tensors):
    """Random globals, and ``layer_tensors`` (names relative to a layer) in each of ``layers``, all different."""
    state = {"model.embed_tokens.weight": torch.randn(8, H), "model.norm.weight": torch.randn(H)}
    state["lm_head.weight"] = torch.randn(8, H)
    for i in layers:
        state.update({f"model.layers.{i}.{n}": torch.randn(shape) for n, shape in layer_tensors.items()})
    return state


@pytest.mark.parametrize("reverse", [False, True])
def test_the_longest_matching_prefix_wins_whatever_the_row_order(reverse):
    rows = (("mixer.", "mlp."), ("mixer.up_proj.", "mlp.up."), ("mixer.gate.weight", "mlp.router.weight"))
    table = LayerTable(renames=rows[::-1] if reverse else rows)
    state = _state(**{"mixer.up_proj.weight": (4, H), "mixer.gate.weight": (2, H), "mixer.down_proj.weight": (H, 4)})
    out = to_mcore_state(state, CONFIG, table)
    for i in (1, 10):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        assert out[ours + "mlp.up.weight"] is state[hf + "mixer.up_proj.weight"]
        assert out[ours + "mlp.router.weight"] is state[hf + "mixer.gate.weight"]
        assert out[ours + "mlp.down_proj.weight"] is state[hf + "mixer.down_proj.weight"]
    assert out["embedding.weight"] is state["model.embed_tokens.weight"]
    assert out["final_norm.weight"] is state["model.norm.weight"] and out["output.weight"] is state["lm_head.weight"]
    assert len(out) == 3 + 3 * 11


def test_fusions_take_weights_and_biases_and_their_sources_are_not_renamed_besides():
    shapes = {
        f"attn.{n}_proj.weight": (rows, H) for n, rows in (("q", HEADS * D), ("k", KV_HEADS * D), ("v", KV_HEADS * D))
    }
    shapes |= {f"attn.{n}_proj.bias": (rows[0],) for n, rows in zip("qkv", shapes.values())}
    shapes |= {"ffn.gate_proj.weight": (6, H), "ffn.up_proj.weight": (6, H), "attn.o_proj.weight": (H, HEADS * D)}
    table = LayerTable(renames=(("attn.", "attention."),), qkv=(("attn.", "attention."),), gate_up=(("ffn.", "mlp."),))
    state = _state(layers=[3], **shapes)
    out = to_mcore_state(state, CONFIG, table)
    hf, ours = "model.layers.3.", "layers.3."
    assert sorted(n for n in out if n.startswith(ours)) == [
        ours + n
        for n in ("attention.o_proj.weight", "attention.qkv.bias", "attention.qkv.weight", "mlp.gate_up.weight")
    ]
    for kind in ("weight", "bias"):
        q, k, v = (state[f"{hf}attn.{n}_proj.{kind}"] for n in "qkv")
        # for each KV head g: its query heads' rows, then k_g's, then v_g's
        per_group = HEADS // KV_HEADS * D
        want = torch.cat(
            [
                torch.cat([q[g * per_group : (g + 1) * per_group], k[g * D : (g + 1) * D], v[g * D : (g + 1) * D]])
                for g in range(KV_HEADS)
            ]
        )
        assert torch.equal(out[f"{ours}attention.qkv.{kind}"], want)
        assert torch.equal(fuse_qkv(q, k, v, CONFIG), want)
    gate_up = torch.cat([state[hf + "ffn.gate_proj.weight"], state[hf + "ffn.up_proj.weight"]])
    assert torch.equal(out[ours + "mlp.gate_up.weight"], gate_up)


def test_conversions_unnamed_tensors_and_the_other_names():
    table = LayerTable(
        renames=(("experts.", "moe."),),
        converts=(("experts.down_proj", "moe.down", lambda t: t.transpose(1, 2)),),
    )
    state = _state(layers=[0], **{"experts.down_proj": (2, 3, 5), "experts.gate": (2,), "stray.weight": (4,)})
    state["backbone.embeddings.weight"] = state.pop("model.embed_tokens.weight")
    state["backbone.norm_f.weight"] = state.pop("model.norm.weight")
    state = {k.replace("model.layers.", "backbone.layers."): v for k, v in state.items()}
    tied = get_config("llama-tiny", num_hidden_layers=1, tie_word_embeddings=True)
    out = to_mcore_state(state, tied, table, ModelNames("backbone", "embeddings", "norm_f"))
    assert sorted(out) == ["embedding.weight", "final_norm.weight", "layers.0.moe.down", "layers.0.moe.gate"]
    assert torch.equal(out["layers.0.moe.down"], state["backbone.layers.0.experts.down_proj"].transpose(1, 2))
    untied = get_config("llama-tiny", num_hidden_layers=1)
    assert "output.weight" in to_mcore_state(state, untied, table, ModelNames("backbone", "embeddings", "norm_f"))


def test_count_parts():
    model = torch.nn.ModuleDict(
        {
            "a": torch.nn.ModuleDict({"self_attn": torch.nn.Linear(3, 2)}),
            "b": torch.nn.ModuleDict({"mlp": torch.nn.Linear(4, 5)}),
        }
    )
    assert count_parts(mixer=(".self_attn.",), mlp=(".mlp.",))(model, CONFIG) == (8, 25)
    assert count_parts(mixer=(".self_attn.", ".mlp."), mlp=())(model, CONFIG) == (33, 0)
