"""Distillation losses shared by the trainable drafters (docs/DSPARK.md §3).

Shapes: ... any leading dims (sequences, anchors), K draft positions, V vocabulary.
Notation: p = host distribution (temperature 1), q = draft distribution, x* = the true next token,
c = predicted confidence, c* = 1 - ½‖q - p‖₁ the analytic acceptance probability of a draft from q under p.

Every loss is a weighted mean over valid (..., k) entries with position weights w_k (DSpark/DFlash: exp(-k/4);
EAGLE-3 TTT: 0.8^k): Σ w_k·valid·loss / Σ w_k·valid. why the mean rather than a plain sum: the scale then does not
depend on how many anchors or tokens a batch happens to have, so one learning rate fits every batch shape.

Memory: a loss over the full vocabulary makes several (..., V) tensors per entry (logits, log q, q, p, q - p), and
autograd keeps some of them until backward. `checkpointed_chunks` computes such a loss over chunks of entries, each
under activation checkpointing, so only one chunk's V-sized tensors exist at a time and backward recomputes them
chunk by chunk: what stays alive between forward and backward is the small input of each chunk (hidden states) and
its (..., K) results.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from typing import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

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
