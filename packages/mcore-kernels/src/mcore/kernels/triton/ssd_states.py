"""Triton kernels of the SSD scan's two state matmuls, forward and backward (layouts of :mod:`.ssd`):

- chunk states: ``local[b, c, h] = sum_j w_j x_j^T B_j`` over the chunk's tokens (``[p, n]`` per head), with
  ``w_j`` the token's weight (decay to the chunk end x dt x same document as the chunk's last token, made by torch);
- inter-chunk output: ``y_i = v_i C_i S_in^T`` (``[p]`` per token and head), with ``S_in`` the state entering the
  chunk and ``v_i`` its decay to the token (x same document), made by torch.

Operands go into the dots in the input dtype (fp32 tests multiply exactly: ``ieee``), accumulation and every output
are fp32, as torch's fp32 matmuls were. Backward kernels run one program per (chunk, group, block of tokens) and loop
over the group's heads, so the group-shared ``dB`` / ``dC`` are summed in registers; the inter-chunk ``dS_in`` is
one partial per token block (one block when the chunk fits in 128 rows), added up by torch. No atomics.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mcore.kernels.triton.flash_attention import precision_for

ROWS = 64  # token rows per tile (chunk states); the inter-chunk kernels take up to 128


@triton.jit
def _chunk_state_fwd_kernel(X, W, B, LOCAL, Lp, H, G, NC, Q, P, N, PRECISION: tl.constexpr, BJ: tl.constexpr,
                            BP: tl.constexpr, BN: tl.constexpr):  # fmt: skip
    bc, h, nb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, c = bc // NC, bc % NC
    g, t0 = h // (H // G), c * Q
    offs_p, offs_n = tl.arange(0, BP), nb * BN + tl.arange(0, BN)
    mp, mn = offs_p < P, offs_n < N
    acc = tl.zeros((BP, BN), dtype=tl.float32)
    for jb in range(0, Q, BJ):
        offs_j = jb + tl.arange(0, BJ)
        mj = offs_j < Q
        tok = b * Lp + t0 + offs_j
        x = tl.load(X + (tok[:, None] * H + h) * P + offs_p[None, :], mask=mj[:, None] & mp[None, :], other=0.0)
        w = tl.load(W + tok * H + h, mask=mj, other=0.0)
        bj = tl.load(B + (tok[:, None] * G + g) * N + offs_n[None, :], mask=mj[:, None] & mn[None, :], other=0.0)
        xw = (x.to(tl.float32) * w[:, None]).to(bj.dtype)
        acc += tl.dot(tl.trans(xw), bj, input_precision=PRECISION)
    out = LOCAL + ((b * NC + c) * H + h) * P * N + offs_p[:, None] * N + offs_n[None, :]
    tl.store(out, acc, mask=mp[:, None] & mn[None, :])


@triton.jit
def _chunk_state_bwd_kernel(X, W, B, DLOCAL, DX, DW, DB, Lp, H, G, NC, Q, P, N, PRECISION: tl.constexpr,
                            BJ: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr):  # fmt: skip
    bc, g, jblock = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, c = bc // NC, bc % NC
    t0, hpg = c * Q, H // G
    offs_j, offs_p, offs_n = jblock * BJ + tl.arange(0, BJ), tl.arange(0, BP), tl.arange(0, BN)
    mj, mp, mn = offs_j < Q, offs_p < P, offs_n < N
    tok = b * Lp + t0 + offs_j
    bj = tl.load(B + (tok[:, None] * G + g) * N + offs_n[None, :], mask=mj[:, None] & mn[None, :], other=0.0)
    db = tl.zeros((BJ, BN), dtype=tl.float32)
    for h in range(g * hpg, (g + 1) * hpg):
        dl = tl.load(DLOCAL + ((b * NC + c) * H + h) * P * N + offs_p[:, None] * N + offs_n[None, :],
                     mask=mp[:, None] & mn[None, :], other=0.0).to(bj.dtype)  # fmt: skip
        x = tl.load(X + (tok[:, None] * H + h) * P + offs_p[None, :], mask=mj[:, None] & mp[None, :], other=0.0)
        w = tl.load(W + tok * H + h, mask=mj, other=0.0)
        t = tl.dot(bj, tl.trans(dl), input_precision=PRECISION)  # [BJ, BP]: d local / d (w x) per token
        tl.store(DX + (tok[:, None] * H + h) * P + offs_p[None, :], w[:, None] * t, mask=mj[:, None] & mp[None, :])
        tl.store(DW + tok * H + h, tl.sum(x.to(tl.float32) * t, axis=1), mask=mj)
        xw = (x.to(tl.float32) * w[:, None]).to(bj.dtype)
        db += tl.dot(xw, dl, input_precision=PRECISION)
    tl.store(DB + (tok[:, None] * G + g) * N + offs_n[None, :], db, mask=mj[:, None] & mn[None, :])


@triton.jit
def _inter_fwd_kernel(C, S, V, Y, Lp, H, G, NC, Q, P, N, PRECISION: tl.constexpr, BI: tl.constexpr,
                      BP: tl.constexpr, BN: tl.constexpr):  # fmt: skip
    ib, bc, h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, c = bc // NC, bc % NC
    g, t0 = h // (H // G), c * Q
    offs_i, offs_p, offs_n = ib * BI + tl.arange(0, BI), tl.arange(0, BP), tl.arange(0, BN)
    mi, mp, mn = offs_i < Q, offs_p < P, offs_n < N
    tok = b * Lp + t0 + offs_i
    ci = tl.load(C + (tok[:, None] * G + g) * N + offs_n[None, :], mask=mi[:, None] & mn[None, :], other=0.0)
    s = tl.load(S + ((b * NC + c) * H + h) * P * N + offs_p[:, None] * N + offs_n[None, :],
                mask=mp[:, None] & mn[None, :], other=0.0).to(ci.dtype)  # fmt: skip
    v = tl.load(V + tok * H + h, mask=mi, other=0.0)
    y = tl.dot(ci, tl.trans(s), input_precision=PRECISION) * v[:, None]
    tl.store(Y + (tok[:, None] * H + h) * P + offs_p[None, :], y, mask=mi[:, None] & mp[None, :])


@triton.jit
def _inter_bwd_kernel(C, S, V, DY, DC, DS_PART, DV, Lp, H, G, NC, Q, P, N, PRECISION: tl.constexpr,
                      BI: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr):  # fmt: skip
    bc, g, ib = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, c = bc // NC, bc % NC
    t0, hpg = c * Q, H // G
    offs_i, offs_p, offs_n = ib * BI + tl.arange(0, BI), tl.arange(0, BP), tl.arange(0, BN)
    mi, mp, mn = offs_i < Q, offs_p < P, offs_n < N
    tok = b * Lp + t0 + offs_i
    ci = tl.load(C + (tok[:, None] * G + g) * N + offs_n[None, :], mask=mi[:, None] & mn[None, :], other=0.0)
    dc = tl.zeros((BI, BN), dtype=tl.float32)
    for h in range(g * hpg, (g + 1) * hpg):
        s = tl.load(S + ((b * NC + c) * H + h) * P * N + offs_p[:, None] * N + offs_n[None, :],
                    mask=mp[:, None] & mn[None, :], other=0.0).to(ci.dtype)  # fmt: skip
        v = tl.load(V + tok * H + h, mask=mi, other=0.0)
        dy = tl.load(DY + (tok[:, None] * H + h) * P + offs_p[None, :], mask=mi[:, None] & mp[None, :], other=0.0)
        dyv = (dy * v[:, None]).to(ci.dtype)
        dc += tl.dot(dyv, s, input_precision=PRECISION)
        cs = tl.dot(ci, tl.trans(s), input_precision=PRECISION)  # [BI, BP]: C_i S^T
        tl.store(DV + tok * H + h, tl.sum(dy * cs, axis=1), mask=mi)
        ds = tl.dot(tl.trans(dyv), ci, input_precision=PRECISION)  # [BP, BN]
        part = ((((b * NC + c) * H + h) * tl.num_programs(2) + ib) * P + offs_p[:, None]) * N + offs_n[None, :]
        tl.store(DS_PART + part, ds, mask=mp[:, None] & mn[None, :])
    tl.store(DC + (tok[:, None] * G + g) * N + offs_n[None, :], dc, mask=mi[:, None] & mn[None, :])


def _pow2(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def chunk_state_forward(x, w, B, chunk: int) -> torch.Tensor:
    """``x`` [b, Lp, h, p], ``w`` [b, Lp, h] fp32, ``B`` [b, Lp, g, n] -> ``local`` [b, c, h, p * n] fp32."""
    b, lp, h, p = x.shape
    g, n = B.shape[2:]
    nc = lp // chunk
    bn = min(64, _pow2(n))
    local = torch.empty(b, nc, h, p * n, dtype=torch.float32, device=x.device)
    _chunk_state_fwd_kernel[(b * nc, h, triton.cdiv(n, bn))](
        x, w, B, local, lp, h, g, nc, chunk, p, n, PRECISION=precision_for(x.dtype), BJ=min(ROWS, _pow2(chunk)),
        BP=_pow2(p), BN=bn,
    )  # fmt: skip
    return local


def chunk_state_backward(dlocal, x, w, B, chunk: int):
    """``(dx fp32, dw, dB fp32)`` of :func:`chunk_state_forward`."""
    b, lp, h, p = x.shape
    g, n = B.shape[2:]
    nc, bj = lp // chunk, min(ROWS, _pow2(chunk))
    dx = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    dw = torch.empty_like(w)
    db = torch.empty(B.shape, dtype=torch.float32, device=x.device)
    _chunk_state_bwd_kernel[(b * nc, g, triton.cdiv(chunk, bj))](
        x, w, B, dlocal, dx, dw, db, lp, h, g, nc, chunk, p, n, PRECISION=precision_for(x.dtype), BJ=bj,
        BP=_pow2(p), BN=_pow2(n), num_warps=8,
    )  # fmt: skip
    return dx, dw, db


def inter_forward(C, S, v, heads: int, head_dim: int) -> torch.Tensor:
    """``C`` [b, Lp, g, n], ``S`` [b, c, h, p * n] fp32, ``v`` [b, Lp, h] fp32 -> ``y`` [b, Lp, h, p] fp32."""
    b, lp, g, n = C.shape
    nc, chunk = S.shape[1], lp // S.shape[1]
    bi = min(ROWS, _pow2(chunk))
    y = torch.empty(b, lp, heads, head_dim, dtype=torch.float32, device=C.device)
    _inter_fwd_kernel[(triton.cdiv(chunk, bi), b * nc, heads)](
        C, S, v, y, lp, heads, g, nc, chunk, head_dim, n, PRECISION=precision_for(C.dtype), BI=bi,
        BP=_pow2(head_dim), BN=_pow2(n),
    )  # fmt: skip
    return y


def inter_backward(dy, C, S, v):
    """``(dC fp32, dS [b, c, h, p * n] fp32, dv)`` of :func:`inter_forward`."""
    b, lp, h, p = dy.shape
    g, n = C.shape[2:]
    nc, chunk = S.shape[1], lp // S.shape[1]
    bi = min(128, _pow2(chunk))
    blocks = triton.cdiv(chunk, bi)
    dc = torch.empty(C.shape, dtype=torch.float32, device=C.device)
    ds_part = torch.empty(b, nc, h, blocks, p * n, dtype=torch.float32, device=C.device)
    dv = torch.empty_like(v)
    _inter_bwd_kernel[(b * nc, g, blocks)](
        C, S, v, dy, dc, ds_part, dv, lp, h, g, nc, chunk, p, n, PRECISION=precision_for(C.dtype), BI=bi,
        BP=_pow2(p), BN=_pow2(n), num_warps=8,
    )  # fmt: skip
    ds = ds_part[:, :, :, 0] if blocks == 1 else ds_part.sum(3)
    return dc, ds, dv
