"""The one error type the bridge raises for bad input.

Every message is a single line that names what was expected, what was found and, where there is one, the
fix; the CLI prints it as ``mcore-bridge: error: <message>`` and exits with status 2.
"""

from __future__ import annotations


class BridgeError(ValueError):
    """A conversion, verification or inspection cannot proceed because of its input."""

    def __init__(self, message: str) -> None:
        # Callers build messages from paths and values that may contain newlines; one line keeps logs greppable.
        super().__init__(" ".join(message.split()))
