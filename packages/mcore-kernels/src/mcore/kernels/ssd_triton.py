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

import os

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


class _ChunkState(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, B, chunk):
        from mcore.kernels.triton.ssd_states import chunk_state_forward

        ctx.save_for_backward(x, w, B)
        ctx.chunk = chunk
        return chunk_state_forward(x, w, B, chunk)

    @staticmethod
    def backward(ctx, dlocal):
        from mcore.kernels.triton.ssd_states import chunk_state_backward

        x, w, B = ctx.saved_tensors
        dx, dw, dB = chunk_state_backward(dlocal.contiguous(), x, w, B, ctx.chunk)
        return dx.to(x.dtype), dw, dB.to(B.dtype), None


class _InterChunk(torch.autograd.Function):
    @staticmethod
    def forward(ctx, C, S, v, heads, head_dim):
        from mcore.kernels.triton.ssd_states import inter_forward

        ctx.save_for_backward(C, S, v)
        return inter_forward(C, S, v, heads, head_dim)

    @staticmethod
    def backward(ctx, dy):
        from mcore.kernels.triton.ssd_states import inter_backward

        C, S, v = ctx.saved_tensors
        dC, dS, dv = inter_backward(dy.contiguous(), C, S, v)
        return dC.to(C.dtype), dS, dv, None, None


# Where the two state matmuls run: "triton" (mcore.kernels.triton.ssd_states: input-dtype operands, fp32
# accumulation, nothing but the inputs saved), "torch" (fp32 batched matmuls), or "auto": on CUDA the faster of the
# two on each shape, forward + backward timed once (mcore.kernels.ssd_state_choice; a Triton path that fails to
# build loses), triton elsewhere. ssm_throughput times both. MCORE_SSD_STATE_MATMULS sets it without a code change.
STATE_MATMULS = os.environ.get("MCORE_SSD_STATE_MATMULS", "auto")
if STATE_MATMULS not in ("auto", "triton", "torch"):
    raise ValueError(f"MCORE_SSD_STATE_MATMULS must be 'auto', 'triton' or 'torch', got {STATE_MATMULS!r}")


def _pad_to_chunks(t: torch.Tensor, pad: int) -> torch.Tensor:
    return F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad)) if pad else t


def _chunk_states_torch(xp, w, Bc, b, nc, q, g, h, p, n):
    """Chunk states [b, c, h, p * n]: (w x)^T @ B over each chunk's tokens, in fp32 matmuls."""
    # (type promotion makes the product fp32 in one pass, with no fp32 copy of x first)
    xw = (xp.view(b, nc, q, h, p) * w.view(b, nc, q, h)[..., None]).view(b, nc, q, g, -1)
    local = torch.matmul(xw.permute(0, 1, 3, 4, 2), Bc.permute(0, 1, 3, 2, 4))  # [b, c, g, r*p, n]
    return local.reshape(b, nc, h, p * n)


def _inter_torch(Cc, incoming, v, b, nc, q, g, h, p, n):
    """Inter-chunk output [b, Lp, h, p]: C_i @ S_in^T per group, times the decay from the chunk start."""
    r = h // g
    s_in = incoming.view(b, nc, g, -1, n)  # [b, c, g, r*p, n]
    inter = torch.matmul(Cc.permute(0, 1, 3, 2, 4), s_in.transpose(-1, -2)).view(b, nc, g, q, r, p)
    inter = inter * v.view(b, nc, q, g, r).transpose(2, 3)[..., None]
    return inter.transpose(2, 3).reshape(b, nc * q, h, p)


def chunk_states(path, xp, w, Bp, dims):
    """Chunk states ``[b, c, h, p * n]`` fp32 on ``path`` (``dims`` = ``(b, nc, q, g, h, p, n)``)."""
    b, nc, q, g, h, p, n = dims
    if path == "triton":
        return _ChunkState.apply(xp, w.contiguous(), Bp.contiguous(), q)
    return _chunk_states_torch(xp, w, Bp.float().view(b, nc, q, g, n), b, nc, q, g, h, p, n)


def inter_output(path, Cp, incoming, v, dims):
    """Inter-chunk output ``[b, Lp, h, p]`` fp32 on ``path``."""
    b, nc, q, g, h, p, n = dims
    if path == "triton":
        return _InterChunk.apply(Cp.contiguous(), incoming, v.contiguous(), h, p)
    return _inter_torch(Cp.float().view(b, nc, q, g, n), incoming, v, b, nc, q, g, h, p, n)


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
    Bc = _pad_to_chunks(B, pad).float().view(b, nc, q, g, n)  # fp32 for the C B^T matmul
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
    w = (decay_to_end * dtp.view(b, nc, q, h)).reshape(b, -1, h)  # each token's weight in its chunk's state
    v = decay_from_start.reshape(b, -1, h)  # the incoming state's weight in each token's output
    dims = (b, nc, q, g, h, p, n)
    Bp, Cp = _pad_to_chunks(B, pad), _pad_to_chunks(C, pad)
    path = STATE_MATMULS
    if path == "auto":
        from mcore.kernels.ssd_state_choice import choose_state_matmuls

        path = choose_state_matmuls((chunk_states, inter_output), xp, w, Bp, Cp, v, dims)
    local = chunk_states(path, xp, w, Bp, dims)
    init = None if initial_states is None else initial_states.float().reshape(b, h, p * n).contiguous()
    incoming, final = _StatePassing.apply(local.contiguous(), carry.contiguous(), init)
    inter = inter_output(path, Cp, incoming, v, dims)
    y = y + inter
    return y[:, :length], final.view(b, h, p, n)
