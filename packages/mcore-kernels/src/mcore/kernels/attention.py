"""Scaled dot-product attention with GQA, sliding windows, packed documents, sinks and the log-sum-exp.

Backends (``backend=`` keyword, then ``MCORE_ATTENTION_BACKEND`` for attention alone (``auto`` = the default
choice below), then ``MCORE_KERNELS_BACKEND``, which every op reads, so it can name only ``triton`` / ``reference``):

- ``triton``: our flash attention (:mod:`mcore.kernels.triton.flash_attention`), every feature, cost
  following the sum of squared document lengths; CUDA, or CPU tensors under ``TRITON_INTERPRET=1``.
- ``sdpa``, ``flex``, ``reference``: torch's fused SDPA, FlexAttention and a plain-torch reference
  (:mod:`mcore.kernels.attention_torch`). SDPA can express neither sinks nor a returned log-sum-exp.

Default choice on CUDA, from one H200 (``benchmarks/attention.py``, bf16, Hq 32, Hkv 8, D 128, forward +
backward, 16,384 tokens per call, effective TFLOP/s on the causal work as issue #18 counts them; ours from its
kernel sweep at commit 5be4d1b, 2026-12-01, the short documents re-swept at 2884fd8 with the flex and varlen_attn
of that call in brackets; SDPA and MLA from the same benchmark the session before, FlexAttention and varlen_attn
otherwise from issue #18's table):

=====================  ============  ========  ======================  =================
case                   ours (triton) SDPA      FlexAttention compiled  torch varlen_attn
=====================  ============  ========  ======================  =================
1 x 16384              355           532       381                     316
4 x 4096               325           n/a       334                     277
32 x 512               199           n/a       140 (154)               128 (128)
128 x 128              106           n/a       46 (48)                 48 (44)
4 x 4096, window 128   98 (+sinks)   n/a       n/a                     n/a
1 x 16384 MLA 192/128  188           495       138                     n/a
=====================  ============  ========  ======================  =================

so:

- one plain causal (or full) document, no sinks, no returned LSE -> ``sdpa``, the fastest there (also with
  MLA's v head dim different from q's, which SDPA takes);
- packed documents, a window, sinks or a returned LSE in bf16/fp16 -> ``triton``: its tiles follow the documents
  and only it has sinks and the LSE (on 4 x 4096 it is level with compiled FlexAttention, which builds its block
  mask per layout and compiles per shape);
- fp32/fp64 with those features -> ``flex``.

Elsewhere (CPU): ``sdpa`` for plain attention and ``reference`` otherwise (the interpreter is for tests, eager
flex has no CPU backward). The choice is logged once per case class.
"""

from __future__ import annotations

import functools
import logging
import os

import torch

from mcore.kernels import dispatch
from mcore.kernels.attention_blocks import layout_attention
from mcore.kernels.attention_checks import (
    check_cu_seqlens,
    check_flag,
    check_max_seqlen,
    check_scale,
    check_sinks,
    check_tensors,
    check_window,
)
from mcore.kernels.attention_layout import AttentionLayout
from mcore.kernels.attention_torch import _document_ids, _flex_attention, _sdpa_attention, reference_attention

logger = logging.getLogger("mcore.kernels")

