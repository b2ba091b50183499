"""Scaled dot-product attention with GQA, sliding windows, packed documents and attention sinks.

Backends:

- ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` with ``enable_gqa=True`` (K/V are never
  repeated). Plain causal or full attention maps to its fused kernels; a window or documents need an explicit
  boolean mask (``O(s^2)`` memory, usually the math kernel). It cannot express sinks.
- ``flex``: ``torch.nn.attention.flex_attention`` with a ``BlockMask`` for causal/window/documents, compiled
  on CUDA, eager elsewhere (torch has no FlexAttention backward on CPU, so on CPU it is forward-only).
  Sinks are applied exactly from flex's logsumexp: dropping the sink column of ``softmax([scores, sink])``
  scales the plain attention output by ``Z / (Z + e^sink) = sigmoid(lse - sink)``.
- ``reference``: plain torch in fp32 (fp64 for fp64 inputs) that materializes the scores; supports all
  features and is differentiable everywhere. Used by tests and as the CPU fallback.

There is no Triton attention kernel (``triton`` asked for by keyword or ``MCORE_KERNELS_BACKEND`` resolves
to the default below): the fused SDPA and FlexAttention kernels are the ones to beat on the GPU.

Default choice (no keyword, no ``MCORE_KERNELS_BACKEND``): on CUDA, ``sdpa`` for plain causal/full attention
(including GQA) and ``flex`` as soon as a window, documents or sinks are involved; elsewhere ``sdpa`` for
plain attention and ``reference`` otherwise (eager FlexAttention on CPU has no backward).
"""

from __future__ import annotations

import functools
import logging
import math
import os

import torch
import torch.nn.functional as F

from mcore.kernels import dispatch

logger = logging.getLogger("mcore.kernels")

