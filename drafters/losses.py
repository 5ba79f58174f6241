"""Distillation losses shared by the trainable drafters (docs/DSPARK.md §3).

Shapes: ... any leading dims (sequences, anchors), K draft positions, V vocabulary.
Notation: p = host distribution (temperature 1), q = draft distribution, x* = the true next token,
c = predicted confidence, c* = 1 - ½‖q - p‖₁ the analytic acceptance probability of a draft from q under p.

Every loss is a weighted mean over valid (..., k) entries with position weights w_k (DSpark/DFlash: exp(-k/4);
EAGLE-3 TTT: 0.8^k): Σ w_k·valid·loss / Σ w_k·valid. why the mean rather than a plain sum: the scale then does not
depend on how many anchors or tokens a batch happens to have, so one learning rate fits every batch shape.

Memory: a loss over the full vocabulary makes several (..., V) tensors per entry (logits, log q, q, p, q - p), and
autograd keeps some of them until backward. Two implementations (`LOSS_IMPLS`, TrainConfig.loss_impl):
  - "fused" (the default): `fused_distill`, one torch.autograd.Function over chunks of N rows (one row per
    (..., k) entry) that takes the drafter's last hidden states and the LM head's weight instead of logits. Per
    chunk it runs the LM head GEMM (plus the Markov head's rank-r GEMM) in the compute dtype (bf16 under autocast),
    computes the terms and the gradient of the weighted loss with respect to the chunk's logits in one pass over
    them (Triton kernels on CUDA, drafters/loss_kernels.py, fp32 accumulation; torch ops elsewhere) and turns it
    into gradients of the hidden states and trainable weights with two more GEMMs, there and then. why in the
    forward: the loss is linear in the per-row terms with coefficients known before it (position weights x valid
    / normaliser), so nothing is recomputed in backward, which only scales the stored gradients. No (N, V) tensor
    exists beyond one chunk's logits in the compute dtype; nothing V-sized is kept for backward but the gradients
    of weights (rank x V for the Markov head's W2), the size of the weights themselves.
  - "reference": the formulation the fused one is tested against. `checkpointed_chunks` computes the loss over
    chunks of entries, each under activation checkpointing, so only one chunk's float32 V-sized tensors exist at a
    time and backward recomputes them chunk by chunk.
"""
from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass

from typing import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

_HAS_TRITON = importlib.util.find_spec("triton") is not None  # the fused loss's CUDA kernels

# why 2**24 off the GPU: one (rows, V) float32 tensor of a chunk is 64 MB; a chunk's loss makes about six of them at
# once, which fits a laptop
LOSS_CHUNK_ELEMENTS = 2**24
# why larger on a GPU: each chunk is its own small ops forward, in the recompute and in backward (a DSpark chunk
# about 1600 aten ops in all, nested ones counted: 39185 ops with 22 chunks, 13732 with 6, one row of 2048 tokens x
# 1024 blocks x block size 7 x V 49152, an ad-hoc torch.profiler count on the CPU), many a kernel launch on a GPU. A
# DSpark step of the SmolLM2 recipe (4 such rows) makes 86 chunks at 2**24 (about 140k ops), EAGLE-3's 7 unrolled
# steps 25 chunks each; since the chunking came in, those steps took 0.91-1.06 s on the H100 / H200
# (benchmarks/h100/steps300_speed, h200/concurrency_smollm2) against 0.18 s unchunked the day before
# (h200/steps2000_anchors1024, 46 GB peak). 2**28 elements (1 GiB per float32 tensor, about 6 GiB per chunk) is 6
# DSpark chunks there, and took the steps to 0.25 s (DSpark) and 0.28 s (EAGLE-3) on the H200, 14 GB peak
# (h200/concurrency_smollm2_20261206); a card of less memory gets 1/128 of it (a 24 GB card: about 2**27.5)
LOSS_CHUNK_ELEMENTS_CUDA = 2**28


@dataclass
class DistillTerms:
    """Per-entry loss terms, not yet weighted or reduced."""

    ce: torch.Tensor  # (..., K) -log q_k(x*_k)
    tv: torch.Tensor  # (..., K) ‖q_k - p_k‖₁ (twice the total-variation distance)
    accept: torch.Tensor  # (..., K) c*_k = 1 - ½‖q_k - p_k‖₁, in [0, 1]


def position_weights(K: int, *, decay: float, device=None) -> torch.Tensor:
    """w_k = exp(-k / decay) for k = 0..K-1: (K,). decay = inf gives equal weights."""
    k = torch.arange(K, dtype=torch.float32, device=device)
    return torch.ones(K, device=device) if math.isinf(decay) else torch.exp(-k / decay)


