"""``embedding_lookup``: without DDP the gradient is ``F.embedding``'s bit for bit (tp's outside-of-slice tokens
included); under DDP it is added into ``main_grad`` at the looked-up rows (no ``.grad``, no dense table gradient)
and three NaN-poisoned steps of two micro-batches (untied and tied to the output layer, whose GEMM writes
``main_grad`` first) give the gradients, losses and weights of the ``F.embedding`` path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import mcore.parallel.tensor_parallel as tp_module
from mcore.parallel import ColumnParallelLinear, DistributedDataParallel, MixedPrecisionOptimizer
from mcore.parallel.embedding_lookup import embedding_lookup
from mcore.parallel.tensor_parallel import VocabParallelEmbedding

VOCAB, WIDTH, TOKENS, STEPS = 40, 16, 24, 3


def _dense_lookup(ids, weight, outside=None):
    """The formula ``VocabParallelEmbedding`` used before ``embedding_lookup``."""
    out = F.embedding(ids, weight)
    return out if outside is None else out.masked_fill(outside.unsqueeze(-1), 0.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("masked", [False, True])
def test_without_ddp_the_gradient_is_f_embeddings(dtype, masked):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 7, (5, 9), generator=g)  # few rows: every row repeats
    outside = torch.rand(5, 9, generator=g) < 0.3 if masked else None
    weight = torch.randn(11, WIDTH, generator=g).to(dtype)
    grad = torch.randn(5, 9, WIDTH, generator=g).to(dtype)
    results = []
    for fn in (embedding_lookup, _dense_lookup):
        w = weight.clone().requires_grad_()
        out = fn(ids, w, outside)
        out.backward(grad)
        results.append((out, w.grad))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    if masked:
        assert (results[0][0][outside] == 0).all()


class _Net(torch.nn.Module):
    def __init__(self, tied: bool) -> None:
        super().__init__()
        torch.manual_seed(11)
        self.embed = VocabParallelEmbedding(VOCAB, WIDTH)
        self.head = ColumnParallelLinear(WIDTH, VOCAB, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        logits = self.head(torch.tanh(self.embed(ids)))
        return F.cross_entropy(logits.float().reshape(-1, VOCAB), ids.roll(1).reshape(-1))


def _run(tied: bool, lookup, device: str = "cpu", dtype=torch.float32, monkeypatch=None) -> dict:
    if monkeypatch is not None:
        monkeypatch.setattr(tp_module, "embedding_lookup", lookup)
    model = _Net(tied).to(device, dtype)
    ddp = DistributedDataParallel(model, None, bucket_size=256)
    opt = MixedPrecisionOptimizer(ddp, lr=0.05, clip_grad=1.0, fused_step=device == "cuda")
    out = {"grads": [], "losses": [], "dot_grad": []}
    for step in range(STEPS):
        for buf in ddp.grad_buffers:
            buf.grad_data.fill_(float("nan"))
        opt.zero_grad()
        loss = 0.0
        for micro in range(2):
            gen = torch.Generator().manual_seed(10 * step + micro)
            ids = torch.randint(0, VOCAB // 2, (TOKENS,), generator=gen).to(device)  # half the table, repeated
            with ddp.no_sync() if micro == 0 else torch.enable_grad():
                micro_loss = ddp(ids)
                micro_loss.backward()
            loss += float(micro_loss.detach())
        ddp.finish_grad_sync()
        out["dot_grad"].append(model.embed.weight.grad is None)
        out["grads"].append([p.main_grad.clone() for p in model.parameters()])
        out["losses"].append(loss)
        opt.step()
    out["weights"] = [p.detach().clone() for p in model.parameters()]
    return out


def _close(a: dict, b: dict, tol: float) -> None:
    for key in ("grads", "weights"):
        for x, y in zip(sum(a[key], []) if key == "grads" else a[key], sum(b[key], []) if key == "grads" else b[key],
                        strict=True):  # fmt: skip
            assert torch.isfinite(x).all(), key
            torch.testing.assert_close(x, y, rtol=tol, atol=tol, msg=key)
    assert a["losses"] == pytest.approx(b["losses"], rel=tol)


@pytest.mark.parametrize("tied", [False, True])
def test_under_ddp_rows_go_into_main_grad_and_match_the_dense_path(tied, monkeypatch):
    calls = []

    def counted(ids, weight, outside=None):
        calls.append(1)
        return embedding_lookup(ids, weight, outside)

    ours = _run(tied, counted, monkeypatch=monkeypatch)
    dense = _run(tied, _dense_lookup, monkeypatch=monkeypatch)
    assert len(calls) == 2 * STEPS
    assert ours["dot_grad"] == [True] * STEPS
    # fp32: only the summation order differs (rows added into main_grad one token at a time vs. summed first)
    _close(ours, dense, 1e-5)
    # the untouched half of the table gets no embedding gradient (untied: exactly zero)
    if not tied:
        assert all((g[0][VOCAB // 2 :] == 0).all() for g in ours["grads"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tied", [False, True])
def test_under_ddp_on_cuda_in_bf16(tied, monkeypatch):
    ours = _run(tied, embedding_lookup, "cuda", torch.bfloat16, monkeypatch)
    dense = _run(tied, _dense_lookup, "cuda", torch.bfloat16, monkeypatch)
    # ours sums in fp32, the dense path rounds the table gradient to bf16 before adding it
    _close(ours, dense, 2e-2)
