"""``recompute_modules`` on the hybrid families: Mamba-2's core recomputes only when ``mamba_core`` is listed (or
with no list), ``layernorm`` / ``mlp`` / ``core_attn`` apply to the hybrid layers that have them; each list gives
the loss and every gradient of the run without recompute bit for bit (fp32 CPU) and keeps fewer bytes for
backward (saved-tensor hooks, as tests/models/test_recompute_modules.py counts them)."""

from __future__ import annotations

import pytest

from mcore.models.families import get_config
from tests.models.test_recompute_modules import _assert_same, _run

CONFIGS = {
    "nemotron_h": get_config("nemotron_h-tiny"),  # M - * M: Mamba, MLP and attention layers
    "nemotron_h_moe": get_config("nemotron_h-moe-tiny"),  # M E * E -
    "falcon_h1": get_config("falcon_h1-tiny"),  # attention and Mamba side by side, then a gated MLP
    "falcon_h1_unit_in": get_config("falcon_h1-tiny", attention_in_multiplier=1.0),  # the released sizes' value
    "mamba2": get_config("mamba2-tiny"),  # Mamba layers only
}
# what each family has to recompute (the other names are accepted and change nothing)
HAS = {
    "nemotron_h": ("mamba_core", "layernorm", "mlp", "core_attn"),
    "nemotron_h_moe": ("mamba_core", "layernorm", "mlp", "core_attn", "moe", "shared_experts"),
    "falcon_h1": ("mamba_core", "layernorm", "mlp", "core_attn"),
    "falcon_h1_unit_in": ("mamba_core", "layernorm", "mlp", "core_attn"),
    "mamba2": ("mamba_core", "layernorm"),
}


@pytest.fixture(scope="module")
def baseline():
    return {name: _run(config, None, recompute=None) for name, config in CONFIGS.items()}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_each_module_keeps_gradients_and_saves_bytes(baseline, name):
    ref = baseline[name]
    for module in HAS[name]:
        got = _run(CONFIGS[name], [module])
        _assert_same(ref, got)
        assert got[2] < ref[2], (name, module, got[2], ref[2])


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_a_list_without_mamba_core_keeps_the_core(baseline, name):
    """Before the name existed, any selective run recomputed the Mamba core whatever the list said."""
    others = [m for m in HAS[name] if m != "mamba_core"]
    without = _run(CONFIGS[name], others)
    with_core = _run(CONFIGS[name], [*others, "mamba_core"])
    _assert_same(baseline[name], without)
    _assert_same(baseline[name], with_core)
    assert with_core[2] < without[2]


def test_names_a_model_does_not_have_change_nothing(baseline):
    """A pure Mamba-2 model has no MLP and no attention: mlp and core_attn are accepted and keep every tensor."""
    got = _run(CONFIGS["mamba2"], ["mlp", "core_attn"])
    _assert_same(baseline["mamba2"], got)
    assert got[2] == baseline["mamba2"][2]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_default_selective_is_the_mamba_core_plus_attention_core(baseline, name):
    assert _run(CONFIGS[name], None)[2] == _run(CONFIGS[name], ["core_attn", "mla_up_proj", "mamba_core"])[2]


def test_all_together(baseline):
    for name in ("nemotron_h", "falcon_h1_unit_in"):
        got = _run(CONFIGS[name], list(HAS[name]))
        _assert_same(baseline[name], got)
        singles = [baseline[name][2] - _run(CONFIGS[name], [m])[2] for m in HAS[name]]
        assert got[2] < baseline[name][2] - max(singles), name  # the modules' savings add up
