"""``MCORE_ATTENTION_BACKEND``: attention's backend for a whole model, leaving the other ops' choice alone."""

from __future__ import annotations

import importlib

import pytest
import torch

from mcore.kernels import attention

attn_module = importlib.import_module("mcore.kernels.attention")


def _qkv():
    torch.manual_seed(0)
    return torch.randn(2, 8, 4, 16), torch.randn(2, 8, 2, 16), torch.randn(2, 8, 2, 16)


@pytest.fixture
def env(monkeypatch):
    monkeypatch.delenv("MCORE_KERNELS_BACKEND", raising=False)
    monkeypatch.delenv("MCORE_ATTENTION_BACKEND", raising=False)
    return monkeypatch


def test_the_variable_picks_the_backend_and_the_keyword_wins(env):
    q, k, v = _qkv()
    select = attn_module._select_backend
    assert select(q, k, v, None, None, plain=True) == "sdpa"  # the default on CPU
    env.setenv("MCORE_ATTENTION_BACKEND", "reference")
    assert select(q, k, v, None, None, plain=True) == "reference"
    assert select(q, k, v, None, "sdpa", plain=True) == "sdpa"
    env.setenv("MCORE_ATTENTION_BACKEND", "sdpa")
    assert select(q, k, v, None, None, plain=False) == "sdpa"  # packed documents through SDPA's dense mask
    env.setenv("MCORE_KERNELS_BACKEND", "reference")  # every op's variable comes after attention's own
    assert select(q, k, v, None, None, plain=True) == "sdpa"
    env.setenv("MCORE_ATTENTION_BACKEND", "auto")
    assert select(q, k, v, None, None, plain=True) == "reference"
    env.delenv("MCORE_KERNELS_BACKEND")
    assert select(q, k, v, None, None, plain=False) == "reference"  # auto: the default choice


def test_the_variable_reaches_the_call(env):
    q, k, v = _qkv()
    sinks = torch.randn(4)
    expected = attention(q, k, v, sinks=sinks)
    env.setenv("MCORE_ATTENTION_BACKEND", "sdpa")
    with pytest.raises(ValueError, match="the sdpa backend cannot add sinks"):
        attention(q, k, v, sinks=sinks)
    env.setenv("MCORE_ATTENTION_BACKEND", "reference")
    torch.testing.assert_close(attention(q, k, v, sinks=sinks), expected)


def test_a_bad_value_names_the_variable_and_the_choices(env):
    q, k, v = _qkv()
    env.setenv("MCORE_ATTENTION_BACKEND", "flash")
    with pytest.raises(ValueError, match=r"MCORE_ATTENTION_BACKEND='flash' is not a backend; expected one of"):
        attention(q, k, v)
