"""Turn a Hugging Face hub id into a local directory (downloaded, or from the local cache when offline)."""

from __future__ import annotations

import re
from pathlib import Path

from mcore.bridge.errors import BridgeError

# config, weights, tokenizer and generation files; no pickle weights and no second copy of the weights in another
# layout (Mistral repositories also ship consolidated.safetensors, Llama ones original/consolidated.*.pth)
HUB_PATTERNS = [
    "*.json",
    "model*.safetensors",
    "tokenizer.model*",
    "*.txt",
    "*.tiktoken",
    "*.jinja",
    "*.md",
    "LICENSE*",
]
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?(@[\w./-]+)?$")


def looks_like_hub_id(text: str) -> bool:
    """``owner/name`` or ``name``, optionally ``@revision``; never a path that exists or starts like a path."""
    return bool(_REPO_ID.match(text)) and not text.startswith((".", "/", "~")) and not Path(text).exists()


def fetch(hub_id: str) -> Path:
    """Return the local snapshot directory of ``hub_id`` (``owner/name[@revision]``).

    Downloads what is missing; with ``HF_HUB_OFFLINE=1`` or without a network it uses the local cache, and fails
    with one line naming the cause when the model is neither reachable nor cached.
    """
    from huggingface_hub import snapshot_download  # imported here: the common local-directory path needs no hub

    repo_id, _, revision = hub_id.partition("@")
    try:
        # snapshot_download itself falls back to the cache when the hub is unreachable or HF_HUB_OFFLINE=1
        return Path(snapshot_download(repo_id, revision=revision or None, allow_patterns=HUB_PATTERNS))
    except Exception as exc:  # noqa: BLE001 - the hub raises many types (HTTP, validation, cache misses)
        first_sentence = str(exc).split(". ")[0]
        raise BridgeError(
            f"cannot get {hub_id!r} from the Hugging Face hub nor the local cache ({type(exc).__name__}: "
            f"{first_sentence}); check the id, log in for a gated model, or download it once with network access"
        ) from None
