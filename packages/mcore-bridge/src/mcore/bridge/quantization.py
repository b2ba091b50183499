"""The quantized checkpoint formats the bridge reads, by ``config.json``'s ``quantization_config.quant_method``.

A Hugging Face directory whose ``quantization_config`` names any other method (or is malformed) is refused when it
is opened, before anything is written: its tensors would otherwise be read as if they were plain weights. A module
that reads a new format adds its method here.
"""

from __future__ import annotations

from typing import Any

from mcore.bridge.errors import BridgeError

__all__ = ["READERS", "quant_method"]

QUANT_KEY = "quantization_config"
# quant_method -> what reads it
READERS: dict[str, str] = {
    "mxfp4": "GPT-OSS's MXFP4 experts, dequantized on import (mcore.bridge.mxfp4)",
    "bitnet": "BitNet's packed ternary weights (mcore.bridge.bitnet_packing)",
    "fp8": "DeepSeek's block-wise FP8 weights, dequantized on import (mcore.bridge.fp8_blocks)",
}


def quant_method(config: dict[str, Any], where: str) -> str | None:
    """The ``quant_method`` of ``config`` (``None`` without a ``quantization_config``); BridgeError for one that no
    reader handles."""
    quant = config.get(QUANT_KEY)
    if quant is None:
        return None
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    if method not in READERS:
        known = ", ".join(f'"{m}" ({what})' for m, what in READERS.items())
        raise BridgeError(
            f"{where}: quantization_config {quant!r} is not supported; the bridge reads plain weights and {known}. "
            "Dequantize the checkpoint first"
        )
    return method
