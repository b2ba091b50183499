"""Triton kernels of the SSD scan: the intra-chunk output (forward and backward) and the state passing between
chunks (forward and backward). :mod:`mcore.kernels.ssd_triton` composes them with torch matmuls.

Layouts (contiguous; ``Lp`` = sequence padded to whole chunks of ``Q`` tokens, ``c = Lp / Q``):
``x`` ``[b, Lp, h, p]`` (input dtype), ``dt`` / ``cs`` ``[b, Lp, h]`` fp32 (discretized step, and the cumulative sum
of ``dt * A`` from the chunk start), ``seq`` ``[b, Lp]`` int32 document index, ``CB`` ``[b, c, g, Q, Q]`` fp32
(``C_i . B_j`` per group), states ``[b, c, h, p * n]`` fp32.

Intra-chunk output of token ``i`` of a chunk, head ``h`` (group ``g``):
``y_i = sum_{j <= i, same document} CB_ij exp(cs_i - cs_j) dt_j x_j``. The decay is masked before the ``exp`` (so
``j > i`` can never overflow) and never leaves registers: what torch would hold as ``[b, c, Q, Q, h]`` is a tile here.
Its backward, with ``P_ij = CB_ij exp(cs_i - cs_j) [mask]`` and ``a_ij = dy_i . x_j``:
``dx_j = dt_j sum_i P_ij dy_i``, ``ddt_j = sum_i P_ij a_ij``, ``dcs_j = -dt_j sum_i P_ij a_ij + sum_k P_jk dt_k a_jk``
and ``dCB_ij = exp(cs_i - cs_j) [mask] dt_j sum_{heads of g} a_ij``. Two kernels: one per (head, block of ``j``) for
``dx``, ``ddt`` and the column part of ``dcs``; one per (group, block of ``i``) looping over the group's heads for
``dCB`` and the row part of ``dcs``. No atomics: each output element has one writer (deterministic).

State passing (sequential over chunks, parallel over batch, heads and state elements):
``incoming_c = S_{c-1}``, ``S_c = carry_c S_{c-1} + local_c``, ``S_{-1}`` = the initial state, ``final = S_{c-1}``.
Backward walks the chunks in reverse: ``dlocal_c = g``, ``dcarry_c = sum(g * incoming_c)`` (partial sums per block,
added up by torch), ``g <- carry_c g + dincoming_c``, and ``dinitial = g`` at the end.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mcore.kernels.triton.flash_attention import precision_for

# Tile sizes, read at each launch (benchmarks/ssm_throughput.py --sweep times alternatives on the GPU).
INTRA_ROWS = 64  # token rows (and columns) per tile of the intra-chunk forward and dx kernels
INTRA_WARPS = 4
DCB_TILE = 4096  # elements of one rows x whole-chunk tile of the dCB kernel (4 such fp32 tiles live at once)
DCB_WARPS = 8
STATE_BLOCK = 256  # state elements (of p * n) per state-passing program


@triton.jit
def _decay_tile(CS, SEQ, b, t0, offs_i, offs_j, Lp, H, h, Q, HAS_SEQ: tl.constexpr):
    """``exp(cs_i - cs_j)`` where ``j <= i`` in the same document (and both inside the chunk), else 0."""
    mi, mj = offs_i < Q, offs_j < Q
    cs_i = tl.load(CS + (b * Lp + t0 + offs_i) * H + h, mask=mi, other=0.0)
    cs_j = tl.load(CS + (b * Lp + t0 + offs_j) * H + h, mask=mj, other=0.0)
    keep = (offs_j[None, :] <= offs_i[:, None]) & mi[:, None] & mj[None, :]
    if HAS_SEQ:
        seq_i = tl.load(SEQ + b * Lp + t0 + offs_i, mask=mi, other=-1)
        seq_j = tl.load(SEQ + b * Lp + t0 + offs_j, mask=mj, other=-2)
        keep = keep & (seq_i[:, None] == seq_j[None, :])
    return tl.exp(tl.where(keep, cs_i[:, None] - cs_j[None, :], float("-inf")))


@triton.jit
def _intra_fwd_kernel(X, DT, CS, SEQ, CB, Y, Lp, H, NC, HPG, Q, P, HAS_SEQ: tl.constexpr, PRECISION: tl.constexpr,
                      BI: tl.constexpr, BJ: tl.constexpr, BP: tl.constexpr):  # fmt: skip
    ib, bc, h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, c = bc // NC, bc % NC
    g, t0 = h // HPG, c * Q
    offs_i = ib * BI + tl.arange(0, BI)
    offs_p = tl.arange(0, BP)
    cb_base = CB + ((b * NC + c) * (H // HPG) + g) * Q * Q
    mi = offs_i < Q
    acc = tl.zeros((BI, BP), dtype=tl.float32)
    for jb in range(0, tl.minimum((ib + 1) * BI, Q), BJ):
        offs_j = jb + tl.arange(0, BJ)
        mj = offs_j < Q
        cb = tl.load(cb_base + offs_i[:, None] * Q + offs_j[None, :], mask=mi[:, None] & mj[None, :], other=0.0)
        dt_j = tl.load(DT + (b * Lp + t0 + offs_j) * H + h, mask=mj, other=0.0)
        p_ij = cb * _decay_tile(CS, SEQ, b, t0, offs_i, offs_j, Lp, H, h, Q, HAS_SEQ) * dt_j[None, :]
        x_j = tl.load(X + ((b * Lp + t0 + offs_j[:, None]) * H + h) * P + offs_p[None, :],
                      mask=mj[:, None] & (offs_p < P)[None, :], other=0.0)  # fmt: skip
        acc += tl.dot(p_ij.to(x_j.dtype), x_j, input_precision=PRECISION)
    mask = (offs_i < Q)[:, None] & (offs_p < P)[None, :]
    tl.store(Y + ((b * Lp + t0 + offs_i[:, None]) * H + h) * P + offs_p[None, :], acc, mask=mask)


@triton.jit
def _intra_dx_kernel(X, DT, CS, SEQ, CB, DY, DX, DDT, DCS_COL, Lp, H, NC, HPG, Q, P, HAS_SEQ: tl.constexpr,
                     PRECISION: tl.constexpr, BI: tl.constexpr, BJ: tl.constexpr, BP: tl.constexpr):  # fmt: skip
    jb, bc, h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, c = bc // NC, bc % NC
    g, t0 = h // HPG, c * Q
    offs_j = jb * BJ + tl.arange(0, BJ)
    offs_p = tl.arange(0, BP)
    mj, mp = offs_j < Q, offs_p < P
    x_j = tl.load(X + ((b * Lp + t0 + offs_j[:, None]) * H + h) * P + offs_p[None, :],
                  mask=mj[:, None] & mp[None, :], other=0.0)  # fmt: skip
    cb_base = CB + ((b * NC + c) * (H // HPG) + g) * Q * Q
    dx = tl.zeros((BJ, BP), dtype=tl.float32)
    colsum = tl.zeros((BJ,), dtype=tl.float32)
    for ib in range((jb * BJ) // BI * BI, Q, BI):
        offs_i = ib + tl.arange(0, BI)
        mi = offs_i < Q
        cb = tl.load(cb_base + offs_i[:, None] * Q + offs_j[None, :], mask=mi[:, None] & mj[None, :], other=0.0)
        p_ij = cb * _decay_tile(CS, SEQ, b, t0, offs_i, offs_j, Lp, H, h, Q, HAS_SEQ)
        dy_i = tl.load(DY + ((b * Lp + t0 + offs_i[:, None]) * H + h) * P + offs_p[None, :],
                       mask=mi[:, None] & mp[None, :], other=0.0).to(x_j.dtype)  # fmt: skip
        dx += tl.dot(tl.trans(p_ij).to(x_j.dtype), dy_i, input_precision=PRECISION)
        a_ij = tl.dot(dy_i, tl.trans(x_j), input_precision=PRECISION)
        colsum += tl.sum(p_ij * a_ij, axis=0)
    dt_j = tl.load(DT + (b * Lp + t0 + offs_j) * H + h, mask=mj, other=0.0)
    tl.store(DX + ((b * Lp + t0 + offs_j[:, None]) * H + h) * P + offs_p[None, :], dx * dt_j[:, None],
             mask=mj[:, None] & mp[None, :])  # fmt: skip
    tl.store(DDT + (b * Lp + t0 + offs_j) * H + h, colsum, mask=mj)
    tl.store(DCS_COL + (b * Lp + t0 + offs_j) * H + h, -colsum * dt_j, mask=mj)


@triton.jit
def _intra_dcb_kernel(X, DT, CS, SEQ, CB, DY, DCB, DCS_ROW, Lp, H, NC, HPG, Q, P, HAS_SEQ: tl.constexpr,
                      PRECISION: tl.constexpr, BI: tl.constexpr, QP: tl.constexpr, BP: tl.constexpr):  # fmt: skip
    ib, bc, g = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, c = bc // NC, bc % NC
    t0 = c * Q
    offs_i = ib * BI + tl.arange(0, BI)
    offs_j = tl.arange(0, QP)
    offs_p = tl.arange(0, BP)
    mi, mj, mp = offs_i < Q, offs_j < Q, offs_p < P
    tile = ((b * NC + c) * (H // HPG) + g) * Q * Q + offs_i[:, None] * Q + offs_j[None, :]
    cb = tl.load(CB + tile, mask=mi[:, None] & mj[None, :], other=0.0)
    dcb = tl.zeros((BI, QP), dtype=tl.float32)
    for h in range(g * HPG, (g + 1) * HPG):
        x_j = tl.load(X + ((b * Lp + t0 + offs_j[:, None]) * H + h) * P + offs_p[None, :],
                      mask=mj[:, None] & mp[None, :], other=0.0)  # fmt: skip
        dy_i = tl.load(DY + ((b * Lp + t0 + offs_i[:, None]) * H + h) * P + offs_p[None, :],
                       mask=mi[:, None] & mp[None, :], other=0.0).to(x_j.dtype)  # fmt: skip
        dt_j = tl.load(DT + (b * Lp + t0 + offs_j) * H + h, mask=mj, other=0.0)
        w = _decay_tile(CS, SEQ, b, t0, offs_i, offs_j, Lp, H, h, Q, HAS_SEQ) * dt_j[None, :]
        wa = w * tl.dot(dy_i, tl.trans(x_j), input_precision=PRECISION)
        dcb += wa
        tl.store(DCS_ROW + (b * Lp + t0 + offs_i) * H + h, tl.sum(cb * wa, axis=1), mask=mi)
    tl.store(DCB + tile, dcb, mask=mi[:, None] & mj[None, :])


@triton.jit
def _state_fwd_kernel(LOCAL, CARRY, INIT, INCOMING, FINAL, NC, H, PN, HAS_INIT: tl.constexpr, BS: tl.constexpr):
    pid, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    offs = pid * BS + tl.arange(0, BS)
    m = offs < PN
    if HAS_INIT:
        s = tl.load(INIT + bh * PN + offs, mask=m, other=0.0).to(tl.float32)
    else:
        s = tl.zeros((BS,), dtype=tl.float32)
    for c in range(NC):
        row = (b * NC + c) * H + h
        tl.store(INCOMING + row * PN + offs, s, mask=m)
        s = tl.load(CARRY + row) * s + tl.load(LOCAL + row * PN + offs, mask=m, other=0.0)
    tl.store(FINAL + bh * PN + offs, s, mask=m)


@triton.jit
def _state_bwd_kernel(CARRY, INCOMING, DINCOMING, DFINAL, DLOCAL, DCARRY_PART, DINIT, NC, H, PN,
                      HAS_DFINAL: tl.constexpr, BS: tl.constexpr):  # fmt: skip
    pid, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    offs = pid * BS + tl.arange(0, BS)
    m = offs < PN
    if HAS_DFINAL:
        g = tl.load(DFINAL + bh * PN + offs, mask=m, other=0.0)
    else:
        g = tl.zeros((BS,), dtype=tl.float32)
    for k in range(NC):
        row = (b * NC + NC - 1 - k) * H + h
        tl.store(DLOCAL + row * PN + offs, g, mask=m)
        prev = tl.load(INCOMING + row * PN + offs, mask=m, other=0.0)
        tl.store(DCARRY_PART + row * tl.num_programs(0) + pid, tl.sum(g * prev, axis=0))
        g = tl.load(CARRY + row) * g + tl.load(DINCOMING + row * PN + offs, mask=m, other=0.0)
    tl.store(DINIT + bh * PN + offs, g, mask=m)


def _pow2(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def _dims(x: torch.Tensor, cb: torch.Tensor) -> dict:
    b, lp, h, p = x.shape
    nc, g, q = cb.shape[1], cb.shape[2], cb.shape[3]
    return dict(b=b, Lp=lp, H=h, P=p, NC=nc, G=g, Q=q, HPG=h // g)


def intra_forward(x, dt, cs, seq, cb) -> torch.Tensor:
    """fp32 ``y_intra`` ``[b, Lp, h, p]`` (layouts in the module docstring; ``seq`` may be ``None``)."""
    d = _dims(x, cb)
    qp = _pow2(d["Q"])
    bi = min(INTRA_ROWS, qp)
    y = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(d["Q"], bi), d["b"] * d["NC"], d["H"])
    _intra_fwd_kernel[grid](
        x, dt, cs, seq if seq is not None else dt, cb, y, d["Lp"], d["H"], d["NC"], d["HPG"], d["Q"], d["P"],
        HAS_SEQ=seq is not None, PRECISION=precision_for(x.dtype), BI=bi, BJ=bi, BP=_pow2(d["P"]),
        num_warps=INTRA_WARPS,
    )  # fmt: skip
    return y


def intra_backward(dy, x, dt, cs, seq, cb):
    """``(dx fp32, ddt, dcs, dCB)`` of :func:`intra_forward` given ``dy`` (fp32, same layout as ``y``)."""
    d = _dims(x, cb)
    qp, bp = _pow2(d["Q"]), _pow2(d["P"])
    bj = min(INTRA_ROWS, qp)
    seq_arg = seq if seq is not None else dt
    common = dict(HAS_SEQ=seq is not None, PRECISION=precision_for(x.dtype), BP=bp)
    dims = (d["Lp"], d["H"], d["NC"], d["HPG"], d["Q"], d["P"])
    dx = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    ddt, dcs_col, dcs_row = (torch.empty_like(dt) for _ in range(3))
    grid = (triton.cdiv(d["Q"], bj), d["b"] * d["NC"], d["H"])
    _intra_dx_kernel[grid](
        x, dt, cs, seq_arg, cb, dy, dx, ddt, dcs_col, *dims, BI=bj, BJ=bj, num_warps=INTRA_WARPS, **common
    )
    # Rows x the whole chunk per tile (4 such fp32 tiles live at once): 32 x 128 for Nemotron-H, 16 x 256 for Mamba-2.
    bi = max(16, min(64, DCB_TILE // qp))
    dcb = torch.empty_like(cb)
    grid = (triton.cdiv(d["Q"], bi), d["b"] * d["NC"], d["G"])
    _intra_dcb_kernel[grid](
        x, dt, cs, seq_arg, cb, dy, dcb, dcs_row, *dims, BI=bi, QP=qp, num_warps=DCB_WARPS, **common
    )
    return dx, ddt, dcs_col + dcs_row, dcb


def state_forward(local, carry, initial):
    """``local`` ``[b, c, h, pn]`` fp32, ``carry`` ``[b, c, h]`` fp32, ``initial`` ``[b, h, pn]`` or ``None`` ->
    ``(incoming [b, c, h, pn], final [b, h, pn])``."""
    b, nc, h, pn = local.shape
    incoming = torch.empty_like(local)
    final = torch.empty(b, h, pn, dtype=torch.float32, device=local.device)
    grid = (triton.cdiv(pn, STATE_BLOCK), b * h)
    _state_fwd_kernel[grid](
        local, carry, initial if initial is not None else local, incoming, final, nc, h, pn,
        HAS_INIT=initial is not None, BS=STATE_BLOCK,
    )  # fmt: skip
    return incoming, final


def state_backward(carry, incoming, dincoming, dfinal):
    """``(dlocal, dcarry, dinitial)`` of :func:`state_forward`; ``dfinal`` may be ``None``."""
    b, nc, h, pn = incoming.shape
    nblocks = triton.cdiv(pn, STATE_BLOCK)
    dlocal = torch.empty_like(incoming)
    dcarry_part = torch.empty(b, nc, h, nblocks, dtype=torch.float32, device=incoming.device)
    dinit = torch.empty(b, h, pn, dtype=torch.float32, device=incoming.device)
    _state_bwd_kernel[(nblocks, b * h)](
        carry, incoming, dincoming, dfinal if dfinal is not None else dinit, dlocal, dcarry_part, dinit, nc, h, pn,
        HAS_DFINAL=dfinal is not None, BS=STATE_BLOCK,
    )  # fmt: skip
    return dlocal, dcarry_part.sum(-1), dinit
