"""cross_entropy: torch reference and Triton kernel against float64 ``F.cross_entropy``.

Without CUDA the Triton kernels run on CPU tensors through the interpreter (``conftest.py`` sets
``TRITON_INTERPRET=1``); on a GPU machine the same tests run both backends on the device.
"""

import importlib
import itertools

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from mcore.kernels import cross_entropy

# The module itself, by its import path: the package attribute of the same name is the function.
ce_module = importlib.import_module("mcore.kernels.cross_entropy")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BACKENDS = ["reference", "triton"]
TOL = {  # relative error of loss / gradient vs float64 (fp32 math; the gradient is stored in the logits dtype)
    torch.float32: (1e-5, 1e-5),
    torch.float16: (1e-5, 2e-3),
    torch.bfloat16: (1e-5, 1e-2),
}


def _float64_loss(logits, target, *, ignore_index=-100, z_loss_weight=0.0, valid_vocab_size=None):
    """Independent float64 reference: F.cross_entropy on the valid columns plus the PaLM z-loss."""
    valid = logits.shape[1] if valid_vocab_size is None else valid_vocab_size
    x = logits[:, :valid]
    loss = F.cross_entropy(x, target.long(), ignore_index=ignore_index, reduction="none")
    z = z_loss_weight * torch.logsumexp(x, dim=1).square()
    return loss + torch.where(target == ignore_index, 0.0, z)


def _random_problem(n, v, dtype, *, ignore_index=-100, n_ignored=3, valid=None, scale=4.0):
    logits = (torch.randn(n, v, device=DEVICE) * scale).to(dtype)
    target = torch.randint(0, valid or v, (n,), device=DEVICE)
    target[torch.randperm(n, device=DEVICE)[:n_ignored]] = ignore_index
    return logits, target


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _check_against_float64(logits, target, loss, grad, grad_loss, **kw):
    xd = logits.detach().double().requires_grad_()
    ref = _float64_loss(xd, target, **kw)
    ref.backward(grad_loss.double())
    loss_tol, grad_tol = TOL[logits.dtype]
    assert loss.dtype == torch.float32 and loss.shape == target.shape
    assert torch.isfinite(loss).all()
    assert _rel(loss, ref) < loss_tol, (_rel(loss, ref), loss_tol)
    assert grad.dtype == logits.dtype and grad.shape == logits.shape
    assert _rel(grad, xd.grad) < grad_tol, (_rel(grad, xd.grad), grad_tol)
    ignored = target == kw.get("ignore_index", -100)
    assert (loss[ignored] == 0).all() and (grad[ignored] == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "dtype,n,v,z_loss_weight",
    [
        (torch.float32, 33, 1000, 0.0),
        (torch.float32, 17, 777, 1e-3),  # odd vocab, not a multiple of any block
        (torch.float16, 24, 1000, 1e-4),
        (torch.bfloat16, 29, 1201, 0.0),
        (torch.bfloat16, 9, 5, 1e-2),  # tiny vocab: one partial block
    ],
)
def test_matches_float64(backend, dtype, n, v, z_loss_weight):
    logits, target = _random_problem(n, v, dtype)
    x = logits.clone().requires_grad_()
    loss = cross_entropy(x, target, z_loss_weight=z_loss_weight, backend=backend)
    grad_loss = torch.rand(n, device=DEVICE) + 0.5
    loss.backward(grad_loss)
    _check_against_float64(logits, target, loss, x.grad, grad_loss, z_loss_weight=z_loss_weight)
    assert torch.equal(x.detach(), logits)  # not in place unless asked


@pytest.mark.parametrize("backend", BACKENDS)
def test_ignore_index_that_is_a_real_column_and_int32_targets(backend):
    logits, target = _random_problem(20, 300, torch.float32, ignore_index=0, n_ignored=5)
    target = target.int()
    x = logits.clone().requires_grad_()
    loss = cross_entropy(x, target, ignore_index=0, z_loss_weight=1e-3, backend=backend)
    grad_loss = torch.randn(20, device=DEVICE)
    loss.backward(grad_loss)
    _check_against_float64(logits, target, loss, x.grad, grad_loss, ignore_index=0, z_loss_weight=1e-3)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_valid_vocab_size_excludes_padding(backend, dtype):
    n, v, valid = 26, 1024, 1001
    logits, target = _random_problem(n, v, dtype, valid=valid)
    logits[:, valid:] = 50.0  # padding that would dominate the softmax if it leaked in
    x = logits.clone().requires_grad_()
    loss = cross_entropy(x, target, valid_vocab_size=valid, z_loss_weight=1e-4, backend=backend)
    grad_loss = torch.rand(n, device=DEVICE)
    loss.backward(grad_loss)
    assert (x.grad[:, valid:] == 0).all()
    _check_against_float64(logits, target, loss, x.grad, grad_loss, valid_vocab_size=valid, z_loss_weight=1e-4)