def distill_terms(q_logits: torch.Tensor, p_logits: torch.Tensor, targets: torch.Tensor) -> DistillTerms:
    """CE, L1 and c* of draft logits (..., K, V) against host logits (..., K, V) and true tokens (..., K)."""
    log_q = F.log_softmax(q_logits.float(), dim=-1)  # (..., K, V)
    p = F.softmax(p_logits.float(), dim=-1).detach()  # the host is the teacher: never a gradient into it
    ce = -log_q.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # (..., K)
    tv = (log_q.exp() - p).abs().sum(-1)  # (..., K)
    return DistillTerms(ce=ce, tv=tv, accept=(1 - 0.5 * tv).clamp(0, 1))


def confidence_bce(c_logits: torch.Tensor, accept: torch.Tensor) -> torch.Tensor:
    """BCE(σ(c_logits), stop_grad(c*)) per entry (..., K); from logits for numerical stability."""
    return F.binary_cross_entropy_with_logits(c_logits.float(), accept.detach(), reduction="none")


def weighted_mean(x: torch.Tensor, weights: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Σ w_k·valid·x / Σ w_k·valid over x (..., K); 0 (still differentiable) when nothing is valid."""
    w = weights * valid.to(weights.dtype)  # (..., K)
    return (x * w).sum() / w.sum().clamp(min=1e-6)


def row_weights(weights: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Each entry's coefficient in `weighted_mean`: w_k·valid / Σ w_k·valid (..., K), so that Σ coef·x is the mean."""
    w = weights * valid.to(weights.dtype)  # (..., K)
    return w / w.sum().clamp(min=1e-6)


def weight_total(weights: torch.Tensor, valid: torch.Tensor) -> float:
    """Σ w_k·valid, the denominator of `weighted_mean` (before its clamp): TrainOutput.weight."""
    return float((weights * valid.to(weights.dtype)).sum())


def per_position_mean(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Mean of x (..., K) over valid entries at each position k: (K,), detached; 0 where none is valid."""
    v = valid.to(torch.float32).flatten(0, -2)  # (N, K)
    return (x.detach().float().flatten(0, -2) * v).sum(0) / v.sum(0).clamp(min=1)


def loss_chunk_elements(device: torch.device | str | None = None) -> int:
    """Elements of one (rows, V) tensor of a loss chunk on `device`: LOSS_CHUNK_ELEMENTS off CUDA; on a CUDA device
    LOSS_CHUNK_ELEMENTS_CUDA, or 1/128 of the card's memory in bytes where that is less (never below the CPU's).
    From the card's total memory, not its free memory, so that a run chunks alike at every step and on resume."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type != "cuda":
        return LOSS_CHUNK_ELEMENTS
    total = torch.cuda.get_device_properties(device).total_memory
    return max(LOSS_CHUNK_ELEMENTS, min(LOSS_CHUNK_ELEMENTS_CUDA, total // 128))


def chunk_rows(row_elements: int, budget: int | None = None, *, device: torch.device | str | None = None) -> int:
    """Rows per chunk so that one (rows, row_elements) tensor has at most `budget` elements (at least one row);
    budget None: loss_chunk_elements(device)."""
    return max(1, (loss_chunk_elements(device) if budget is None else budget) // max(1, row_elements))


def checkpointed_chunks(fn: Callable[..., tuple], n: int, rows: int, dim: int = 1) -> tuple:
    """Concatenate fn(start, stop) over [start, stop) chunks of rows of 0..n along `dim`, each call under activation
    checkpointing (torch.utils.checkpoint): its intermediates are freed after the call and recomputed in backward.
    fn returns a tuple of tensors (or None) whose size along `dim` is stop - start; None outputs stay None."""
    parts = [checkpoint(fn, start, min(start + rows, n), use_reentrant=False,
                        preserve_rng_state=False)  # why no RNG state: the loss draws no random numbers
             for start in range(0, n, rows)]
    return tuple(None if outs[0] is None else torch.cat(outs, dim=dim) for outs in zip(*parts))


# ---- fused: chunked LM head + loss + its gradient (see the module docstring) ---------------------------------------

LOSS_IMPLS = ("fused", "reference")
# why 2**27 on a GPU: one chunk holds its logits (and the Markov bias) in bf16, 256 MiB each at this size, and runs
# GEMMs of about 900 rows at V = 151,936, large enough for the GEMMs' full rate; off a GPU the eager ops make about
# eight float32 tensors of the chunk, so the CPU's LOSS_CHUNK_ELEMENTS applies there
FUSED_CHUNK_ELEMENTS_CUDA = 2**27


@dataclass
class LossRows:
    """What a fused loss reads besides the differentiable inputs, one entry per row (N rows). p of a row is
    softmax(host_logits[host_rows[row]]), restricted to vocab_index when given."""

    host_logits: torch.Tensor  # (M, V) host logits, any float dtype (bf16 on a GPU: no float32 copy is made)
    host_rows: torch.Tensor  # (N,) long
    ce_coef: torch.Tensor  # (N,) float32: the loss's coefficient of each row's cross-entropy
    tv_coef: torch.Tensor | None = None  # (N,) float32: of each row's ‖q - p‖₁ (hard targets only)
    targets: torch.Tensor | None = None  # (N,) long x*: hard CE -log q(x*) and the L1 term; None: soft CE to p
    vocab_index: torch.Tensor | None = None  # (Vq,) long host ids of q's vocabulary (EAGLE-3's draft vocabulary)


@dataclass
class FusedTerms:
    """A fused loss and its per-row terms (detached: for metrics and the confidence target)."""

    loss: torch.Tensor  # scalar, differentiable: Σ ce_coef·ce + tv_coef·tv
    ce: torch.Tensor  # (N,) hard: -log q(x*); soft: -Σ p log q (p renormalised over vocab_index)
    tv: torch.Tensor  # (N,) ‖q - p‖₁ over q's vocabulary
    accept: torch.Tensor  # (N,) c* = Σ min(q, p): hard clamp(1 - ½tv, 0, 1); soft (1 + Σp - tv) / 2


def fused_distill(x: torch.Tensor, weight: torch.Tensor, rows: LossRows, *, bias_input: torch.Tensor | None = None,
                  bias_weight: torch.Tensor | None = None, chunk: int | None = None) -> FusedTerms:
    """The distillation loss of logits z = x·weightᵀ (+ bias_input·bias_weightᵀ) without an (N, V) tensor: x (N, H),
    weight (Vq, H) (the host's frozen LM head, or a trainable head), bias_input (N, r) and bias_weight (Vq, r) (the
    Markov head's W2 and its input). chunk: rows per chunk (default: chunk_rows of the device's budget). The GEMMs
    run in the autocast dtype when autocast is on, else in each weight's dtype, as the reference's Linear calls."""
    device_type = x.device.type
    amp = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None
    grads = torch.is_grad_enabled()
    if chunk is None:
        budget = FUSED_CHUNK_ELEMENTS_CUDA if device_type == "cuda" else None
        chunk = chunk_rows(weight.shape[0], budget, device=x.device)
    loss, ce, tv, accept = _FusedDistill.apply(x, weight, bias_input, bias_weight, rows, amp, grads, chunk)
    return FusedTerms(loss=loss, ce=ce, tv=tv, accept=accept)


class _FusedDistill(torch.autograd.Function):
    """forward: loss and per-row terms, and (when a gradient is wanted) the loss's gradients with respect to x, the
    weights and bias_input; backward: those times the incoming scalar gradient."""

    @staticmethod
    def forward(ctx, x, weight, bias_input, bias_weight, rows: LossRows, amp, grads: bool, chunk: int):
        want = [grads and t is not None and t.requires_grad for t in (x, weight, bias_input, bias_weight)]
        has_bias = bias_input is not None
        w = weight.to(amp or weight.dtype)  # (Vq, H) a no-op for the host's head in its own dtype
        w2 = bias_weight.to(amp or bias_weight.dtype) if has_bias else None  # (Vq, r)
        N = x.shape[0]
        ce, tv, mass = (torch.empty(N, dtype=torch.float32, device=x.device) for _ in range(3))
        dx = torch.zeros_like(x) if want[0] else None
        dw = torch.zeros(weight.shape, dtype=torch.float32, device=x.device) if want[1] else None
        du = torch.zeros_like(bias_input) if want[2] else None
        dw2 = torch.zeros(bias_weight.shape, dtype=torch.float32, device=x.device) if want[3] else None
        backward = any(want)
        with torch.autocast(x.device.type, enabled=False):
            for start in range(0, N, chunk):
                stop = min(start + chunk, N)
                xc = x[start:stop].to(w.dtype)  # (c, H)
                z = xc @ w.t()  # (c, Vq) logits in the compute dtype
                uc = bias_input[start:stop].to(w2.dtype) if has_bias else None  # (c, r)
                zb = uc @ w2.t() if has_bias else None  # (c, Vq) Markov bias B_k
                gz = chunk_terms(z, zb, rows, start, stop, ce[start:stop], tv[start:stop], mass[start:stop],
                                 gradient=backward)  # (c, Vq) dloss/dz, in z's dtype (may be z itself)
                if not backward:
                    continue
                if dx is not None:
                    dx[start:stop] = gz @ w
                if dw is not None:
                    dw += (gz.t() @ xc).float()
                if du is not None:
                    du[start:stop] = gz @ w2
                if dw2 is not None:
                    dw2 += (gz.t() @ uc).float()
        if rows.targets is not None:
            accept = (1 - 0.5 * tv).clamp(0, 1)
            loss = (rows.ce_coef * ce).sum() + (rows.tv_coef * tv).sum()
        else:
            accept = 0.5 * (1 + mass - tv)
            loss = (rows.ce_coef * ce).sum()
        # why attributes, not save_for_backward: these are results of the forward, not its inputs, and autograd's
        # saved-tensor hooks (tests/test_training_memory.py) should count what is V-sized per row, which is nothing
        ctx.grads = (dx, None if dw is None else dw.to(weight.dtype), du,
                     None if dw2 is None else dw2.to(bias_weight.dtype))
        ctx.mark_non_differentiable(ce, tv, accept)
        return loss, ce, tv, accept

    @staticmethod
    def backward(ctx, grad_loss, *unused):
        scaled = tuple(None if g is None else g * grad_loss.to(g.dtype) for g in ctx.grads)
        ctx.grads = None
        return (*scaled, None, None, None, None)


def chunk_terms(z: torch.Tensor, zb: torch.Tensor | None, rows: LossRows, start: int, stop: int, ce: torch.Tensor,
                tv: torch.Tensor, mass: torch.Tensor, *, gradient: bool) -> torch.Tensor | None:
    """Rows start..stop-1 of a fused loss from their logits z (c, Vq) and bias zb (c, Vq) or None: writes ce, tv and
    mass = Σ_{v in q's vocabulary} p_v (c,) and returns dloss/dz (c, Vq) in z's dtype (None without gradient).
    On CUDA with triton: drafters/loss_kernels.py, which writes the gradient over z; else `chunk_terms_torch`."""
    if z.is_cuda and _HAS_TRITON:
        import drafters.loss_kernels as loss_kernels

        return loss_kernels.chunk_terms(z, zb, rows, start, stop, ce, tv, mass, gradient=gradient)
    return chunk_terms_torch(z, zb, rows, start, stop, ce, tv, mass, gradient=gradient)


def chunk_terms_torch(z, zb, rows: LossRows, start: int, stop: int, ce, tv, mass, *, gradient: bool):
    """`chunk_terms` in torch ops (float32): the CPU's path and the oracle of the Triton kernels."""
    zf = z.float() if zb is None else z.float() + zb.float()  # (c, Vq)
    log_q = F.log_softmax(zf, dim=-1)
    q = log_q.exp()
    host = rows.host_logits[rows.host_rows[start:stop]].float()  # (c, V)
    a = rows.ce_coef[start:stop, None]  # (c, 1)
    if rows.targets is not None:
        p = F.softmax(host, dim=-1)
        t = rows.targets[start:stop, None]  # (c, 1)
        d = q - p
        ce.copy_(-log_q.gather(-1, t).squeeze(-1))
        tv.copy_(d.abs().sum(-1))
        mass.fill_(1.0)
        if not gradient:
            return None
        s = d.sign()
        onehot = torch.zeros_like(q).scatter_(-1, t, 1.0)
        # d/dz of -log q(x*) is q - onehot; of ‖q - p‖₁ it is q·(s - Σ s·q), s = sign(q - p)
        g = a * (q - onehot) + rows.tv_coef[start:stop, None] * q * (s - (s * q).sum(-1, keepdim=True))
        return g.to(z.dtype)
    if rows.vocab_index is not None:
        p = F.softmax(host, dim=-1).index_select(-1, rows.vocab_index)  # (c, Vq) host probabilities of q's tokens
        P = p.sum(-1).clamp(min=torch.finfo(p.dtype).tiny)  # (c,)
    else:
        p = F.softmax(host, dim=-1)
        P = torch.ones(p.shape[0], device=p.device)
    ce.copy_(-(p * log_q).sum(-1) / P)
    tv.copy_((q - p).abs().sum(-1))
    mass.copy_(P if rows.vocab_index is not None else torch.ones_like(P))
    if not gradient:
        return None
    return (a * (q - p / P[:, None])).to(z.dtype)  # d/dz of -Σ (p/P) log q
