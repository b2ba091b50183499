"""Gated activations of a fused ``[gate, up]`` projection: SwiGLU and GeGLU.

``x[..., :n]`` is the gate and ``x[..., n:]`` the up projection (the layout of mcore's fused
``mlp.gate_up`` weight). Each op is one ``torch.autograd.Function`` whose backward returns the gradient
of the concatenated input; Triton on CUDA, a pure-torch reference elsewhere, fp32 math in both.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from mcore.kernels import dispatch

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_GELU_APPROXIMATIONS = {"tanh": "gelu_tanh", "none": "gelu"}


def swiglu(x: torch.Tensor, *, backend: str | None = None) -> torch.Tensor:
    """``silu(gate) * up`` for ``x = cat([gate, up], -1)`` of shape ``[..., 2n]``; returns ``[..., n]``.

    ``x`` is fp16/bf16/fp32 with any leading dims; the result has x's dtype. ``backend`` is
    ``"triton"``, ``"reference"`` or ``None`` (let :func:`mcore.kernels.dispatch.choose` decide).
    """
    check_gate_up_input("swiglu", x)
    chosen = dispatch.choose("swiglu", x, backend=backend)
    return _GLUFunction.apply(x, "silu", chosen)


def geglu(x: torch.Tensor, *, approximate: str = "tanh", backend: str | None = None) -> torch.Tensor:
    """``gelu(gate) * up`` for ``x = cat([gate, up], -1)``; ``approximate`` is ``"tanh"`` or ``"none"`` (erf).

    Same shapes, dtypes and ``backend`` as :func:`swiglu`; ``approximate`` has the meaning of
    ``torch.nn.functional.gelu``'s argument of that name.
    """
    if approximate not in _GELU_APPROXIMATIONS:
        raise ValueError(f"geglu: approximate must be one of {sorted(_GELU_APPROXIMATIONS)}, got {approximate!r}")
    check_gate_up_input("geglu", x)
    chosen = dispatch.choose("geglu", x, backend=backend)
    return _GLUFunction.apply(x, _GELU_APPROXIMATIONS[approximate], chosen)


def check_gate_up_input(op: str, x: torch.Tensor) -> None:
    """One error naming ``op`` unless ``x`` is a float16/bfloat16/float32 tensor ``[..., 2n]`` (``[gate, up]``)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{op}: x must be float16, bfloat16 or float32, got {x.dtype}")
    if x.dim() < 1 or x.shape[-1] == 0 or x.shape[-1] % 2:
        raise ValueError(
            f"{op}: x must be [..., 2n] (gate and up concatenated on the last dim, n >= 1), "
            f"got shape {tuple(x.shape)} whose last dim is not a positive even number"
        )


def _activation_and_grad(g: torch.Tensor, activation: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(act(g), act'(g))`` for fp32 ``g``, written out so the backward needs no autograd graph."""
    if activation == "silu":
        s = torch.sigmoid(g)
        return g * s, s * (1 + g * (1 - s))
    if activation == "gelu_tanh":
        k = math.sqrt(2 / math.pi)
        t = torch.tanh(k * (g + 0.044715 * g**3))
        grad = 0.5 * (1 + t) + 0.5 * g * (1 - t * t) * k * (1 + 3 * 0.044715 * g * g)
        return 0.5 * g * (1 + t), grad
    cdf = 0.5 * (1 + torch.erf(g / math.sqrt(2)))
    return g * cdf, cdf + g * torch.exp(-0.5 * g * g) / math.sqrt(2 * math.pi)


def reference_forward(x: torch.Tensor, activation: str) -> torch.Tensor:
    """Pure-torch ``act(gate) * up`` (fp32 math, result in x's dtype)."""
    gate, up = x.float().chunk(2, dim=-1)
    if activation == "silu":
        act = F.silu(gate)
    else:
        act = F.gelu(gate, approximate="tanh" if activation == "gelu_tanh" else "none")
    return (act * up).to(x.dtype)


def reference_backward(dy: torch.Tensor, x: torch.Tensor, activation: str) -> torch.Tensor:
    """Pure-torch gradient of the concatenated input: ``[dy * up * act'(gate), dy * act(gate)]``."""
    gate, up = x.float().chunk(2, dim=-1)
    dyf = dy.float()
    act, grad = _activation_and_grad(gate, activation)
    return torch.cat((dyf * up * grad, dyf * act), dim=-1).to(x.dtype)


def _backend_impl(backend: str):
    if backend == dispatch.TRITON:
        from mcore.kernels.triton import activations as triton_activations

        return triton_activations.glu_forward, triton_activations.glu_backward
    return reference_forward, reference_backward


class _GLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, activation, backend):
        forward_fn, _ = _backend_impl(backend)
        ctx.save_for_backward(x)
        ctx.activation = activation
        ctx.backend = backend
        return forward_fn(x, activation)

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        _, backward_fn = _backend_impl(ctx.backend)
        return backward_fn(dy, x, ctx.activation), None, None
