"""Acceptance of drafted tokens, as pure functions (no model calls, no cache mutation).

Notation: p = host (target) distribution, q = draft distribution. Shapes: B requests, K draft positions,
V vocabulary. Request b verified ell[b] in 0..K drafts: the host saw [x0, x1..x_ell] and gave p_1..p_{ell+1}.

Lossless rejection sampling, left to right: accept x_k with probability min(1, p_k(x_k) / q_k(x_k)); at the first
rejection the next token is drawn from norm(max(p_k - q_k, 0)); if all ell drafts are accepted it is drawn from
p_{ell+1} (the bonus). The functions return the distribution of that next token; the caller draws it, so the
noise stays keyed by the caller's counters.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

import torch


@dataclass
class Acceptance:
    n_accepted: torch.Tensor  # (B,) long: accepted drafts, 0..ell
    next_probs: torch.Tensor | None = None  # (B, V): distribution of the token after them (sampling)
    next_token: torch.Tensor | None = None  # (B,) long: that token (greedy)


def _prefix_length(ok: torch.Tensor, ell: torch.Tensor) -> torch.Tensor:
    """Length of the leading run of True in ok (B, K), counting only positions < ell (B,)."""
    K = ok.shape[1]
    ok = ok & (torch.arange(K, device=ok.device) < ell.unsqueeze(1))
    return ok.long().cumprod(1).sum(1)


def greedy_accept(target: torch.Tensor, tokens: torch.Tensor, ell: torch.Tensor) -> Acceptance:
    """Greedy acceptance: accept while argmax p_k == x_k, then append argmax p.

    target (B, K+1) long = argmax of p_1..p_{K+1}; tokens (B, K); ell (B,).
    """
    n = _prefix_length(tokens == target[:, : tokens.shape[1]], ell)
    return Acceptance(n_accepted=n, next_token=target.gather(1, n.unsqueeze(1)).squeeze(1))


def rejection_sample(p: torch.Tensor, q: torch.Tensor | None, tokens: torch.Tensor, ell: torch.Tensor,
                     u: torch.Tensor) -> Acceptance:
    """Lossless speculative sampling over a batch with per-request verified lengths.

    p (B, K+1, V) host distributions; q (B, K, V) draft distributions, or None when each x_k was proposed
    deterministically (q_k = point mass on x_k); tokens (B, K); ell (B,); u (B, K) uniform(0, 1).
    """
    B, K = tokens.shape
    p_x = p[:, :K].gather(2, tokens.unsqueeze(2)).squeeze(2)  # (B, K)
    q_x = torch.ones_like(p_x) if q is None else q.gather(2, tokens.unsqueeze(2)).squeeze(2)
    # u < p/q  <=>  u * q < p (no division; q_x > 0 for a token q actually drew)
    n = _prefix_length(u * q_x < p_x, ell)  # (B,)
    rows = torch.arange(B, device=p.device)
    p_next = p[rows, n]  # (B, V): p at the first unaccepted slot
    rejected = n < ell  # (B,)
    if K == 0:
        return Acceptance(n_accepted=n, next_probs=p_next)
    if q is None:
        q_next = torch.zeros_like(p_next).scatter_(1, tokens.gather(1, n.clamp(max=K - 1).unsqueeze(1)), 1.0)
    else:
        q_next = q[rows, n.clamp(max=K - 1)]  # (B, V)
    residual = (p_next - q_next).clamp_(min=0)
    mass = residual.sum(-1, keepdim=True)
    # a rejection has probability 0 when p == q, but float noise can leave a residual of ~0: fall back to p there
    residual = torch.where(mass > 0, residual / mass.clamp(min=torch.finfo(mass.dtype).tiny), p_next)
    return Acceptance(n_accepted=n, next_probs=torch.where(rejected.unsqueeze(1), residual, p_next))


def expected_tau(conditional: Iterable[float] | torch.Tensor) -> float:
    """tau (the bonus token included) implied by per-position conditional acceptances alpha_k under verify-all:
    1 + sum_k prod_{i<=k} alpha_i, in float64; a NaN (a position never reached) ends the sum."""
    values = conditional.double().tolist() if isinstance(conditional, torch.Tensor) else conditional
    total, survive = 1.0, 1.0
    for alpha in values:
        if math.isnan(alpha):
            break
        survive *= alpha
        total += survive
    return total


def expected_accepted(confidence: torch.Tensor, ell: torch.Tensor) -> torch.Tensor:
    """(R,) float32: the drafts each row expects to have accepted by its confidences c (R, K), read as conditional
    acceptances, of the ell (R,) it verified: sum_{k <= ell} prod_{i <= k} c_i (c clamped to [0, 1]). What a draft
    gate prices a drafted round by when the drafter has confidences (verifiers.prefix_scheduler.DraftGate)."""
    K = confidence.shape[1]
    survive = confidence.float().clamp(0.0, 1.0).cumprod(1)  # (R, K)
    return (survive * (torch.arange(1, K + 1, device=ell.device) <= ell.unsqueeze(1))).sum(1)