def _run_sharded(shards, starts, target, backend, **kw):
    """Run each vocab shard's forward in turn; ``reduce`` serves each call from the other shards' inputs.

    The forward is deterministic, so a round records every shard's input to reduce call ``i`` and the next
    round answers call ``i`` with their max/sum; after (number of calls + 1) rounds every answer is exact.
    A shard may raise while some of its calls went unanswered (its statistics were still local); an error
    raised with every call answered is real and propagates.
    """
    combine = {"max": lambda ts: torch.stack(ts).amax(0), "sum": lambda ts: torch.stack(ts).sum(0)}
    answers: dict[int, torch.Tensor] = {}
    for _round in range(6):
        recorded = [[] for _ in shards]
        losses = []
        for r, shard in enumerate(shards):

            def reduce(t, op, calls=recorded[r], answers=answers):
                calls.append((op, t.clone()))
                if len(calls) - 1 in answers:
                    t.copy_(answers[len(calls) - 1])

            try:
                losses.append(
                    cross_entropy(shard, target, vocab_start_index=starts[r], reduce=reduce, backend=backend, **kw)
                )
            except ValueError:
                if len(recorded[r]) <= len(answers):
                    raise
        ops = [[op for op, _ in calls] for calls in recorded]
        assert all(o == ops[0] for o in ops) and set(ops[0]) <= {"max", "sum"}, ops
        new = {i: combine[op]([calls[i][1] for calls in recorded]) for i, op in enumerate(ops[0])}
        if set(new) == set(answers) and all(torch.equal(new[i], answers[i]) for i in new):
            return losses
        answers = new
    raise AssertionError("the sharded forward did not settle: reduce inputs keep changing")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "dtype,widths,valid,z_loss_weight",
    [
        (torch.float32, [250, 250, 250, 250], None, 0.0),
        (torch.bfloat16, [384, 384, 232], 937, 1e-3),  # uneven shards, the last one partly padding
        (torch.float32, [300, 300, 300, 300], 870, 1e-4),  # the last shard is all padding
    ],
)
def test_vocab_sharded_matches_unsharded_float64(backend, dtype, widths, valid, z_loss_weight):
    n = 21
    logits, target = _random_problem(n, sum(widths), dtype, valid=valid)
    starts = [0, *itertools.accumulate(widths)][:-1]
    shards = [logits[:, s : s + w].clone().requires_grad_() for s, w in zip(starts, widths)]
    losses = _run_sharded(shards, starts, target, backend, valid_vocab_size=valid, z_loss_weight=z_loss_weight)
    for loss in losses[1:]:
        assert torch.equal(loss, losses[0])  # every shard ends with the same loss
    grad_loss = torch.rand(n, device=DEVICE)
    for loss in losses:
        loss.backward(grad_loss)
    grad = torch.cat([s.grad for s in shards], dim=1)
    _check_against_float64(
        logits, target, losses[0], grad, grad_loss, valid_vocab_size=valid, z_loss_weight=z_loss_weight
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_sharded_target_outside_vocab(backend):
    logits, target = _random_problem(6, 200, torch.float32, valid=150, n_ignored=0)
    shards, starts = [logits[:, :100], logits[:, 100:]], [0, 100]
    target[4] = 170  # a padding column: no shard owns it as a valid target
    if DEVICE == "cpu":
        with pytest.raises(ValueError, match=r"target\[4\] = 170"):
            _run_sharded(shards, starts, target, backend, valid_vocab_size=150)
    else:
        loss = _run_sharded(shards, starts, target, backend, valid_vocab_size=150)[0]
        assert torch.isnan(loss[4]) and torch.isfinite(loss[:4]).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_inplace_backward_overwrites_logits_with_the_gradient(backend):
    logits, target = _random_problem(12, 500, torch.bfloat16)
    grad_loss = torch.rand(12, device=DEVICE)
    expected = logits.clone().requires_grad_()
    cross_entropy(expected, target, z_loss_weight=1e-3, backend=backend).backward(grad_loss)

    x = logits.clone().requires_grad_()
    loss = cross_entropy(x, target, z_loss_weight=1e-3, inplace_backward=True, backend=backend)
    loss.backward(grad_loss, retain_graph=True)
    assert x.grad.data_ptr() == x.data_ptr()
    torch.testing.assert_close(x.grad, expected.grad, rtol=0, atol=0)
    with pytest.raises(RuntimeError):
        loss.backward(grad_loss)


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_logits(backend):
    n, v = 15, 640
    wide = (torch.randn(n, v + 64, device=DEVICE) * 3).to(torch.bfloat16)
    target = torch.randint(0, v, (n,), device=DEVICE)
    grad_loss = torch.rand(n, device=DEVICE)
    # A row-strided slice (no copy) and a column-strided transpose (copied for the kernel).
    for logits in (wide[:, :v], wide[:, :v].t().contiguous().t()):
        x = logits.detach().requires_grad_()
        loss = cross_entropy(x, target, backend=backend)
        loss.backward(grad_loss)
        _check_against_float64(logits.contiguous(), target, loss, x.grad, grad_loss)


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_tokens(backend):
    x = torch.randn(0, 100, device=DEVICE, requires_grad=True)
    loss = cross_entropy(x, torch.empty(0, dtype=torch.long, device=DEVICE), backend=backend)
    loss.sum().backward()
    assert loss.shape == (0,) and x.grad.shape == (0, 100)


class _LargestFloat32(TorchDispatchMode):
    """Records the largest fp32 tensor any torch op produces."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                self.largest = max(self.largest, t.numel())
        return out


def test_reference_never_materializes_fp32_logits(monkeypatch):
    monkeypatch.setattr(ce_module, "_CHUNK_ELEMENTS", 4096)
    n, v = 64, 1000  # 4 rows per chunk
    logits, target = _random_problem(n, v, torch.bfloat16)
    x = logits.clone().requires_grad_()
    with _LargestFloat32() as mode:
        loss = cross_entropy(x, target, z_loss_weight=1e-3, backend="reference")
        loss.backward(torch.ones(n, device=DEVICE))
    assert mode.largest <= 4 * v, f"an fp32 tensor of {mode.largest} elements appeared (logits hold {n * v})"
    grad_loss = torch.ones(n, device=DEVICE)
    _check_against_float64(logits, target, loss, x.grad, grad_loss, z_loss_weight=1e-3)


def test_unsharded_target_outside_vocab_raises():
    logits, target = _random_problem(8, 100, torch.float32, n_ignored=0)
    target = target.cpu()
    target[5] = 100
    with pytest.raises(ValueError, match=r"target\[5\] = 100 .*\[0, 100\)"):
        cross_entropy(logits.cpu(), target)
    target = target % 80
    target[5] = 90
    with pytest.raises(ValueError, match=r"target\[5\] = 90 .*\[0, 80\)"):
        cross_entropy(logits.cpu(), target, valid_vocab_size=80)


def _bad_calls():
    x = torch.randn(4, 10)
    y = torch.randint(0, 10, (4,))
    return [
        ((x[None], y), {}, ValueError, r"logits must be 2-D \[N, V\], got shape \(1, 4, 10\)"),
        ((x.double(), y), {}, TypeError, r"logits dtype .* got torch.float64"),
        ((x, y.float()), {}, TypeError, r"target dtype .* got torch.float32"),
        ((x, y[:3]), {}, ValueError, r"target must have shape \[N\] = \(4,\) .* got \(3,\)"),
        ((x, y[:, None]), {}, ValueError, r"target must have shape"),
        ((x, y.to("meta")), {}, ValueError, r"one device, got cpu and meta"),
        (([1.0], y), {}, TypeError, r"must be tensors, got list"),
        ((x[:, :0], y), {}, ValueError, r"at least one column"),
        ((x, y), {"z_loss_weight": -1.0}, ValueError, r"z_loss_weight must be a finite float >= 0, got -1.0"),
        ((x, y), {"z_loss_weight": float("nan")}, ValueError, r"z_loss_weight"),
        ((x, y), {"valid_vocab_size": 0}, ValueError, r"valid_vocab_size must be None or an int >= 1, got 0"),
        ((x, y), {"valid_vocab_size": 11}, ValueError, r"valid_vocab_size=11 exceeds the 10 columns"),
        ((x, y), {"vocab_start_index": 10}, ValueError, r"vocab_start_index=10 .* needs reduce"),
        ((x, y), {"vocab_start_index": -1, "reduce": lambda t, op: None}, ValueError, r">= 0, got -1"),
        ((x, y), {"reduce": "sum"}, TypeError, r"reduce must be callable"),
        ((x, y), {"ignore_index": 1.5}, TypeError, r"ignore_index must be an int, got 1.5"),
        ((x, y), {"inplace_backward": 1}, TypeError, r"inplace_backward must be a bool"),
        ((x, y), {"backend": "cuda"}, ValueError, r"unknown backend 'cuda'"),
    ]


@pytest.mark.parametrize("args,kwargs,error,match", _bad_calls())
def test_bad_input(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        cross_entropy(*args, **kwargs)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
def test_gpu_bf16_llama3_vocab_and_memory(backend):
    """bf16 at Llama-3's vocabulary: float64 agreement, and no fp32 copy of the logits on the device."""
    n, v, valid = 1024, 128256, 128000
    logits, target = _random_problem(n, v, torch.bfloat16, valid=valid, n_ignored=17)
    x = logits.clone().requires_grad_()
    grad_loss = torch.rand(n, device="cuda")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss = cross_entropy(x, target, valid_vocab_size=valid, z_loss_weight=1e-4, backend=backend)
    loss.backward(grad_loss)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    fp32_copy = n * v * 4
    # The gradient buffer (bf16) is the one [N, V] allocation; chunks of the reference stay far below fp32 size.
    assert extra < n * v * 2 + fp32_copy // 2, (extra, fp32_copy)
    _check_against_float64(logits, target, loss, x.grad, grad_loss, valid_vocab_size=valid, z_loss_weight=1e-4)