SDPA = "sdpa"
FLEX = "flex"
ATTENTION_BACKEND_ENV = "MCORE_ATTENTION_BACKEND"
ATTENTION_BACKENDS = ("auto", dispatch.TRITON, SDPA, FLEX, dispatch.REFERENCE)
_TENSOR_CORE_DTYPES = (torch.float16, torch.bfloat16)


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
    return_lse: bool = False,
    deterministic: bool = True,
    backend: str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention over ``q [b, s, Hq, D]``, ``k [b, s_k, Hkv, D]``, ``v [b, s_k, Hkv, Dv]`` (any strides);
    returns ``[b, s, Hq, Dv]``, and with ``return_lse`` also the ``[b, s, Hq]`` fp32 log-sum-exp.

    Query head ``h`` attends with key/value head ``h // (Hq // Hkv)`` (grouped-query attention).

    Args:
        causal: query ``i`` sees keys ``j <= i``. Needs ``s_k == s``.
        softmax_scale: multiplies the scores; ``None`` means ``1 / sqrt(D)``.
        window_size: ``W >= 1``: query ``i`` sees keys ``i - W < j <= i`` (HF ``sliding_window``); needs
            ``causal=True``.
        cu_seqlens: int32 ``[n + 1]`` cumulative document lengths over the flattened ``b * s`` tokens, from 0 to
            ``b * s``, with a boundary at every multiple of ``s``; tokens never attend across documents.
            Its values are checked (and block schedules built) on the host: pass it on the CPU to avoid a
            device sync (it may also live on ``q``'s device, at the cost of one sync per call).
        max_seqlen: optional upper bound on the longest document (checked).
        sinks: ``[Hq]`` per-head logits that join the softmax denominator only (GPT-OSS sinks).
        return_lse: also return ``log(sum_j exp(score_ij) [+ exp(sink)])`` per query row and head, natural log,
            differentiable (the building block of merging partial results, e.g. ring attention).
        deterministic: the Triton backward sums dQ in a fixed order (a separate dQ kernel); ``False`` uses fp32
            atomics instead. The default, since on an H200 (2026-12-01, ``benchmarks/attention.py``) the fixed
            order is also 2.2-2.4x faster (bwd 181 vs 75 TFLOP/s on one 16k document); the other backends are
            deterministic anyway.
        backend: ``"triton"``, ``"sdpa"``, ``"flex"`` or ``"reference"``; ``None`` picks per the module doc.
    """
    check_tensors(q, k, v, causal)
    b, s, n_heads, _ = q.shape
    softmax_scale = check_scale(softmax_scale, q.shape[-1])
    check_window(window_size, causal)
    check_flag("return_lse", return_lse)
    check_flag("deterministic", deterministic)
    bounds = None if cu_seqlens is None else check_cu_seqlens(cu_seqlens, q, b, s, k.shape[1])
    check_max_seqlen(max_seqlen, s if bounds is None else max(hi - lo for lo, hi in zip(bounds, bounds[1:])))
    if sinks is not None:
        check_sinks(sinks, q, n_heads)

    plain = window_size is None and cu_seqlens is None and sinks is None
    name = _select_backend(q, k, v, sinks, backend, plain=plain, return_lse=return_lse)
    if name == SDPA and (sinks is not None or return_lse):
        what = "add sinks to the softmax denominator" if sinks is not None else "return the log-sum-exp"
        raise ValueError(f"attention: the sdpa backend cannot {what}; use backend='triton', 'flex' or 'reference'")
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, sinks))
    if name == FLEX and q.device.type != "cuda" and needs_grad:
        raise ValueError(
            f"attention: the flex backend has no backward on {q.device.type} tensors (torch's FlexAttention "
            "backward needs CUDA); use backend='reference' or 'sdpa', or run under torch.no_grad()"
        )
    if name == dispatch.TRITON:
        layout = AttentionLayout.from_documents(b, s, k.shape[1], causal=causal, window_size=window_size, bounds=bounds)
        out, lse = layout_attention(
            q, k, v, layout, softmax_scale=softmax_scale, sinks=sinks, backend="triton", deterministic=deterministic
        )
        return (out, lse) if return_lse else out

    doc_ids = None if cu_seqlens is None else _document_ids(cu_seqlens.to(q.device, non_blocking=True), b, s)
    if name == SDPA:
        return _sdpa_attention(q, k, v, causal, softmax_scale, window_size, doc_ids)
    if name == FLEX:
        return _flex_attention(q, k, v, causal, softmax_scale, window_size, bounds, doc_ids, sinks, return_lse)
    return reference_attention(q, k, v, causal, softmax_scale, window_size, doc_ids, sinks, return_lse)


def _select_backend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sinks: torch.Tensor | None,
    backend: str | None,
    *,
    plain: bool,
    return_lse: bool = False,
) -> str:
    tensors = (q, k, v) if sinks is None else (q, k, v, sinks)
    plain = plain and sinks is None
    if backend is None:
        backend = attention_backend_from_env()
    if backend is not None or os.environ.get("MCORE_KERNELS_BACKEND"):
        return dispatch.choose("attention", *tensors, backend=backend, extra=(SDPA, FLEX))
    if q.device.type == "cuda":
        if plain and not return_lse:
            name, why = SDPA, "one plain document: SDPA's fused kernel is the fastest measured (532 vs ours 355)"
        elif q.dtype in _TENSOR_CORE_DTYPES and dispatch.triton_available():
            name, why = dispatch.TRITON, "documents/window/sinks/LSE: our kernel visits only their tiles"
        else:
            name, why = FLEX, f"{q.dtype} with documents/window/sinks/LSE: compiled FlexAttention"
    elif plain and not return_lse:
        name, why = SDPA, "plain attention on the CPU"
    else:
        name, why = dispatch.REFERENCE, "documents/window/sinks/LSE on the CPU (eager flex has no backward)"
    _log_default(name, q.device.type, why)
    return name


def attention_backend_from_env() -> str | None:
    """The backend ``MCORE_ATTENTION_BACKEND`` names (``None`` when unset or ``auto``): the one way to pick
    attention's backend for a whole model without changing the other ops' (a benchmark's or a user's choice)."""
    value = os.environ.get(ATTENTION_BACKEND_ENV, "").strip()
    if value not in ("", *ATTENTION_BACKENDS):
        raise ValueError(f"{ATTENTION_BACKEND_ENV}={value!r} is not a backend; expected one of {ATTENTION_BACKENDS}")
    return None if value in ("", "auto") else value


@functools.cache
def _log_default(name: str, device_type: str, why: str) -> None:
    logger.info("mcore.kernels.attention: using the %s backend (%s tensors; %s)", name, device_type, why)
