"""Registering a family is all it takes to put it under every per-family test.

A throwaway family (Ministral, which mcore does not ship) is written as two small modules, one for mcore-models
and one for mcore-bridge (``tests/helpers/throwaway/``), and registered by a pytest plugin before collection. The
per-family tests, run in a fresh pytest with only that plugin added, then include it (HF parity, accounting, preset
validation, generation, config translation and round trip, conversion and verification, bad input) and pass; no
test table was edited for it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

from mcore.models.families import register_family, unregister_family

ROOT = Path(__file__).resolve().parent.parent
PER_FAMILY_FILES = [
    "tests/models/test_hf_parity.py",
    "tests/models/test_accounting.py",
    "tests/models/test_config.py",
    "tests/models/test_generate.py",
    "tests/bridge/test_config_translation.py",
    "tests/bridge/test_api.py",
    "tests/bridge/test_verify.py",
    "tests/bridge/test_bad_input.py",
]
# The cases the throwaway family must get (test function -> parameter id containing the family).
EXPECTED = {
    "test_logits_loss_and_grads_equal_hf",
    "test_parameter_count_equals_hf",
    "test_every_preset_is_a_valid_hf_config_with_the_same_fields",
    "test_greedy_equals_hf_generate",
    "test_round_trip_returns_the_original_config",
    "test_every_transformer_config_field_is_set_by_exactly_one_rule",
    "test_fresh_export_describes_the_same_model_to_transformers",
    "test_load_hf_into_gives_transformers_logits",
    "test_every_family_verifies",
    "test_every_family_names_a_missing_and_an_extra_tensor",
}


def test_a_registered_family_gets_every_per_family_test():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1"}
    argv = [sys.executable, "-m", "pytest", "-p", "tests.helpers.throwaway.plugin", *PER_FAMILY_FILES]
    argv += ["-k", "ministral", "-q", "-rA", "-p", "no:cacheprovider"]
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    passed = set(re.findall(r"^PASSED \S+::(\w+)\[[^\]]*ministral[^\]]*\]", out, flags=re.M))
    assert passed >= EXPECTED, f"missing: {sorted(EXPECTED - passed)}\n{out[-3000:]}"


def test_a_family_without_an_hf_reference_fails_its_tests():
    from tests.helpers.families import hf_classes

    module = types.SimpleNamespace(
        FAMILY="nohf",
        HF_ARCHITECTURE="NoSuchModelForCausalLM",
        DEFAULTS={"model_type": "nohf", "vocab_size": 64},
        PRESETS={"nohf-tiny": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)},
    )
    register_family(module)
    try:
        with pytest.raises(pytest.fail.Exception, match="NoSuchModelForCausalLM"):
            hf_classes("nohf")
    finally:
        unregister_family("nohf")


SIZES = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, vocab_size=64)


def test_register_family_refuses_an_incomplete_or_clashing_family():
    base = dict(FAMILY="x1", HF_ARCHITECTURE="LlamaForCausalLM", DEFAULTS={"model_type": "x1"})
    with pytest.raises(ValueError, match="needs a 'x1-tiny' preset"):
        register_family(types.SimpleNamespace(**base, PRESETS={}))
    with pytest.raises(ValueError, match="already belong to other families"):
        register_family(types.SimpleNamespace(**base, PRESETS={"llama-tiny": {}, "x1-tiny": {}}))
    with pytest.raises(ValueError, match="preset 'x1-tiny' of 'x1' is invalid.*hidden_size"):
        register_family(types.SimpleNamespace(**base, PRESETS={"x1-tiny": {**SIZES, "hidden_size": 0}}))
    with pytest.raises(ValueError, match="already registered"):
        register_family(types.SimpleNamespace(**{**base, "FAMILY": "llama"}, PRESETS={"llama-x": {}}))
