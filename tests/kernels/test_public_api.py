import subprocess
import sys

import pytest


@pytest.mark.parametrize("first", ["mcore.kernels.attention", "mcore.kernels.cross_entropy", "mcore.kernels"])
def test_op_names_stay_functions_whatever_is_imported_first(first):
    code = (
        f"import {first}\n"
        "import sys, mcore.kernels as k\n"
        "bad = [n for n in k.__all__ if not callable(getattr(k, n))]\n"
        "assert not bad, bad\n"
        "assert 'triton' not in sys.modules, 'importing mcore.kernels must not import triton'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
