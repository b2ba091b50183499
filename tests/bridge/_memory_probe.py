"""Run one conversion in a fresh process and report its memory (``python _memory_probe.py SRC DST``).

Prints JSON: ``baseline`` (VmRSS after every import the conversion needs), ``peak`` (VmHWM after it), in bytes.
Kept out of the test process so that the test's own allocations never count.
"""

from __future__ import annotations

import json
import sys


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def main() -> None:
    src, dst = sys.argv[1], sys.argv[2]
    import torch

    from mcore.bridge.convert import convert
    from mcore.models.families import get_config
    from mcore.train.checkpoint import expected_model_tensors

    expected_model_tensors(get_config("llama-tiny"))  # first use of the model code loads its lazy imports
    torch.set_num_threads(1)
    baseline = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:  # reset VmHWM to the current RSS
        f.write("5")
    convert(src, dst, progress=False)
    print(json.dumps({"baseline": baseline, "peak": _status("VmHWM")}))


if __name__ == "__main__":
    main()
