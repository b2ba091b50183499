"""Developer and CI sessions. ``nox -l`` lists them; ``nox -s tests`` is the README's test command.

Torch arrives first, as the wheel named by ``MCORE_TORCH`` (default: the CPU build these machines
carry); every mcore package leaves torch unpinned, so users elsewhere bring their own.
"""

from __future__ import annotations

import os
import pathlib

import nox

ROOT = pathlib.Path(__file__).parent
LAYERS = ["kernels", "parallel", "models", "train", "bridge"]
TORCH = os.environ.get("MCORE_TORCH", "torch==2.13.0")
TEST_DEPS = ["pytest>=8", "pytest-timeout", "numpy"]
# Independent references the tests compare against (never runtime dependencies).
LAYER_TEST_DEPS = {
    "kernels": ["transformers"],
    "parallel": [],
    "models": ["transformers"],
    "train": ["transformers", "megatron-core", "matplotlib"],
    "bridge": ["transformers"],
}

nox.options.sessions = ["lint", "tests"]
nox.options.reuse_existing_virtualenvs = True


def _install_layers(session: nox.Session, upto: str, editable: bool = True, test_deps: bool = True) -> None:
    session.install(*TORCH.split())  # MCORE_TORCH may carry pip options, e.g. an --index-url
    layers = LAYERS[: LAYERS.index(upto) + 1]
    if test_deps:
        extra = sorted({d for layer in layers for d in LAYER_TEST_DEPS[layer]})
        session.install(*TEST_DEPS, *extra)
    args: list[str] = []
    for layer in layers:
        args += (["-e"] if editable else []) + [str(ROOT / "packages" / f"mcore-{layer}")]
    session.install(*args)


def _pytest(session: nox.Session, *paths: str) -> None:
    env = {"TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    # Positional arguments replace the default paths: `nox -s tests -- tests/kernels -x`.
    session.run("pytest", *(session.posargs or paths), env=env)


@nox.session
def tests(session: nox.Session) -> None:
    """The whole CPU suite, every package installed editable."""
    _install_layers(session, "bridge")
    _pytest(session, "tests")


def _layer_session(layer: str):
    def run(session: nox.Session) -> None:
        _install_layers(session, layer)
        # Proves separate installability: the layers above are not installed in this venv.
        session.run("python", "-c", f"import importlib.util as u; assert u.find_spec('mcore.{layer}')")
        _pytest(session, f"tests/{layer}", "tests/test_layering.py")

    run.__doc__ = f"Tests of mcore-{layer}, with only it and the layers below installed."
    return run


for _layer in LAYERS:
    nox.session(name=f"tests-{_layer}")(_layer_session(_layer))


@nox.session
def lint(session: nox.Session) -> None:
    """ruff lint and format checks."""
    session.install("ruff")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def build(session: nox.Session) -> None:
    """Five wheels with hatch; each installed into a clean venv and imported."""
    session.install("hatch")
    dist = ROOT / "dist"
    for layer in LAYERS:
        session.chdir(ROOT / "packages" / f"mcore-{layer}")
        session.run("hatch", "build", "-t", "wheel", str(dist))
    session.chdir(ROOT)
    wheels = {layer: sorted(dist.glob(f"mcore_{layer}-*.whl"))[-1] for layer in LAYERS}
    for layer in LAYERS:
        venv = ROOT / ".nox" / f"wheel-{layer}"
        session.run("python", "-m", "venv", "--clear", str(venv))
        py = str(venv / "bin" / "python")
        session.run(py, "-m", "pip", "install", "-q", *TORCH.split(), external=True)
        below = [str(wheels[x]) for x in LAYERS[: LAYERS.index(layer) + 1]]
        session.run(py, "-m", "pip", "install", "-q", *below, external=True)
        session.run(py, "-c", f"import mcore.{layer}; print('mcore.{layer}', mcore.{layer}.__version__)", external=True)
    venv = ROOT / ".nox" / "wheel-kernels"
    session.run(
        str(venv / "bin" / "python"),
        "-c",
        "import torch; from mcore.kernels import rms_norm; "
        "x = torch.randn(4, 64); print('rms_norm on cpu:', rms_norm(x, torch.ones(64), 1e-6).shape)",
        external=True,
    )


@nox.session
def demo(session: nox.Session) -> None:
    """The main job: mcore-train on its embedded default (tiny GPT, CPU or GPU)."""
    _install_layers(session, "train", test_deps=False)  # the demo needs none of the test references
    session.run("mcore-train", *session.posargs)
