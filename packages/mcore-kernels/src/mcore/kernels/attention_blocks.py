"""Attention over an :class:`AttentionLayout` as a forward/backward pair that exposes the log-sum-exp.

These are the building blocks of context parallelism: a ring step computes ``(out, lse)`` of local
queries against one peer's keys, :func:`merge_partials` combines the steps exactly, and the backward of
each step reuses the *final* ``out`` and ``lse`` (``P = exp(S - lse)`` is then the true probability of
every key of the step, wherever the other keys live).

Two backends share the contract:

- ``triton``: the flash kernels of :mod:`mcore.kernels.triton.flash_attention` (CUDA, or CPU tensors
  under ``TRITON_INTERPRET=1``), cost following the pairs' tiles;
- ``reference``: plain torch in fp32 (fp64 for fp64 inputs) with the layout's dense mask; runs anywhere.

Shapes: ``q [b, s, Hq, Dqk]``, ``k [b, s_k, Hkv, Dqk]``, ``v [b, s_k, Hkv, Dv]``, ``out [b, s, Hq, Dv]``,
``lse [b, s, Hq]`` fp32 (natural log, including the sink when ``sinks`` is given; ``-inf`` on rows that see
nothing, whose output is 0), ``sinks [Hq]``.
"""

from __future__ import annotations

import torch

from mcore.kernels.attention_layout import AttentionLayout

BACKENDS = ("triton", "reference")


def _unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def layout_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: AttentionLayout,
    softmax_scale: float,
    sinks: torch.Tensor | None = None,
    *,
    backend: str = "reference",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of attention over ``layout`` (no autograd; see :func:`layout_attention`)."""
    _check_layout(q, k, layout)
    if backend == "triton":
        from mcore.kernels.triton.flash_attention import flash_forward

        return flash_forward(*(_unit_last_stride(t) for t in (q, k, v)), layout, softmax_scale, sinks)
    if backend != "reference":
        raise ValueError(f"layout_forward: backend must be one of {BACKENDS}, got {backend!r}")
    with torch.no_grad():
        probs, lse = _reference_probs(q, k, layout, softmax_scale, sinks, None)
        b, s, n_heads, _ = q.shape
        n_kv, group = k.shape[2], n_heads // k.shape[2]
        out = torch.einsum("bhgqk,bkhd->bqhgd", probs, v.to(probs.dtype)).reshape(b, s, n_heads, v.shape[-1])
    return out.to(q.dtype), lse.permute(0, 3, 1, 2).reshape(b, s, n_kv * group).float()


def layout_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dout: torch.Tensor,
    layout: AttentionLayout,
    softmax_scale: float,
    sinks: torch.Tensor | None = None,
    *,
    dlse: torch.Tensor | None = None,
    deterministic: bool = True,
    backend: str = "reference",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(dq, dk, dv, dsinks)`` from the row's full ``out``/``lse`` (``dsinks`` None without sinks)."""
    if backend == "triton":
        from mcore.kernels.triton.flash_backward import flash_backward

        tensors = (_unit_last_stride(t) for t in (q, k, v, out))
        return flash_backward(
            *tensors, lse.contiguous(), _unit_last_stride(dout), layout, softmax_scale, sinks,
            dlse=dlse, deterministic=deterministic,
        )  # fmt: skip
    if backend != "reference":
        raise ValueError(f"layout_backward: backend must be one of {BACKENDS}, got {backend!r}")
    b, s, n_heads, d_qk = q.shape
    n_kv, group = k.shape[2], n_heads // k.shape[2]
    with torch.no_grad():
        probs, lse_g = _reference_probs(q, k, layout, softmax_scale, None, lse)
        compute = probs.dtype
        dout_g = dout.to(compute).reshape(b, s, n_kv, group, -1)
        delta = (dout.to(compute) * out.to(compute)).sum(-1)
        if dlse is not None:
            delta = delta - dlse.to(compute)
        delta_g = delta.reshape(b, s, n_kv, group).permute(0, 2, 3, 1)
        dv = torch.einsum("bhgqk,bqhgd->bkhd", probs, dout_g)
        ds = probs * (torch.einsum("bqhgd,bkhd->bhgqk", dout_g, v.to(compute)) - delta_g[..., None])
        qg = q.to(compute).reshape(b, s, n_kv, group, d_qk)
        dq = torch.einsum("bhgqk,bkhd->bqhgd", ds, k.to(compute)).reshape(q.shape) * softmax_scale
        dk = torch.einsum("bhgqk,bqhgd->bkhd", ds, qg) * softmax_scale
        dsinks = None
        if sinks is not None:
            p_sink = torch.exp(sinks.to(compute)[None, None, :] - lse.to(compute).clamp_min(torch.finfo(compute).min))
            dsinks = (-(p_sink * delta).sum(dim=(0, 1))).to(sinks.dtype)
    del lse_g
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsinks


