"""The parameter-attribute protocol: typed helpers in ``mcore.parallel.param_attrs``, and no other module of
``packages/`` that names the attributes itself."""

from __future__ import annotations

import ast
import pathlib
import weakref

import pytest
import torch
from torch import nn

from mcore.parallel import param_attrs as pa

ROOT = pathlib.Path(__file__).resolve().parents[2]
PROTOCOL = {
    "tensor_parallel",
    "partition_dim",
    "partition_blocks",
    "sequence_parallel",
    "shared_embedding",
    "vocab_padded_dim",
    "main_grad",
    "mcore_fuse_wgrad",
    "mcore_wgrad_in_main_grad",
    "mcore_grad_ready_hook",
}
# Objects that carry attributes of the same names without being parameters (checkpoint metadata, resharding
# targets, modules and part contexts with their own settings, the parallel config and the planner's layouts).
NOT_PARAMETERS = {
    "self",
    "meta",
    "saved",
    "target",
    "spec",
    "split",
    "config",
    "cfg",
    "data",
    "model",
    "ctx",
    "context",
    "parallel",
    "layout",
    "lay",
}


def _protocol_uses(path: pathlib.Path) -> list[str]:
    uses = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id in ("getattr", "setattr", "hasattr", "delattr") and len(node.args) >= 2:
                name = node.args[1]
                if isinstance(name, ast.Constant) and name.value in PROTOCOL:
                    uses.append(f"{path.name}:{node.lineno}: {node.func.id}(..., {name.value!r})")
        elif isinstance(node, ast.Attribute) and node.attr in PROTOCOL:
            owner = node.value
            base = owner.id if isinstance(owner, ast.Name) else None
            if base not in NOT_PARAMETERS and not isinstance(owner, ast.Attribute):
                uses.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    return uses


def test_only_param_attrs_names_the_attributes():
    own = ROOT / "packages" / "mcore-parallel" / "src" / "mcore" / "parallel" / "param_attrs.py"
    uses = [u for f in sorted((ROOT / "packages").glob("*/src/**/*.py")) if f != own for u in _protocol_uses(f)]
    assert uses == [], "use the helpers of mcore.parallel.param_attrs"


def test_the_scan_finds_a_direct_use(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f(p):\n    p.main_grad.add_(1)\n    return getattr(p, 'shared_embedding', False)\n")
    assert len(_protocol_uses(bad)) == 2


def test_layout_helpers_round_trip():
    p = nn.Parameter(torch.zeros(6, 4))
    assert pa.tp_split(p) is None and not pa.is_tensor_parallel(p) and pa.vocab_padding(p) is None
    pa.set_tensor_parallel_attributes(p, tensor_parallel=True, partition_dim=0, partition_blocks=[8, 4])
    assert pa.tp_split(p) == pa.TensorParallelSplit(0, (8, 4)) and not pa.is_sequence_parallel(p)
    pa.mark_vocab_padded(p, 0, 5)
    pa.mark_shared_embedding(p, True)
    pa.mark_sequence_parallel(p, True)
    assert pa.vocab_padding(p) == (0, 5) and pa.is_shared_embedding(p) and pa.is_sequence_parallel(p)
    with pytest.raises(ValueError, match="needs its partition_dim"):
        pa.set_tensor_parallel_attributes(p, tensor_parallel=True)


def test_gradient_plumbing_follows_its_owner():
    p = nn.Parameter(torch.zeros(3))
    p.grad = torch.ones(3)
    assert pa.main_grad(p) is None and pa.accumulated_grad(p) is p.grad and pa.fused_wgrad_target(p) is None
    buffer = torch.zeros(3)
    pa.set_main_grad(p, buffer)
    assert pa.accumulated_grad(p) is buffer

    class Owner:
        pass

    owner, calls = Owner(), []
    pa.attach_gradient_plumbing(p, owner=owner, grad_ready_hook=calls.append, fuse_wgrad=True)
    assert pa.fused_wgrad_target(p) is buffer and pa.grad_ready_hook(p) is not None
    assert not pa.take_wgrad_in_main_grad(p)
    pa.mark_wgrad_in_main_grad(p)
    assert pa.take_wgrad_in_main_grad(p) and not pa.take_wgrad_in_main_grad(p)  # taking resets it
    ref = weakref.ref(owner)
    del owner
    assert ref() is None and pa.fused_wgrad_target(p) is None  # a dropped wrapper turns the fusion off
    pa.attach_gradient_plumbing(p, owner=Owner(), grad_ready_hook=calls.append, fuse_wgrad=False)
    assert pa.fused_wgrad_target(p) is None
