"""The exact, per-tensor operations between Hugging Face and mcore layouts (no arithmetic, only data movement).

mcore fuses the Q/K/V projections grouped per KV head: for each KV head ``g`` the rows are
``[q heads of group g; k_g; v_g]`` (docs/architecture.md), and fuses the MLP input projections as ``[gate; up]``.
Embedding and output rows are padded with zeros to the padded vocabulary size (mcore-train's reader drops them
again on export). Every function here only
concatenates, slices or reshapes, so the round trip is bit-exact in any dtype.
"""

from __future__ import annotations

import torch

from mcore.bridge import stacked_experts
from mcore.bridge.stacked_experts import STACKED_OPS


def _check_rows(name: str, tensor: torch.Tensor, rows: int) -> None:
    if tensor.shape[0] != rows:
        raise ValueError(f"{name} has {tensor.shape[0]} rows, expected {rows} (shape {list(tensor.shape)})")


def fuse_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, num_heads: int, num_kv_heads: int, head_dim: int
) -> torch.Tensor:
    """HF ``q_proj, k_proj, v_proj`` (weights ``[rows, in]`` or biases ``[rows]``) -> mcore grouped ``qkv``."""
    per_group = num_heads // num_kv_heads
    _check_rows("q", q, num_heads * head_dim)
    _check_rows("k", k, num_kv_heads * head_dim)
    _check_rows("v", v, num_kv_heads * head_dim)
    rest = tuple(q.shape[1:])
    grouped = torch.cat(
        [
            q.reshape(num_kv_heads, per_group * head_dim, *rest),
            k.reshape(num_kv_heads, head_dim, *rest),
            v.reshape(num_kv_heads, head_dim, *rest),
        ],
        dim=1,
    )
    return grouped.reshape(num_kv_heads * (per_group + 2) * head_dim, *rest)


def split_qkv(
    qkv: torch.Tensor, *, num_heads: int, num_kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`fuse_qkv`: mcore ``qkv`` -> contiguous HF ``(q, k, v)``."""
    per_group = num_heads // num_kv_heads
    _check_rows("qkv", qkv, num_kv_heads * (per_group + 2) * head_dim)
    rest = tuple(qkv.shape[1:])
    grouped = qkv.reshape(num_kv_heads, (per_group + 2) * head_dim, *rest)
    q, k, v = grouped.split([per_group * head_dim, head_dim, head_dim], dim=1)
    return (
        q.reshape(num_heads * head_dim, *rest),
        k.reshape(num_kv_heads * head_dim, *rest),
        v.reshape(num_kv_heads * head_dim, *rest),
    )


def fuse_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """HF ``gate_proj, up_proj`` -> mcore ``gate_up`` = ``[gate; up]`` along dim 0."""
    if gate.shape != up.shape:
        raise ValueError(f"gate {list(gate.shape)} and up {list(up.shape)} must have the same shape")
    return torch.cat([gate, up], dim=0)


def split_gate_up(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`fuse_gate_up` (views, contiguous because they are whole row ranges)."""
    if gate_up.shape[0] % 2:
        raise ValueError(f"gate_up has an odd number of rows ({gate_up.shape[0]}); expected [gate; up]")
    gate, up = gate_up.chunk(2, dim=0)
    return gate, up


def pad_vocab(weight: torch.Tensor, padded_rows: int) -> torch.Tensor:
    """Append zero rows up to ``padded_rows`` (padding rows are never indexed and are masked from the loss)."""
    if padded_rows < weight.shape[0]:
        raise ValueError(f"cannot pad {weight.shape[0]} vocabulary rows down to {padded_rows}")
    if padded_rows == weight.shape[0]:
        return weight
    out = weight.new_zeros((padded_rows, *weight.shape[1:]))
    out[: weight.shape[0]] = weight
    return out


def to_mcore(
    op: str,
    inputs: list[torch.Tensor],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    padded_rows: int | None,
) -> torch.Tensor:
    """Apply a mapping operation HF -> mcore (``padded_rows``: full padded vocabulary for ``vocab``)."""
    if op == "qkv":
        return fuse_qkv(*inputs, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim)
    if op == "gate_up":
        return fuse_gate_up(*inputs)
    if op == "vocab":
        return pad_vocab(inputs[0], padded_rows)
    if op == "copy":
        return inputs[0]
    if op in STACKED_OPS:
        return stacked_experts.to_mcore(op, inputs[0])
    if op == "experts":
        return torch.stack(inputs)
    if op == "experts_gate_up":
        experts = len(inputs) // 2
        return torch.stack([fuse_gate_up(g, u) for g, u in zip(inputs[:experts], inputs[experts:])])
    raise ValueError(f"unknown mapping op {op!r}")


def to_hf(op: str, tensor: torch.Tensor, *, num_heads: int, num_kv_heads: int, head_dim: int) -> list[torch.Tensor]:
    """Invert :func:`to_mcore` for an unpadded mcore tensor: the HF tensors in rule order."""
    if op == "qkv":
        return list(split_qkv(tensor, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim))
    if op == "gate_up":
        return list(split_gate_up(tensor))
    if op in ("vocab", "copy"):
        return [tensor]
    if op in STACKED_OPS:
        return [stacked_experts.to_hf(op, tensor)]
    if op == "experts":
        return [t.contiguous() for t in tensor.unbind(0)]
    if op == "experts_gate_up":
        pairs = [split_gate_up(t) for t in tensor.unbind(0)]
        return [g.contiguous() for g, _ in pairs] + [u.contiguous() for _, u in pairs]
    raise ValueError(f"unknown mapping op {op!r}")
