"""The Mamba-2 state-space dual (SSD) scan, chunked, with packed documents and initial states.

The recurrence per head (state ``S`` of shape ``[head_dim, state]``), for token ``t``::

    dt_t = clamp(softplus(dt_raw_t + dt_bias), dt_limit)
    S_t  = exp(dt_t * A) * S_{t-1} + dt_t * x_t B_t^T          (S_{-1} = initial state, or 0)
    y_t  = S_t C_t + D * x_t

A document boundary (``seq_idx`` changes, or a ``cu_seqlens`` entry) resets ``S`` to 0: the state restarts at
document boundaries, wherever they fall inside a chunk. The initial state feeds the first document of each row.

The chunked form (Dao & Gu 2024, "Transformers are SSMs") computes, per chunk of ``chunk_size`` tokens:
1. the intra-chunk output ``(C B^T * decay mask) (dt x)`` (a masked, attention-like product),
2. each chunk's own contribution to the state at its end,
3. the states passed between chunks (a short recurrence over chunks),
4. the output of the passed-in state, ``C S_prev`` decayed to each token.
Here the document mask enters all four: the decay mask is zero across documents (1), tokens of an earlier document
do not reach the chunk-end state (2), a chunk's incoming state does not cross a boundary (3, 4).

Two backends (:mod:`mcore.kernels.dispatch`: Triton on CUDA, torch elsewhere): this module's pure-torch chunked
scan (fp32 compute whatever the input dtype; autograd gives the backward pass), and :mod:`mcore.kernels.ssd_triton`
(Triton intra-chunk output and state passing, torch matmuls for the rest). A, D and dt_bias are used in fp32 (they
are fp32 parameters in every Mamba-2 checkpoint).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from mcore.kernels import dispatch


def seq_idx_from_cu_seqlens(
    cu_seqlens: torch.Tensor, batch: int, seqlen: int, *, check_values: bool = True
) -> torch.Tensor:
    """Document index of each token ``[batch, seqlen]`` (int32) from boundaries over the flattened tokens.

    ``check_values=False`` skips the check of the first and last boundary, which reads them on the host (a device
    sync): models call it once per layer and forward, with boundaries the data pipeline already checked."""
    total = batch * seqlen
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.is_floating_point():
        raise ValueError(f"cu_seqlens must be a 1-D integer tensor [docs + 1], got {tuple(cu_seqlens.shape)}")
    if check_values and (int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != total):
        raise ValueError(f"cu_seqlens must start at 0 and end at batch * seqlen = {total}, got {cu_seqlens.tolist()}")
    tokens = torch.arange(total, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    return (torch.searchsorted(cu_seqlens, tokens, right=True) - 1).to(torch.int32).view(batch, seqlen)


def _check_inputs(x, dt, A, B, C, chunk_size, D, dt_bias, initial_states, seq_idx) -> None:
    if x.dim() != 4:
        raise ValueError(f"ssd_scan: x must be [batch, seqlen, heads, head_dim], got {tuple(x.shape)}")
    b, length, h, p = x.shape
    if tuple(dt.shape) != (b, length, h):
        raise ValueError(f"ssd_scan: dt must be [batch, seqlen, heads] = {(b, length, h)}, got {tuple(dt.shape)}")
    if tuple(A.shape) != (h,):
        raise ValueError(f"ssd_scan: A must be [heads] = ({h},), got {tuple(A.shape)}")
    if B.dim() != 4 or tuple(B.shape[:2]) != (b, length) or B.shape != C.shape:
        raise ValueError(
            f"ssd_scan: B and C must both be [batch, seqlen, groups, state] with batch, seqlen = {(b, length)}; "
            f"got B {tuple(B.shape)}, C {tuple(C.shape)}"
        )
    g, n = B.shape[2:]
    if h % g != 0:
        raise ValueError(f"ssd_scan: groups ({g}) must divide heads ({h})")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"ssd_scan: chunk_size must be an int >= 1, got {chunk_size!r}")
    for name, t in (("D", D), ("dt_bias", dt_bias)):
        if t is not None and tuple(t.shape) != (h,):
            raise ValueError(f"ssd_scan: {name} must be [heads] = ({h},), got {tuple(t.shape)}")
    if initial_states is not None and tuple(initial_states.shape) != (b, h, p, n):
        raise ValueError(
            f"ssd_scan: initial_states must be [batch, heads, head_dim, state] = {(b, h, p, n)}, "
            f"got {tuple(initial_states.shape)}"
        )
    if seq_idx is not None and (tuple(seq_idx.shape) != (b, length) or seq_idx.is_floating_point()):
        raise ValueError(
            f"ssd_scan: seq_idx must be integer [batch, seqlen] = {(b, length)}, got {tuple(seq_idx.shape)}"
        )


def discretize_dt(
    dt: torch.Tensor,
    dt_bias: torch.Tensor | None,
    dt_softplus: bool,
    dt_limit: tuple[float, float],
) -> torch.Tensor:
    """fp32 ``clamp(softplus(dt + dt_bias), *dt_limit)`` (softplus only if ``dt_softplus``)."""
    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    if dt_softplus:
        dt = F.softplus(dt)
    lo, hi = dt_limit
    if lo > 0.0 or hi < math.inf:
        dt = dt.clamp(min=lo, max=hi)
    return dt


def ssd_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    *,
    chunk_size: int,
    D: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = True,
    dt_limit: tuple[float, float] = (0.0, math.inf),
    initial_states: torch.Tensor | None = None,
    seq_idx: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    return_final_states: bool = False,
    backend: str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The SSD scan (see the module docstring).

    Args:
        x: ``[batch, seqlen, heads, head_dim]``.
        dt: ``[batch, seqlen, heads]``, before ``dt_bias``/softplus.
        A: ``[heads]`` (negative; ``-exp(A_log)``), fp32.
        B, C: ``[batch, seqlen, groups, state]``; head ``i`` reads group ``i // (heads // groups)``.
        chunk_size: tokens per chunk (256 for Mamba-2 / Falcon-H1, 128 for Nemotron-H); any ``seqlen`` works.
        D: ``[heads]`` skip connection, or ``None``. dt_bias: ``[heads]`` or ``None``.
        initial_states: ``[batch, heads, head_dim, state]`` entering the first document of each row.
        seq_idx: ``[batch, seqlen]`` integer document index, non-decreasing along each row; or ``cu_seqlens``
            (int32 boundaries over the flattened ``batch * seqlen`` tokens). Give at most one.
        return_final_states: also return the fp32 state after the last token ``[batch, heads, head_dim, state]``.
        backend: ``"triton"`` or ``"reference"`` (default: by device, see :mod:`mcore.kernels.dispatch`).

    Returns:
        ``y`` shaped and typed like ``x`` (and the final states when asked).
    """
    _check_inputs(x, dt, A, B, C, chunk_size, D, dt_bias, initial_states, seq_idx)
    if cu_seqlens is not None:
        if seq_idx is not None:
            raise ValueError("ssd_scan: give seq_idx or cu_seqlens, not both")
        seq_idx = seq_idx_from_cu_seqlens(cu_seqlens, x.shape[0], x.shape[1])
    dt = discretize_dt(dt, dt_bias, dt_softplus, dt_limit)
    tensors = [t for t in (x, dt, A, B, C, initial_states, seq_idx) if t is not None]
    if dispatch.choose("ssd_scan", *tensors, backend=backend) == dispatch.TRITON:
        from mcore.kernels.ssd_triton import ssd_chunked_triton

        x = x.contiguous()  # the scan's own copy of x (a view of the conv output in the mixer); the D term saves it too
        y, final = ssd_chunked_triton(x, dt, A.float(), B, C, chunk_size, initial_states, seq_idx)
    else:
        y, final = _ssd_chunked(x.float(), dt, A.float(), B.float(), C.float(), chunk_size, initial_states, seq_idx)
    if D is not None:
        y = _SkipConnection.apply(y, D.float(), x)
    y = y.to(x.dtype)
    return (y, final) if return_final_states else y