SDPA = "sdpa"
FLEX = "flex"
_ATTENTION_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    softmax_scale: float | None = None,
    window_size: int | None = None,
    cu_seqlens: torch.Tensor | None = None,
    max_seqlen: int | None = None,
    sinks: torch.Tensor | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Attention over ``q [b, s, Hq, D]``, ``k, v [b, s_k, Hkv, D]`` (any strides); returns ``[b, s, Hq, D]``.

    Query head ``h`` attends with key/value head ``h // (Hq // Hkv)`` (grouped-query attention).

    Args:
        causal: query ``i`` sees keys ``j <= i``. Needs ``s_k == s``.
        softmax_scale: multiplies the scores; ``None`` means ``1 / sqrt(D)``.
        window_size: ``W >= 1``: query ``i`` sees keys ``i - W < j <= i`` (HF ``sliding_window``); needs
            ``causal=True``.
        cu_seqlens: int32 ``[n + 1]`` cumulative document lengths over the flattened ``b * s`` tokens, from 0 to
            ``b * s``, with a boundary at every multiple of ``s``; tokens never attend across documents.
            Its values are checked (and the flex block mask is built) on the host: pass it on the CPU to
            avoid a device sync (it may also live on ``q``'s device, at the cost of one sync per call).
        max_seqlen: optional upper bound on the longest document (checked; kernels that size launches from
            it may use it).
        sinks: ``[Hq]`` per-head logits that join the softmax denominator only (GPT-OSS sinks).
        backend: ``"sdpa"``, ``"flex"``, ``"reference"`` or ``"triton"``; ``None`` picks per the module doc.
    """
    _check_tensors(q, k, v, causal)
    b, s, n_heads, _ = q.shape
    softmax_scale = _check_scale(softmax_scale, q.shape[-1])
    if window_size is not None:
        if not isinstance(window_size, int) or isinstance(window_size, bool) or window_size < 1:
            raise ValueError(f"attention: window_size must be None or an int >= 1, got {window_size!r}")
        if not causal:
            raise ValueError(
                f"attention: window_size={window_size} means keys i - W < j <= i, which is causal; pass causal=True"
            )
    bounds = None if cu_seqlens is None else _check_cu_seqlens(cu_seqlens, q, b, s, k.shape[1])
    longest = s if bounds is None else max(hi - lo for lo, hi in zip(bounds, bounds[1:]))
    if max_seqlen is not None and (
        not isinstance(max_seqlen, int) or isinstance(max_seqlen, bool) or max_seqlen < longest
    ):
        raise ValueError(
            f"attention: max_seqlen must be an int >= the longest document ({longest} tokens), got {max_seqlen!r}"
        )
    if sinks is not None:
        _check_sinks(sinks, q, n_heads)

    name = _select_backend(q, k, v, sinks, backend, plain=window_size is None and cu_seqlens is None)
    if name == SDPA and sinks is not None:
        raise ValueError(
            "attention: the sdpa backend cannot add sinks to the softmax denominator; "
            "use backend='flex' (CUDA) or backend='reference'"
        )
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, sinks))
    if name == FLEX and q.device.type != "cuda" and needs_grad:
        raise ValueError(
            f"attention: the flex backend has no backward on {q.device.type} tensors (torch's FlexAttention "
            "backward needs CUDA); use backend='reference' or 'sdpa', or run under torch.no_grad()"
        )

    doc_ids = None if cu_seqlens is None else _document_ids(cu_seqlens.to(q.device, non_blocking=True), b, s)
    if name == SDPA:
        return _sdpa_attention(q, k, v, causal, softmax_scale, window_size, doc_ids)
    if name == FLEX:
        return _flex_attention(q, k, v, causal, softmax_scale, window_size, bounds, doc_ids, sinks)
    return reference_attention(q, k, v, causal, softmax_scale, window_size, doc_ids, sinks)


def _select_backend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sinks: torch.Tensor | None,
    backend: str | None,
    *,
    plain: bool,
) -> str:
    tensors = (q, k, v) if sinks is None else (q, k, v, sinks)
    requested = backend is not None or bool(os.environ.get("MCORE_KERNELS_BACKEND"))
    if requested:
        name = dispatch.choose("attention", *tensors, backend=backend, extra=(SDPA, FLEX))
        if name != dispatch.TRITON:
            return name
    if q.device.type == "cuda":
        name = SDPA if plain and sinks is None else FLEX
    else:
        name = SDPA if plain and sinks is None else dispatch.REFERENCE
    _log_default(name, q.device.type, plain, sinks is not None)
    return name


@functools.cache
def _log_default(name: str, device_type: str, plain: bool, has_sinks: bool) -> None:
    features = "plain attention" if plain and not has_sinks else "window/documents/sinks"
    logger.info("mcore.kernels.attention: using the %s backend (%s tensors, %s)", name, device_type, features)


def _document_ids(cu_seqlens: torch.Tensor, b: int, s: int) -> torch.Tensor:
    """``[b, s]`` index of the document of each token (token ``t`` is in document ``d`` iff cu[d] <= t < cu[d+1])."""
    tokens = torch.arange(b * s, device=cu_seqlens.device, dtype=torch.int32)
    return torch.searchsorted(cu_seqlens[1:].contiguous(), tokens, right=True).view(b, s)


def _allowed_mask(
    b: int, s: int, causal: bool, window_size: int | None, doc_ids: torch.Tensor | None, device: torch.device
) -> torch.Tensor | None:
    """Boolean ``[b or 1, s, s]``: True where query ``i`` may attend to key ``j``; None when nothing is masked."""
    if not causal and doc_ids is None:
        return None
    i = torch.arange(s, device=device)[:, None]
    j = torch.arange(s, device=device)[None, :]
    allowed = torch.ones(1, s, s, dtype=torch.bool, device=device)
    if causal:
        allowed = allowed & (j <= i)
    if window_size is not None:
        allowed = allowed & (j > i - window_size)
    if doc_ids is not None:
        allowed = allowed & (doc_ids[:, :, None] == doc_ids[:, None, :])
    return allowed


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    softmax_scale: float,
    window_size: int | None,
    doc_ids: torch.Tensor | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Plain-torch attention in fp32 (fp64 for fp64 inputs) that materializes ``[b, Hq, s, s_k]`` scores."""
    b, s, n_heads, head_dim = q.shape
    n_kv = k.shape[2]
    compute = torch.promote_types(q.dtype, torch.float32)
    # Split query heads into [kv head, group] so each group reads its K/V head without repeating it.
    qg = q.to(compute).reshape(b, s, n_kv, n_heads // n_kv, head_dim)
    scores = torch.einsum("bqhgd,bkhd->bhgqk", qg, k.to(compute)) * softmax_scale
    allowed = _allowed_mask(b, s, causal, window_size, doc_ids, q.device)
    if allowed is not None:
        scores = scores.masked_fill(~allowed[:, None, None], float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1)
    else:
        sink = sinks.to(compute).reshape(1, n_kv, n_heads // n_kv, 1, 1).expand(*scores.shape[:-1], 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    out = torch.einsum("bhgqk,bkhd->bqhgd", probs, v.to(compute))
    return out.reshape(b, s, n_heads, head_dim).to(q.dtype)


def _sdpa_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    softmax_scale: float,
    window_size: int | None,
    doc_ids: torch.Tensor | None,
) -> torch.Tensor:
    b, s = q.shape[:2]
    mask = None
    if window_size is not None or doc_ids is not None:
        mask = _allowed_mask(b, s, causal, window_size, doc_ids, q.device)[:, None]
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=mask,
        is_causal=causal and mask is None,
        scale=softmax_scale,
        enable_gqa=q.shape[2] != k.shape[2],
    )
    return out.transpose(1, 2)


@functools.cache
def _flex_kernel(device_type: str):
    from torch.nn.attention.flex_attention import flex_attention

    if device_type == "cuda":
        # Eager FlexAttention on CUDA materializes the scores; only the compiled kernel is fused.
        return torch.compile(flex_attention, dynamic=False)
    return flex_attention


def _flex_mask_mod(causal: bool, window_size: int | None, doc_ids: torch.Tensor | None):
    def mask_mod(batch, head, q_idx, kv_idx):
        allowed = q_idx >= 0
        if causal:
            allowed = allowed & (kv_idx <= q_idx)
        if window_size is not None:
            allowed = allowed & (kv_idx > q_idx - window_size)
        if doc_ids is not None:
            allowed = allowed & (doc_ids[batch, q_idx] == doc_ids[batch, kv_idx])
        return allowed

    return mask_mod


_FLEX_BLOCK = 128


def _block_bounds(n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """First and last token of each 128-token block, and whether the block runs past ``n`` (ragged)."""
    first = torch.arange(0, n, _FLEX_BLOCK)
    last = (first + _FLEX_BLOCK - 1).clamp(max=n - 1)
    return first, last, first + _FLEX_BLOCK > n


def _classify_blocks(
    b: int, s: int, causal: bool, window_size: int | None, bounds: list[int] | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(partial, full)`` bool ``[b or 1, s/128, s/128]`` on the CPU: which 128x128 blocks to visit, and which
    of those need no mask function (every pair allowed).

    Each block is judged from its first/last query and key token and, document ids being non-decreasing
    along the sequence, its first/last document; no dense ``s x s`` mask is built.
    """
    q_first, q_last, q_ragged = (t[:, None] for t in _block_bounds(s))
    k_first, k_last, k_ragged = (t[None, :] for t in _block_bounds(s))
    full = ~(q_ragged | k_ragged)[None]
    empty = torch.zeros_like(full)
    if causal:
        full = full & (k_last <= q_first)
        empty = empty | (k_first > q_last)
    if window_size is not None:
        full = full & (k_first > q_last - window_size)
        empty = empty | (k_last <= q_first - window_size)
    if bounds is not None:
        row_start = torch.arange(b)[:, None] * s
        ends = torch.tensor(bounds[1:])
        first_doc = torch.searchsorted(ends, row_start + q_first[:, 0], right=True)
        last_doc = torch.searchsorted(ends, row_start + q_last[:, 0], right=True)
        dq_lo, dq_hi = first_doc[:, :, None], last_doc[:, :, None]
        dk_lo, dk_hi = first_doc[:, None, :], last_doc[:, None, :]
        full = full & (dq_lo == dq_hi) & (dk_lo == dk_hi) & (dq_lo == dk_lo)
        # Document ranges that overlap share a document: every non-empty document between appears.
        empty = empty | (dk_hi < dq_lo) | (dk_lo > dq_hi)
    full = full & ~empty
    return ~full & ~empty, full


def _flex_block_mask(
    b: int,
    s: int,
    causal: bool,
    window_size: int | None,
    bounds: list[int] | None,
    doc_ids: torch.Tensor | None,
    device: torch.device,
):
    """The ``BlockMask`` of causal/window/document attention, built on the CPU and shipped in one copy.

    ``create_block_mask`` evaluates the mask at all ``s * s`` pairs, and ``BlockMask.from_kv_blocks`` on
    device tensors synchronizes (boolean indexing): milliseconds per call. On the CPU both are a few small
    ops; the finished index tensors then travel to the device in one pinned, non-blocking copy.
    """
    from torch.nn.attention import flex_attention as flex

    partial, full = _classify_blocks(b, s, causal, window_size, bounds)

    def ordered(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        blocks = blocks[:, None].to(torch.int32)
        indices = torch.argsort(blocks, dim=-1, descending=True, stable=True).to(torch.int32)
        return blocks.sum(dim=-1, dtype=torch.int32), indices

    mask = flex.BlockMask.from_kv_blocks(
        *ordered(partial),
        *ordered(full),
        BLOCK_SIZE=_FLEX_BLOCK,
        mask_mod=_flex_mask_mod(causal, window_size, doc_ids),
        seq_lengths=(s, s),
    )
    if device.type != "cpu":
        names = [name for name, value in vars(mask).items() if isinstance(value, torch.Tensor)]
        tensors = [getattr(mask, name) for name in names]
        packed = torch.cat([t.reshape(-1).to(torch.int32) for t in tensors]).pin_memory()
        packed = packed.to(device, non_blocking=True)
        for name, t, part in zip(names, tensors, packed.split([t.numel() for t in tensors])):
            setattr(mask, name, part.view(t.shape).to(t.dtype))
    return mask


def _flex_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    softmax_scale: float,
    window_size: int | None,
    bounds: list[int] | None,
    doc_ids: torch.Tensor | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    from torch.nn.attention import flex_attention as flex

    block_mask = None
    if causal or doc_ids is not None:
        block_mask = _flex_block_mask(q.shape[0], q.shape[1], causal, window_size, bounds, doc_ids, q.device)
    kernel = _flex_kernel(q.device.type)
    args = (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    kwargs = dict(block_mask=block_mask, scale=softmax_scale, enable_gqa=q.shape[2] != k.shape[2])
    if sinks is None:
        return kernel(*args, **kwargs).transpose(1, 2)
    if hasattr(flex, "AuxRequest"):
        out, aux = kernel(*args, **kwargs, return_aux=flex.AuxRequest(lse=True))
        lse = aux.lse
    else:  # torch < 2.9
        out, lse = kernel(*args, **kwargs, return_lse=True)
    # softmax over [scores, sink] without the sink column = softmax(scores) * Z / (Z + e^sink).
    keep = torch.sigmoid(lse - sinks.float()[None, :, None])
    return (out.float() * keep[..., None]).to(q.dtype).transpose(1, 2)


def _check_tensors(q: object, k: object, v: object, causal: object) -> None:
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
    if k.shape != v.shape:
        raise ValueError(f"attention: k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
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


def _check_scale(softmax_scale: object, head_dim: int) -> float:
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


def _check_cu_seqlens(cu_seqlens: object, q: torch.Tensor, b: int, s: int, s_k: int) -> list[int]:
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


def _check_sinks(sinks: object, q: torch.Tensor, n_heads: int) -> None:
    if not isinstance(sinks, torch.Tensor):
        raise TypeError(f"attention: sinks must be a tensor of shape [{n_heads}], got {type(sinks).__name__}")
    if not sinks.is_floating_point():
        raise TypeError(f"attention: sinks must be floating point (fp32), got {sinks.dtype}")
    if tuple(sinks.shape) != (n_heads,):
        raise ValueError(f"attention: sinks must have shape [Hq] = [{n_heads}], got {tuple(sinks.shape)}")
    if sinks.device != q.device:
        raise ValueError(f"attention: sinks must be on {q.device} with q, got {sinks.device}")
