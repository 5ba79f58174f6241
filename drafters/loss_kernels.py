"""Triton kernels of the fused distillation loss (drafters/losses.py, `chunk_terms`): one program per row of a chunk.

Shapes: c rows of the chunk, Vq the vocabulary of q (the host's V, or EAGLE-3's draft vocabulary), V the host's.
Notation as in losses.py: z the drafter's logits of a row (plus the Markov bias), p = softmax of the host's logits
of the row, q = softmax(z), s = sign(q - p), a and b the loss's coefficients of the row's CE and ‖q - p‖₁.

Each program reads its row of z (and of the bias) and of the host's logits in blocks of BLOCK, in three passes:
  1. the log-normalisers of q and p, online (per-lane running maxima and rescaled sums, combined at the end);
     for soft targets over the full vocabulary also Σ p·z, rescaled alike;
  2. ‖q - p‖₁ and Σ s·q (hard targets), or ‖q - p‖₁ and the gradient (soft targets, which need nothing more);
  3. (hard targets) the gradient a·(q - onehot(x*)) + b·q·(s - Σ s·q).
The gradient overwrites z in place (z's dtype, bf16 under autocast), all arithmetic in float32. The host's row is
read through the row index, so no (c, V) copy of the host's logits is made. why a kernel rather than torch ops:
eager ops write and read about eight float32 (c, V) tensors per chunk (the reference's cost); the kernel's only
traffic is its passes over the bf16 rows. why V a compile-time constant: a model has one vocabulary, and the
loops then have fixed bounds (and Triton's CPU interpreter, used to debug these, handles them).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048
NUM_WARPS = 8
_NEG = tl.constexpr(-1e30)  # why finite: a lane's running maximum starts here, and exp(-inf - -inf) would be NaN


@triton.jit
def _online(m, s, x):
    """One step of a per-lane online log-sum-exp: running maximum m and sum s (scaled by exp(-m)) with x."""
    new = tl.maximum(m, x)
    return new, s * tl.exp(m - new) + tl.exp(x - new)


@triton.jit
def _lse(m, s):
    """The log-sum-exp of the per-lane running maxima m and sums s."""
    top = tl.max(m, 0)
    return top + tl.log(tl.sum(s * tl.exp(m - top), 0))


@triton.jit
def _hard_rows(z_ptr, b_ptr, host_ptr, rows_ptr, tgt_ptr, a_ptr, b_coef_ptr, ce_ptr, tv_ptr, stride_z, stride_host,
               V: tl.constexpr, HAS_BIAS: tl.constexpr, GRADIENT: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    z_row = z_ptr + r * stride_z
    b_row = b_ptr + r * stride_z
    h_row = host_ptr + tl.load(rows_ptr + r).to(tl.int64) * stride_host
    offs = tl.arange(0, BLOCK)
    m_q = tl.full([BLOCK], _NEG, tl.float32)
    s_q = tl.zeros([BLOCK], tl.float32)
    m_p = tl.full([BLOCK], _NEG, tl.float32)
    s_p = tl.zeros([BLOCK], tl.float32)
    for start in range(0, V, BLOCK):
        cols = start + offs
        ok = cols < V
        z = tl.load(z_row + cols, mask=ok, other=float("-inf")).to(tl.float32)
        if HAS_BIAS:
            z += tl.load(b_row + cols, mask=ok, other=0.0).to(tl.float32)
        m_q, s_q = _online(m_q, s_q, z)
        m_p, s_p = _online(m_p, s_p, tl.load(h_row + cols, mask=ok, other=float("-inf")).to(tl.float32))
    lse_q = _lse(m_q, s_q)
    lse_p = _lse(m_p, s_p)
    l1 = tl.zeros([BLOCK], tl.float32)
    sq = tl.zeros([BLOCK], tl.float32)
    for start in range(0, V, BLOCK):
        cols = start + offs
        ok = cols < V
        z = tl.load(z_row + cols, mask=ok, other=float("-inf")).to(tl.float32)
        if HAS_BIAS:
            z += tl.load(b_row + cols, mask=ok, other=0.0).to(tl.float32)
        q = tl.exp(z - lse_q)  # 0 on masked lanes
        d = q - tl.exp(tl.load(h_row + cols, mask=ok, other=float("-inf")).to(tl.float32) - lse_p)
        l1 += tl.abs(d)
        sq += tl.where(d > 0, q, tl.where(d < 0, -q, 0.0))
    target = tl.load(tgt_ptr + r)
    z_t = tl.load(z_row + target).to(tl.float32)
    if HAS_BIAS:
        z_t += tl.load(b_row + target).to(tl.float32)
    tl.store(ce_ptr + r, lse_q - z_t)
    tl.store(tv_ptr + r, tl.sum(l1, 0))
    if GRADIENT:
        sum_sq = tl.sum(sq, 0)
        a = tl.load(a_ptr + r)
        b = tl.load(b_coef_ptr + r)
        for start in range(0, V, BLOCK):
            cols = start + offs
            ok = cols < V
            z = tl.load(z_row + cols, mask=ok, other=float("-inf")).to(tl.float32)
            if HAS_BIAS:
                z += tl.load(b_row + cols, mask=ok, other=0.0).to(tl.float32)
            q = tl.exp(z - lse_q)
            d = q - tl.exp(tl.load(h_row + cols, mask=ok, other=float("-inf")).to(tl.float32) - lse_p)
            s = tl.where(d > 0, 1.0, tl.where(d < 0, -1.0, 0.0))
            g = a * (q - tl.where(cols == target, 1.0, 0.0)) + b * q * (s - sum_sq)
            tl.store(z_row + cols, g.to(z_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _soft_rows(z_ptr, host_ptr, rows_ptr, vocab_ptr, a_ptr, ce_ptr, tv_ptr, mass_ptr, stride_z, stride_host,
               VQ: tl.constexpr, V: tl.constexpr, DRAFT_VOCAB: tl.constexpr, GRADIENT: tl.constexpr,
               BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    z_row = z_ptr + r * stride_z
    h_row = host_ptr + tl.load(rows_ptr + r).to(tl.int64) * stride_host
    offs = tl.arange(0, BLOCK)
    m_q = tl.full([BLOCK], _NEG, tl.float32)
    s_q = tl.zeros([BLOCK], tl.float32)
    m_p = tl.full([BLOCK], _NEG, tl.float32)
    s_p = tl.zeros([BLOCK], tl.float32)
    if DRAFT_VOCAB:
        # p's normaliser is over the host's whole row; q's tokens are a subset of it
        for start in range(0, V, BLOCK):
            cols = start + offs
            m_p, s_p = _online(m_p, s_p, tl.load(h_row + cols, mask=cols < V, other=float("-inf")).to(tl.float32))
        lse_p = _lse(m_p, s_p)
        pz = tl.zeros([BLOCK], tl.float32)
        pm = tl.zeros([BLOCK], tl.float32)
        for start in range(0, VQ, BLOCK):
            cols = start + offs
            ok = cols < VQ
            z = tl.load(z_row + cols, mask=ok, other=float("-inf")).to(tl.float32)
            m_q, s_q = _online(m_q, s_q, z)
            ids = tl.load(vocab_ptr + cols, mask=ok, other=0)
            p = tl.exp(tl.load(h_row + ids, mask=ok, other=float("-inf")).to(tl.float32) - lse_p)
            pz += tl.where(ok, p * z, 0.0)
            pm += p
        lse_q = _lse(m_q, s_q)
        mass = tl.maximum(tl.sum(pm, 0), 1.1754943508222875e-38)  # float32's tiny, as the reference's clamp
        pz_sum = tl.sum(pz, 0)
    else:
        # Σ p·z online with p's normaliser: per-lane sums rescaled with the running maximum
        t = tl.zeros([BLOCK], tl.float32)
        for start in range(0, VQ, BLOCK):
            cols = start + offs
            ok = cols < VQ
            z = tl.load(z_row + cols, mask=ok, other=float("-inf")).to(tl.float32)
            m_q, s_q = _online(m_q, s_q, z)
            x = tl.load(h_row + cols, mask=ok, other=float("-inf")).to(tl.float32)
            new = tl.maximum(m_p, x)
            scale = tl.exp(m_p - new)
            e = tl.exp(x - new)
            s_p = s_p * scale + e
            t = t * scale + tl.where(ok, e * z, 0.0)
            m_p = new
        lse_q = _lse(m_q, s_q)
        lse_p = _lse(m_p, s_p)
        top = tl.max(m_p, 0)
        pz_sum = tl.sum(t * tl.exp(m_p - top), 0) / tl.sum(s_p * tl.exp(m_p - top), 0)
        mass = 1.0
    tl.store(ce_ptr + r, lse_q - pz_sum / mass)  # -Σ (p/P) log q = lse_q - Σ (p/P) z
    tl.store(mass_ptr + r, mass)
    a = tl.load(a_ptr + r)
    l1 = tl.zeros([BLOCK], tl.float32)
    for start in range(0, VQ, BLOCK):
        cols = start + offs
        ok = cols < VQ
        q = tl.exp(tl.load(z_row + cols, mask=ok, other=float("-inf")).to(tl.float32) - lse_q)
        if DRAFT_VOCAB:
            ids = tl.load(vocab_ptr + cols, mask=ok, other=0)
            p = tl.exp(tl.load(h_row + ids, mask=ok, other=float("-inf")).to(tl.float32) - lse_p)
        else:
            p = tl.exp(tl.load(h_row + cols, mask=ok, other=float("-inf")).to(tl.float32) - lse_p)
        l1 += tl.abs(q - p)
        if GRADIENT:
            tl.store(z_row + cols, (a * (q - p / mass)).to(z_ptr.dtype.element_ty), mask=ok)
    tl.store(tv_ptr + r, tl.sum(l1, 0))


def chunk_terms(z: torch.Tensor, zb: torch.Tensor | None, rows, start: int, stop: int, ce: torch.Tensor,
                tv: torch.Tensor, mass: torch.Tensor, *, gradient: bool) -> torch.Tensor | None:
    """losses.chunk_terms on CUDA: the terms of rows start..stop-1 into ce, tv, mass (c,) float32, and the gradient
    written over z (c, Vq), which is returned (None without gradient)."""
    c, Vq = z.shape
    host = rows.host_logits
    host_rows = rows.host_rows[start:stop]
    a = rows.ce_coef[start:stop].float().contiguous()
    if rows.targets is not None:
        _hard_rows[(c,)](z, z if zb is None else zb, host, host_rows, rows.targets[start:stop], a,
                         rows.tv_coef[start:stop].float().contiguous(), ce, tv, z.stride(0), host.stride(0),
                         V=Vq, HAS_BIAS=zb is not None, GRADIENT=gradient, BLOCK=BLOCK, num_warps=NUM_WARPS)
        mass.fill_(1.0)
    else:
        if zb is not None:
            raise ValueError("soft targets take no Markov bias")
        vocab = rows.vocab_index
        _soft_rows[(c,)](z, host, host_rows, host_rows if vocab is None else vocab, a, ce, tv, mass, z.stride(0),
                         host.stride(0), VQ=Vq, V=host.shape[1], DRAFT_VOCAB=vocab is not None, GRADIENT=gradient,
                         BLOCK=BLOCK, num_warps=NUM_WARPS)
    return z if gradient else None
