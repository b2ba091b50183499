"""Fused GPU ops with pure-torch references.

Every public op runs on any device: on CUDA it dispatches to a Triton kernel, elsewhere to the torch
reference (``MCORE_KERNELS_BACKEND=reference|triton`` or the ``backend=`` keyword override it).
Triton itself is imported only when a Triton kernel is first launched.
"""

from __future__ import annotations

# Imported eagerly on purpose: two ops share their module's name (``attention``, ``cross_entropy``).
# Binding the functions here, after the submodules are loaded, keeps ``mcore.kernels.attention`` the
# function whatever a caller imports first.
from mcore.kernels.activations import geglu, swiglu
from mcore.kernels.attention import attention
from mcore.kernels.conv import causal_conv1d
from mcore.kernels.cross_entropy import cross_entropy
from mcore.kernels.fp8_casts import quantize_dual, quantize_fp8_pair
from mcore.kernels.fp8_gemm import scaled_matmul
from mcore.kernels.gated_norm import gated_rms_norm
from mcore.kernels.low_precision_linear import LowPrecisionLinear, Recipe
from mcore.kernels.microscaling import dequantize_mx, dequantize_nvfp4, quantize_mx, quantize_nvfp4
from mcore.kernels.moe import (
    expert_bias_update,
    grouped_gemm,
    load_balancing_loss,
    permute,
    plan_permutation,
    route,
    tokens_per_expert,
    unpermute,
    z_loss,
)
from mcore.kernels.norms import layer_norm, rms_norm
from mcore.kernels.optimizer import adamw_step_
from mcore.kernels.quantization import quantize_fp8
from mcore.kernels.rotary import apply_rotary, rope_cos_sin, rope_inv_freq
from mcore.kernels.ssd import ssd_scan

__version__ = "0.1.0"

__all__ = [
    "LowPrecisionLinear",
    "Recipe",
    "adamw_step_",
    "apply_rotary",
    "attention",
    "causal_conv1d",
    "cross_entropy",
    "dequantize_mx",
    "dequantize_nvfp4",
    "expert_bias_update",
    "gated_rms_norm",
    "geglu",
    "grouped_gemm",
    "layer_norm",
    "load_balancing_loss",
    "permute",
    "plan_permutation",
    "quantize_fp8",
    "quantize_fp8_pair",
    "quantize_dual",
    "quantize_mx",
    "quantize_nvfp4",
    "rms_norm",
    "rope_cos_sin",
    "rope_inv_freq",
    "route",
    "scaled_matmul",
    "ssd_scan",
    "swiglu",
    "tokens_per_expert",
    "unpermute",
    "z_loss",
]