def _reference_probs(
    q: torch.Tensor,
    k: torch.Tensor,
    layout: AttentionLayout,
    softmax_scale: float,
    sinks: torch.Tensor | None,
    lse: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(P [b, Hkv, g, s, s_k], lse [b, Hkv, g, s])``; with ``lse`` given, P uses it instead of its own."""
    b, s, n_heads, d_qk = q.shape
    n_kv = k.shape[2]
    group = n_heads // n_kv
    compute = torch.promote_types(q.dtype, torch.float32)
    qg = q.to(compute).reshape(b, s, n_kv, group, d_qk)
    scores = torch.einsum("bqhgd,bkhd->bhgqk", qg, k.to(compute)) * softmax_scale
    scores = scores.masked_fill(~layout.dense_mask(q.device)[:, None, None], float("-inf"))
    if lse is None:
        row_lse = torch.logsumexp(scores, dim=-1)
        if sinks is not None:
            row_lse = torch.logaddexp(row_lse, sinks.to(compute).reshape(1, n_kv, group, 1))
    else:
        row_lse = lse.to(compute).reshape(b, s, n_kv, group).permute(0, 2, 3, 1)
    # Rows that see nothing keep lse = -inf and P = 0 (exp(-inf - finite)).
    safe = torch.where(torch.isneginf(row_lse), torch.zeros_like(row_lse), row_lse)
    return torch.exp(scores - safe[..., None]), row_lse


def _check_layout(q: torch.Tensor, k: torch.Tensor, layout: AttentionLayout) -> None:
    if not isinstance(layout, AttentionLayout):
        raise TypeError(f"attention: layout must be an AttentionLayout, got {type(layout).__name__}")
    if (layout.batch, layout.q_len, layout.k_len) != (q.shape[0], q.shape[1], k.shape[1]):
        raise ValueError(
            f"attention: the layout is for batch {layout.batch}, {layout.q_len} queries and {layout.k_len} keys, "
            f"but q has shape {tuple(q.shape)} and k {tuple(k.shape)}"
        )


class _LayoutAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, layout, softmax_scale, backend, deterministic):
        out, lse = layout_forward(q, k, v, layout, softmax_scale, sinks, backend=backend)
        ctx.save_for_backward(q, k, v, sinks, out, lse)
        ctx.config = (layout, softmax_scale, backend, deterministic)
        ctx.set_materialize_grads(False)  # an unused lse (the usual case) costs nothing in the backward
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, sinks, out, lse = ctx.saved_tensors
        layout, softmax_scale, backend, deterministic = ctx.config
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv, dsinks = layout_backward(
            q, k, v, out, lse, dout, layout, softmax_scale, sinks,
            dlse=dlse, deterministic=deterministic, backend=backend,
        )  # fmt: skip
        return dq, dk, dv, dsinks, None, None, None, None


def layout_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: AttentionLayout,
    *,
    softmax_scale: float,
    sinks: torch.Tensor | None = None,
    backend: str = "reference",
    deterministic: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiable ``(out, lse)``: gradients flow to q, k, v and sinks from both outputs."""
    if backend not in BACKENDS:
        raise ValueError(f"attention: layout backend must be one of {BACKENDS}, got {backend!r}")
    return _LayoutAttention.apply(q, k, v, sinks, layout, softmax_scale, backend, deterministic)


def merge_partials(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine attention over two disjoint key sets: ``lse = logaddexp``, outputs weighted by ``exp(lse_i - lse)``.

    Outputs come back in fp32 (accumulate ring steps in fp32; cast once at the end). Rows empty on both
    sides stay ``(0, -inf)``.
    """
    lse = torch.logaddexp(lse_a, lse_b)
    safe = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    weight_a = torch.exp(lse_a - safe)[..., None]
    weight_b = torch.exp(lse_b - safe)[..., None]
    return out_a.float() * weight_a + out_b.float() * weight_b, lse