class _SkipConnection(torch.autograd.Function):
    """``y + D x`` (``y`` fp32 ``[b, L, h, p]``, ``D`` fp32 ``[h]``) saving ``x`` in its own dtype: autograd's
    ``D * x.float()`` would keep an fp32 copy of ``x`` (4 bytes per token and channel) for ``D``'s gradient."""

    @staticmethod
    def forward(ctx, y, D, x):
        ctx.save_for_backward(D, x)
        return y + D[:, None] * x.float()

    @staticmethod
    def backward(ctx, dy):
        D, x = ctx.saved_tensors
        dD = (dy * x.float()).sum(dim=(0, 1, 3)) if ctx.needs_input_grad[1] else None
        dx = (dy * D[:, None]).to(x.dtype) if ctx.needs_input_grad[2] else None
        return dy, dD, dx


def _chunk(t: torch.Tensor, pad: int, chunk_size: int) -> torch.Tensor:
    """``[b, L, ...]`` -> ``[b, chunks, chunk_size, ...]``, zero-padded at the end."""
    if pad:
        t = F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad))
    return t.reshape(t.shape[0], -1, chunk_size, *t.shape[2:])


def _ssd_chunked(x, dt, A, B, C, chunk_size, initial_states, seq_idx):
    """fp32 chunked SSD without the D term: (y ``[b, L, h, p]``, final state ``[b, h, p, n]``)."""
    b, length, h, p = x.shape
    g, n = B.shape[2:]
    r = h // g  # heads per group
    pad = (-length) % chunk_size
    if seq_idx is None:
        seq_idx = torch.zeros(b, length, dtype=torch.int32, device=x.device)
    # Padding tokens have dt = 0 (no decay, no input) and the last document's index: they change nothing.
    seq = F.pad(seq_idx, (0, pad), value=0) if pad else seq_idx
    if pad:
        seq[:, length:] = seq_idx[:, -1:]
    seq = seq.reshape(b, -1, chunk_size)  # [b, c, Q]
    xdt = _chunk(x * dt[..., None], pad, chunk_size).view(b, -1, chunk_size, g, r, p)
    Bc, Cc = _chunk(B, pad, chunk_size), _chunk(C, pad, chunk_size)  # [b, c, Q, g, n]
    cs = torch.cumsum(_chunk(dt * A, pad, chunk_size), dim=2).view(b, -1, chunk_size, g, r)  # [b, c, Q, g, r]

    # 1. Intra-chunk: decay exp(cs_i - cs_j) for j <= i in the same document, else 0 (masked before exp).
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=x.device).tril()
    same = (seq[:, :, :, None] == seq[:, :, None, :]) & causal  # [b, c, i, j]
    diff = cs[:, :, :, None] - cs[:, :, None, :]  # [b, c, i, j, g, r]
    decay = torch.exp(diff.masked_fill(~same[..., None, None], -math.inf))
    scores = torch.einsum("bcign,bcjgn->bcijg", Cc, Bc)
    y = torch.einsum("bcijg,bcijgr,bcjgrp->bcigrp", scores, decay, xdt)

    # 2. Each chunk's contribution to the state at its end (tokens of the chunk's last document only).
    last_doc = seq[:, :, -1:]  # [b, c, 1]
    to_end = torch.exp(cs[:, :, -1:] - cs) * (seq == last_doc)[..., None, None]  # [b, c, Q, g, r]
    local = torch.einsum("bcjgn,bcjgr,bcjgrp->bcgrpn", Bc, to_end, xdt)

    # 3. State passing: the state at the end of chunk c-1 carries over chunk c if its document continues.
    prev_doc = torch.cat([seq[:, :1, :1], last_doc[:, :-1]], dim=1)  # [b, c, 1]: document of the incoming state
    carry = torch.exp(cs[:, :, -1]) * (last_doc == prev_doc)[..., None]  # [b, c, g, r]
    state = x.new_zeros(b, g, r, p, n) if initial_states is None else initial_states.float().view(b, g, r, p, n)
    incoming = []
    for c in range(local.shape[1]):
        incoming.append(state)
        state = carry[:, c, :, :, None, None] * state + local[:, c]
    incoming = torch.stack(incoming, dim=1)  # [b, c, g, r, p, n]

    # 4. Output of the incoming state, for the tokens still in its document.
    from_start = torch.exp(cs) * (seq == prev_doc)[..., None, None]  # [b, c, Q, g, r]
    y = y + torch.einsum("bcign,bcgrpn,bcigr->bcigrp", Cc, incoming, from_start)
    y = y.reshape(b, -1, h, p)[:, :length]
    return y, state.reshape(b, h, p, n)
