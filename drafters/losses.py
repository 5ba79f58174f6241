"""Distillation losses shared by the trainable drafters (DSPARK.md §3).

Shapes: ... any leading dims (sequences, anchors), K draft positions, V vocabulary.
Notation: p = host distribution (temperature 1), q = draft distribution, x* = the true next token,
c = predicted confidence, c* = 1 - ½‖q - p‖₁ the analytic acceptance probability of a draft from q under p.

Every loss is a weighted mean over valid (..., k) entries with position weights w_k (DSpark/DFlash: exp(-k/4);
EAGLE-3 TTT: 0.8^k): Σ w_k·valid·loss / Σ w_k·valid. why the mean rather than a plain sum: the scale then does not
depend on how many anchors or tokens a batch happens to have, so one learning rate fits every batch shape.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


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


def per_position_mean(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Mean of x (..., K) over valid entries at each position k: (K,), detached; 0 where none is valid."""
    v = valid.to(torch.float32).flatten(0, -2)  # (N, K)
    return (x.detach().float().flatten(0, -2) * v).sum(0) / v.sum(0).clamp(min=1)
