"""The torch backends of :func:`mcore.kernels.attention`: SDPA, FlexAttention and the plain-torch reference.

- ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` with ``enable_gqa=True`` (K/V are never
  repeated). Plain causal or full attention maps to its fused kernels; a window or documents need an explicit
  boolean mask (``O(s^2)`` memory, usually the math kernel). It cannot express sinks nor return the LSE.
- ``flex``: ``torch.nn.attention.flex_attention`` with a ``BlockMask`` for causal/window/documents, compiled
  on CUDA, eager elsewhere (torch has no FlexAttention backward on CPU, so on CPU it is forward-only).
  Sinks are applied exactly from flex's logsumexp: dropping the sink column of ``softmax([scores, sink])``
  scales the plain attention output by ``Z / (Z + e^sink) = sigmoid(lse - sink)``.
- ``reference``: plain torch in fp32 (fp64 for fp64 inputs) that materializes the scores; supports all
  features and is differentiable everywhere (the LSE too). Used by tests and as the CPU fallback.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


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
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch attention in fp32 (fp64 for fp64 inputs) that materializes ``[b, Hq, s, s_k]`` scores.

    With ``return_lse`` also the differentiable ``[b, s, Hq]`` fp32 log-sum-exp of each row (sink included).
    """
    b, s, n_heads, head_dim = q.shape
    n_kv = k.shape[2]
    compute = torch.promote_types(q.dtype, torch.float32)
    # Split query heads into [kv head, group] so each group reads its K/V head without repeating it.
    qg = q.to(compute).reshape(b, s, n_kv, n_heads // n_kv, head_dim)
    scores = torch.einsum("bqhgd,bkhd->bhgqk", qg, k.to(compute)) * softmax_scale
    allowed = _allowed_mask(b, s, causal, window_size, doc_ids, q.device)
    if allowed is not None:
        scores = scores.masked_fill(~allowed[:, None, None], float("-inf"))
    if sinks is not None:
        sink = sinks.to(compute).reshape(1, n_kv, n_heads // n_kv, 1, 1).expand(*scores.shape[:-1], 1)
        scores = torch.cat([scores, sink], dim=-1)
    probs = torch.softmax(scores, dim=-1)
    if sinks is not None:
        probs = probs[..., :-1]
    out = torch.einsum("bhgqk,bkhd->bqhgd", probs, v.to(compute))
    out = out.reshape(b, s, n_heads, v.shape[-1]).to(q.dtype)
    if not return_lse:
        return out
    lse = torch.logsumexp(scores, dim=-1).permute(0, 3, 1, 2).reshape(b, s, n_heads)
    return out, lse.float()


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


@functools.lru_cache(maxsize=16)
def _cached_block_mask(b: int, s: int, causal: bool, window_size: int | None, bounds: tuple | None, device: str):
    """:func:`_flex_block_mask` once per layout: every layer of a step (and every step of a fixed layout) shares
    one ``BlockMask``, so the mask is not rebuilt and shipped per call (the compiled kernel sees the same one)."""
    device = torch.device(device)
    doc_ids = None
    if bounds is not None:
        doc_ids = _document_ids(torch.tensor(bounds, dtype=torch.int32).to(device, non_blocking=True), b, s)
    return _flex_block_mask(b, s, causal, window_size, None if bounds is None else list(bounds), doc_ids, device)


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
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """FlexAttention; with ``return_lse`` also ``[b, s, Hq]`` fp32 (sink included), as far as torch's flex
    differentiates its logsumexp."""
    from torch.nn.attention import flex_attention as flex

    block_mask = None
    if causal or doc_ids is not None:
        bounds_key = None if bounds is None else tuple(bounds)
        block_mask = _cached_block_mask(q.shape[0], q.shape[1], causal, window_size, bounds_key, str(q.device))
    kernel = _flex_kernel(q.device.type)
    args = (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    kwargs = dict(block_mask=block_mask, scale=softmax_scale, enable_gqa=q.shape[2] != k.shape[2])
    if sinks is None and not return_lse:
        return kernel(*args, **kwargs).transpose(1, 2)
    if hasattr(flex, "AuxRequest"):
        out, aux = kernel(*args, **kwargs, return_aux=flex.AuxRequest(lse=True))
        lse = aux.lse
    else:  # torch < 2.9
        out, lse = kernel(*args, **kwargs, return_lse=True)
    lse = lse.float()
    if sinks is not None:
        # softmax over [scores, sink] without the sink column = softmax(scores) * Z / (Z + e^sink).
        keep = torch.sigmoid(lse - sinks.float()[None, :, None])
        out = (out.float() * keep[..., None]).to(q.dtype)
        lse = torch.logaddexp(lse, sinks.float()[None, :, None])
    out = out.transpose(1, 2)
    return (out, lse.transpose(1, 2)) if return_lse else out
