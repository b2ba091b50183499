"""Size limits of the code in ``packages/``: no file over 500 lines, no function over 80 lines.

Small files with one purpose and short functions are house rules (CONTRIBUTING); this test keeps them.
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 80
# Triton kernels only: a kernel is one device function whose body cannot call helpers cheaply (every helper is
# inlined anyway, and splitting one hides the memory-access pattern that the kernel's comments explain).
# Each entry must be a function decorated with triton.jit; the test checks that too.
LONG_TRITON_KERNELS = {
    ("packages/mcore-kernels/src/mcore/kernels/triton/rotary.py", "_rotary_kernel"),
    ("packages/mcore-kernels/src/mcore/kernels/triton/flash_attention.py", "_fwd_kernel"),
}


def _python_files(root: pathlib.Path) -> list[pathlib.Path]:
    return sorted((root / "packages").glob("*/src/**/*.py"))


def _is_triton_kernel(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    for decorator in node.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        if ast.unparse(target) in ("triton.jit", "jit"):
            return True
    return False


def size_problems(root: pathlib.Path = ROOT, allowed: set[tuple[str, str]] = LONG_TRITON_KERNELS) -> list[str]:
    problems = []
    for path in _python_files(root):
        rel = path.relative_to(root).as_posix()
        text = path.read_text(encoding="utf-8")
        lines = text.count("\n")
        if lines > MAX_FILE_LINES:
            problems.append(f"{rel}: {lines} lines (limit {MAX_FILE_LINES}): split it by purpose")
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            length = node.end_lineno - node.lineno + 1
            if (rel, node.name) in allowed:
                if not _is_triton_kernel(node):
                    problems.append(f"{rel}:{node.lineno}: {node.name} is allow-listed but is no Triton kernel")
            elif length > MAX_FUNCTION_LINES:
                problems.append(f"{rel}:{node.lineno}: {node.name} has {length} lines (limit {MAX_FUNCTION_LINES})")
    return problems


def test_no_file_or_function_over_the_limits():
    assert size_problems() == []


def test_the_checker_finds_long_files_and_functions(tmp_path):
    src = tmp_path / "packages" / "mcore-x" / "src" / "mcore" / "x"
    src.mkdir(parents=True)
    body = "\n".join(f"    a{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    (src / "long.py").write_text(f"def long():\n{body}\n\n\ndef short():\n    return 1\n")
    (src / "big.py").write_text("x = 1\n" * (MAX_FILE_LINES + 1))
    kernel = f"import triton\n\n\n@triton.jit\ndef kernel():\n{body}\n"
    (src / "kernel.py").write_text(kernel)
    (src / "fake.py").write_text(f"def not_a_kernel():\n{body}\n")
    allowed = {
        ("packages/mcore-x/src/mcore/x/kernel.py", "kernel"),
        ("packages/mcore-x/src/mcore/x/fake.py", "not_a_kernel"),
    }
    problems = size_problems(tmp_path, allowed)
    assert len(problems) == 3, problems
    assert any("long has 81 lines" in p for p in problems)
    assert any("big.py: 501 lines" in p for p in problems)
    assert any("not_a_kernel is allow-listed but is no Triton kernel" in p for p in problems)
