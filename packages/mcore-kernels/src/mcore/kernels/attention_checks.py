"""Input checks of :func:`mcore.kernels.attention`: one clear error per bad argument, before any launch."""

from __future__ import annotations

import math

import torch

_ATTENTION_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_tensors(q: object, k: object, v: object, causal: object) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"attention: {name} must be a tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"attention: {name} must be 4-D [b, s, heads, head_dim], got shape {tuple(t.shape)}")
    if q.dtype not in _ATTENTION_DTYPES:
        raise TypeError(f"attention: q dtype must be one of {_ATTENTION_DTYPES}, got {q.dtype}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"attention: q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"attention: q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(
            f"attention: k and v must agree on [b, s_k, heads] (only the head dim may differ), got "
            f"{tuple(k.shape)} and {tuple(v.shape)}"
        )
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"attention: batch sizes differ: q has {q.shape[0]}, k/v have {k.shape[0]}")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"attention: head dims differ: q has {q.shape[3]}, k/v have {k.shape[3]}")
    n_heads, n_kv = q.shape[2], k.shape[2]
    if n_kv == 0 or n_heads % n_kv != 0:
        raise ValueError(f"attention: query heads ({n_heads}) must be a multiple of key/value heads ({n_kv}) for GQA")
    if not isinstance(causal, bool):
        raise TypeError(f"attention: causal must be a bool, got {causal!r}")
    if causal and k.shape[1] != q.shape[1]:
        raise ValueError(
            f"attention: causal attention needs as many keys as queries, got s={q.shape[1]} and s_k={k.shape[1]}"
        )


def check_scale(softmax_scale: object, head_dim: int) -> float:
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if (
        not isinstance(softmax_scale, int | float)
        or isinstance(softmax_scale, bool)
        or not math.isfinite(softmax_scale)
        or softmax_scale <= 0
    ):
        raise ValueError(f"attention: softmax_scale must be None or a finite float > 0, got {softmax_scale!r}")
    return float(softmax_scale)


def check_cu_seqlens(cu_seqlens: object, q: torch.Tensor, b: int, s: int, s_k: int) -> list[int]:
    """Validate the document boundaries and return them as a list."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"attention: cu_seqlens must be an int32 tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype != torch.int32:
        raise TypeError(f"attention: cu_seqlens must be int32, got {cu_seqlens.dtype}; use cu_seqlens.int()")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(
            f"attention: cu_seqlens must be 1-D [n_docs + 1] with n_docs >= 1, got {tuple(cu_seqlens.shape)}"
        )
    if cu_seqlens.device not in (q.device, torch.device("cpu")):
        raise ValueError(f"attention: cu_seqlens must be on the CPU or on {q.device} with q, got {cu_seqlens.device}")
    if s_k != s:
        raise ValueError(f"attention: cu_seqlens needs as many keys as queries, got s={s} and s_k={s_k}")
    bounds = cu_seqlens.tolist()
    if bounds[0] != 0 or bounds[-1] != b * s:
        raise ValueError(
            f"attention: cu_seqlens must run from 0 to b * s = {b * s}, got first {bounds[0]} and last {bounds[-1]}"
        )
    lengths = [hi - lo for lo, hi in zip(bounds, bounds[1:])]
    if min(lengths) < 0:
        raise ValueError(f"attention: cu_seqlens must be non-decreasing, got {bounds}")
    missing = sorted(set(range(0, b * s + 1, s)) - set(bounds))
    if missing:
        raise ValueError(
            f"attention: cu_seqlens must have a boundary at every multiple of s = {s} (documents cannot cross "
            f"batch rows); missing {missing[:8]}"
        )
    return bounds


def check_sinks(sinks: object, q: torch.Tensor, n_heads: int) -> None:
    if not isinstance(sinks, torch.Tensor):
        raise TypeError(f"attention: sinks must be a tensor of shape [{n_heads}], got {type(sinks).__name__}")
    if not sinks.is_floating_point():
        raise TypeError(f"attention: sinks must be floating point (fp32), got {sinks.dtype}")
    if tuple(sinks.shape) != (n_heads,):
        raise ValueError(f"attention: sinks must have shape [Hq] = [{n_heads}], got {tuple(sinks.shape)}")
    if sinks.device != q.device:
        raise ValueError(f"attention: sinks must be on {q.device} with q, got {sinks.device}")


def check_flag(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"attention: {name} must be a bool, got {value!r}")


def check_window(window_size: object, causal: bool) -> None:
    if window_size is None:
        return
    if not isinstance(window_size, int) or isinstance(window_size, bool) or window_size < 1:
        raise ValueError(f"attention: window_size must be None or an int >= 1, got {window_size!r}")
    if not causal:
        raise ValueError(
            f"attention: window_size={window_size} means keys i - W < j <= i, which is causal; pass causal=True"
        )


def check_max_seqlen(max_seqlen: object, longest: int) -> None:
    if max_seqlen is not None and (
        not isinstance(max_seqlen, int) or isinstance(max_seqlen, bool) or max_seqlen < longest
    ):
        raise ValueError(
            f"attention: max_seqlen must be an int >= the longest document ({longest} tokens), got {max_seqlen!r}"
        )
