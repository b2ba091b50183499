"""The Triton backend of :func:`mcore.kernels.ssd.ssd_scan`: the chunked SSD with the two parts torch does badly in
Triton kernels (:mod:`mcore.kernels.triton.ssd`), the matmul-shaped parts in torch.

Which part runs where, and why:
- chunk cumsum of ``dt * A``: torch (``cumsum`` over a ``[b, c, Q, h]`` view: one elementwise pass, autograd).
- ``C B^T`` per chunk and group: a torch batched matmul (``[Q, n] @ [n, Q]``).
- intra-chunk output (``C B^T`` masked by the decay, times ``dt x``): Triton, forward and backward. Torch has to
  materialize the decay ``[b, c, Q, Q, h]`` (268 MB fp32 for one Nemotron-H-8B layer at 4k tokens) and its
  gradient; the kernel keeps it in registers.
- chunk states (``sum_j decay_to_end_j dt_j x_j B_j^T``) and the inter-chunk output (``C_i S_in`` decayed): torch
  batched matmuls of shape ``[h p, Q] @ [Q, n]`` and ``[Q, n] @ [n, h p]`` per chunk and group.
- state passing (sequential over chunks): Triton, one program per (batch, head, block of state elements) walks
  the chunks; torch would run two kernels per chunk.
Documents (``seq_idx``) enter as in the torch backend: the decay mask (intra), the chunk's last document (chunk
states), whether the incoming state's document continues (carry, inter-chunk output).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class _IntraChunk(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dt, cs, cb, seq):
        from mcore.kernels.triton.ssd import intra_forward

        ctx.save_for_backward(x, dt, cs, cb, seq)
        return intra_forward(x, dt, cs, seq, cb)

    @staticmethod
    def backward(ctx, dy):
        from mcore.kernels.triton.ssd import intra_backward

        x, dt, cs, cb, seq = ctx.saved_tensors
        dx, ddt, dcs, dcb = intra_backward(dy.contiguous(), x, dt, cs, seq, cb)
        return dx.to(x.dtype), ddt, dcs, dcb, None


class _StatePassing(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local, carry, initial):
        from mcore.kernels.triton.ssd import state_forward

        incoming, final = state_forward(local, carry, initial)
        ctx.save_for_backward(carry, incoming)
        ctx.has_initial = initial is not None
        return incoming, final

    @staticmethod
    def backward(ctx, dincoming, dfinal):
        from mcore.kernels.triton.ssd import state_backward

        carry, incoming = ctx.saved_tensors
        if dincoming is None:
            dincoming = torch.zeros_like(incoming)
        dfinal = None if dfinal is None else dfinal.contiguous()
        dlocal, dcarry, dinit = state_backward(carry, incoming, dincoming.contiguous(), dfinal)
        return dlocal, dcarry, dinit if ctx.has_initial else None


def _pad_to_chunks(t: torch.Tensor, pad: int) -> torch.Tensor:
    return F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad)) if pad else t


def ssd_chunked_triton(x, dt, A, B, C, chunk_size, initial_states, seq_idx):
    """Same contract as ``mcore.kernels.ssd._ssd_chunked`` (``dt`` discretized fp32, no D term), with ``x``, ``B``,
    ``C`` in their own dtype: (y fp32 ``[b, L, h, p]``, final state fp32 ``[b, h, p, n]``)."""
    b, length, h, p = x.shape
    g, n = B.shape[2:]
    # A sequence shorter than one chunk is one chunk of its own length (the same arithmetic, no padded tokens:
    # decoding steps of one token would otherwise pay for a whole chunk).
    q = min(chunk_size, length)
    pad = (-length) % q
    nc = (length + pad) // q
    xp = _pad_to_chunks(x, pad).contiguous()
    dtp = _pad_to_chunks(dt, pad).contiguous()  # padding: dt = 0, no decay and no input
    Bc = _pad_to_chunks(B, pad).float().view(b, nc, q, g, n)
    Cc = _pad_to_chunks(C, pad).float().view(b, nc, q, g, n)
    if seq_idx is None:
        seq = None
    else:
        seq = seq_idx.to(torch.int32)
        seq = torch.cat([seq, seq[:, -1:].expand(b, pad)], dim=1).contiguous() if pad else seq.contiguous()
    cs = torch.cumsum((dtp * A).view(b, nc, q, h), dim=2)  # [b, c, Q, h]
    cb = torch.matmul(Cc.permute(0, 1, 3, 2, 4), Bc.permute(0, 1, 3, 4, 2)).contiguous()  # [b, c, g, Q, Q]
    y = _IntraChunk.apply(xp, dtp, cs.view(b, -1, h), cb, seq)

    decay_to_end = torch.exp(cs[:, :, -1:] - cs)  # [b, c, Q, h]
    decay_from_start = torch.exp(cs)
    carry = torch.exp(cs[:, :, -1])  # [b, c, h]
    if seq is not None:
        sq = seq.view(b, nc, q)
        last_doc = sq[:, :, -1:]
        prev_doc = torch.cat([sq[:, :1, :1], last_doc[:, :-1]], dim=1)  # document of the incoming state
        same_last, same_prev = (sq == last_doc)[..., None], (sq == prev_doc)[..., None]
        decay_to_end = decay_to_end * same_last
        decay_from_start = decay_from_start * same_prev
        carry = carry * (last_doc == prev_doc)
    # Chunk states [b, c, g, r*p, n]: (decay-to-end * dt * x)^T @ B over the chunk's tokens.
    # (type promotion makes the product fp32 in one pass, with no fp32 copy of x first)
    xw = (xp.view(b, nc, q, h, p) * (decay_to_end * dtp.view(b, nc, q, h))[..., None]).view(b, nc, q, g, -1)
    local = torch.matmul(xw.permute(0, 1, 3, 4, 2), Bc.permute(0, 1, 3, 2, 4))  # [b, c, g, r*p, n]
    init = None if initial_states is None else initial_states.float().reshape(b, h, p * n).contiguous()
    incoming, final = _StatePassing.apply(local.reshape(b, nc, h, p * n).contiguous(), carry.contiguous(), init)
    # Inter-chunk output: C_i @ S_in^T per group, decayed from the chunk start.
    s_in = incoming.view(b, nc, g, -1, n)  # [b, c, g, r*p, n]
    r = h // g
    inter = torch.matmul(Cc.permute(0, 1, 3, 2, 4), s_in.transpose(-1, -2)).view(b, nc, g, q, r, p)
    inter = inter * decay_from_start.view(b, nc, q, g, r).transpose(2, 3)[..., None]
    # added through a permuted view: no copy of the [b, c, g, Q, r, p] product into y's layout
    y = y.view(b, nc, q, g, r, p) + inter.transpose(2, 3)
    return y.reshape(b, -1, h, p)[:, :length], final.view(b, h, p, n)
