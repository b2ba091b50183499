"""Causal depthwise conv1d (+ SiLU), document-aware: the short convolution of Mamba-2 over ``[x | B | C]``.

``out[t, d] = act(bias[d] + sum_j weight[d, j] * in[t - (k - 1) + j, d])`` with inputs before the row start, or
in an earlier document, read as 0 (a document's first token sees only itself, as if it began the sequence).
``conv_states`` (``[batch, dim, k - 1]``, the last inputs of a previous call) stand in for the tokens before the
row start: that is how a generation cache continues a sequence.

Two backends (:mod:`mcore.kernels.dispatch`): the Triton kernels of :mod:`mcore.kernels.triton.conv` (forward and a
hand-written backward, for ``k <= 4`` and without ``conv_states``, a decoding-only input; ``x`` is read in place
when its channel stride is 1, e.g. the mixer's slice of the in_proj output), and the torch reference: ``F.conv1d`` when
no document boundary is given, otherwise a sum of ``k`` shifted, masked products (``k`` is 4 in every published
Mamba-2), with autograd's backward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mcore.kernels import dispatch

ACTIVATIONS = (None, "silu")
# Widest conv the Triton kernels take (their ``WIDTH``; kept here so that choosing a backend imports no Triton).
TRITON_MAX_TAPS = 4


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    activation: str | None = "silu",
    seq_idx: torch.Tensor | None = None,
    conv_states: torch.Tensor | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Depthwise causal convolution along ``x``'s sequence dim.

    Args:
        x: ``[batch, seqlen, dim]``.
        weight: ``[dim, k]`` (HF's ``conv1d.weight`` ``[dim, 1, k]`` squeezed). bias: ``[dim]`` or ``None``.
        activation: ``"silu"`` or ``None``.
        seq_idx: ``[batch, seqlen]`` integer document index (non-decreasing), or ``None`` for one document a row.
        conv_states: ``[batch, dim, k - 1]`` inputs preceding ``x`` (oldest first), or ``None`` (zeros).

    Returns:
        ``[batch, seqlen, dim]`` in ``x``'s dtype.
    """
    _check(x, weight, bias, activation, seq_idx, conv_states)
    tensors = [t for t in (x, weight, bias, seq_idx) if t is not None]
    fits = conv_states is None and weight.shape[1] <= TRITON_MAX_TAPS
    if fits and dispatch.choose("causal_conv1d", *tensors, backend=backend) == dispatch.TRITON:
        return _TritonConv.apply(x, weight, bias, seq_idx, activation == "silu")
    return reference_conv1d(x, weight, bias, activation=activation, seq_idx=seq_idx, conv_states=conv_states)


class _TritonConv(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, seq_idx, silu):
        from mcore.kernels.triton.conv import conv_forward

        # x is saved as given (a strided view of in_proj's output in the mixer): a copy would cost bytes and memory.
        ctx.save_for_backward(x, weight, bias, seq_idx)
        ctx.silu = silu
        return conv_forward(x, weight, bias, seq_idx, silu)

    @staticmethod
    def backward(ctx, dy):
        from mcore.kernels.triton.conv import conv_backward

        x, weight, bias, seq_idx = ctx.saved_tensors
        dx, dw, db = conv_backward(dy, x, weight, bias, seq_idx, ctx.silu)
        return dx, dw, db, None, None


def reference_conv1d(x, weight, bias=None, *, activation="silu", seq_idx=None, conv_states=None) -> torch.Tensor:
    """The torch backend of :func:`causal_conv1d` (same arguments, already checked)."""
    b, length, dim = x.shape
    k = weight.shape[1]
    xt = x.transpose(1, 2)  # [b, dim, L]
    history = xt.new_zeros(b, dim, k - 1) if conv_states is None else conv_states.to(x.dtype)
    padded = torch.cat([history, xt], dim=2)  # [b, dim, k - 1 + L]
    if seq_idx is None:
        out = F.conv1d(padded, weight[:, None, :].to(x.dtype), None if bias is None else bias.to(x.dtype), groups=dim)
    else:
        # History belongs to the row's first document; tap j of token t reads position t - (k - 1) + j.
        seq = torch.cat([seq_idx[:, :1].expand(b, k - 1), seq_idx], dim=1)
        out = 0
        for j in range(k):
            same = (seq[:, j : j + length] == seq_idx).unsqueeze(1)  # [b, 1, L]
            out = out + weight[:, j, None].to(x.dtype) * padded[:, :, j : j + length] * same
        if bias is not None:
            out = out + bias.to(x.dtype)[:, None]
    if activation == "silu":
        out = F.silu(out)
    return out.transpose(1, 2)


def _check(x, weight, bias, activation, seq_idx, conv_states) -> None:
    if x.dim() != 3:
        raise ValueError(f"causal_conv1d: x must be [batch, seqlen, dim], got {tuple(x.shape)}")
    b, length, dim = x.shape
    if weight.dim() != 2 or weight.shape[0] != dim:
        raise ValueError(f"causal_conv1d: weight must be [dim, k] with dim = {dim}, got {tuple(weight.shape)}")
    if bias is not None and tuple(bias.shape) != (dim,):
        raise ValueError(f"causal_conv1d: bias must be [dim] = ({dim},), got {tuple(bias.shape)}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"causal_conv1d: activation must be one of {ACTIVATIONS}, got {activation!r}")
    if seq_idx is not None and (tuple(seq_idx.shape) != (b, length) or seq_idx.is_floating_point()):
        raise ValueError(
            f"causal_conv1d: seq_idx must be integer [batch, seqlen] = {(b, length)}, got {tuple(seq_idx.shape)}"
        )
    k = weight.shape[1]
    if conv_states is not None and tuple(conv_states.shape) != (b, dim, k - 1):
        raise ValueError(
            f"causal_conv1d: conv_states must be [batch, dim, k - 1] = {(b, dim, k - 1)}, "
            f"got {tuple(conv_states.shape)}"
        )
