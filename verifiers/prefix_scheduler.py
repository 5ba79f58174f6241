"""Hardware-aware prefix scheduling (DSPARK.md §4.3, Algorithm 1) and its lagged-capacity production variant.

Shapes: R requests in the batch, K draft positions, N = R*K candidates (r, j).

Notation: c_{r,j} confidence, a_{r,j} = Π_{i<=j} c_{r,i} survival, ell_r verified drafts of request r,
B = Σ_r (1 + ell_r) tokens in the verify forward, τ* = Σ_r (1 + Σ_{j<=ell_r} a_{r,j}) expected committed tokens,
SPS(B) host verify steps per second, Θ = τ*·SPS(B) expected throughput.

Algorithm 1, vectorised: sort the N candidates by a descending (a is non-increasing in j, and the sort is stable,
so each request's admitted candidates are a contiguous prefix j = 1..ell_r). Admitting the first n sorted
candidates gives τ*(n) = R + cumsum(a)_n and B(n) = R + n, so Θ(n) for every cut is one cumsum. Early stop
admits while Θ(n) > Θ(n − 1) and stops at the first non-improving candidate: the decision to admit a candidate
then depends only on candidates with larger a, i.e. on drafts before it (non-anticipating, lossless). A global
search takes argmax_n Θ(n), which looks at later candidates and is biased (kept as `GlobalSearchScheduler`).

`sps` arguments accept a `CostModel`, a vectorised callable mapping a long tensor of token counts to steps per
second, or a 1-D table indexed by B (table[B] = SPS(B); index 0 unused).
"""
from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Sequence

import torch

from dspark.engine.protocol import Proposal, Verifier
from verifiers.calibration import STSCalibrator, calibrated_confidence
from verifiers.cost_model import CostModel

SPS = CostModel | Callable[[torch.Tensor], torch.Tensor] | Sequence[float] | torch.Tensor


def _sps_at(sps: SPS, B: torch.Tensor) -> torch.Tensor:
    """SPS evaluated at token counts B (any shape, long) as float64 of the same shape."""
    if callable(sps):
        return torch.as_tensor(sps(B), dtype=torch.float64, device=B.device).expand(B.shape)
    table = torch.as_tensor(sps, dtype=torch.float64).to(B.device)
    if B.numel() and int(B.max()) >= len(table):
        raise ValueError(f"SPS table covers B <= {len(table) - 1} tokens, asked for B = {int(B.max())}")
    return table[B]


def survival(c: torch.Tensor) -> torch.Tensor:
    """a (R, K) = cumulative product of confidences c (R, K) along j."""
    return c.clamp(0.0, 1.0).cumprod(1)


def _sorted_candidates(a: torch.Tensor, limit: torch.Tensor | None):
    """Candidates sorted by a descending: (a_sorted (N,), row (N,), n_valid ()) ; invalid ones sort last as 0."""
    R, K = a.shape
    a = a.double().cummin(1).values  # why: guards contiguity; a no-op for products of c in [0, 1]
    j = torch.arange(1, K + 1, device=a.device)  # (K,)
    valid = torch.ones(R, K, dtype=torch.bool, device=a.device) if limit is None else j <= limit.view(R, 1)
    key = torch.where(valid, a, torch.full_like(a, -1.0)).flatten()  # (N,)
    key, order = torch.sort(key, descending=True, stable=True)
    row = order // K  # (N,)
    return key.clamp(min=0.0), row, valid.sum()


def _theta(a_sorted: torch.Tensor, R: int, sps: SPS) -> torch.Tensor:
    """Θ(n) for n = 0..N admitted candidates: (N+1,) float64."""
    N = a_sorted.shape[0]
    tau = R + torch.cat([a_sorted.new_zeros(1), a_sorted.cumsum(0)])  # (N+1,) τ*(n)
    B = R + torch.arange(N + 1, device=a_sorted.device)  # (N+1,)
    return tau * _sps_at(sps, B)


def _lengths(row: torch.Tensor, admitted: torch.Tensor, R: int) -> torch.Tensor:
    """ell (R,) from the first `admitted` (0-dim tensor) sorted candidates; no device sync."""
    take = (torch.arange(row.shape[0], device=row.device) < admitted).long()  # (N,)
    return torch.zeros(R, dtype=torch.long, device=row.device).scatter_add_(0, row, take)


def schedule(a: torch.Tensor, sps: SPS, *, early_stop: bool = True,
             limit: torch.Tensor | None = None) -> torch.Tensor:
    """Algorithm 1: lengths ell (R,) long from survival a (R, K); `limit` (R,) caps ell_r (invalid positions).

    early_stop=False is the biased global search (best cut of the whole sorted list).
    """
    R, K = a.shape
    if R == 0 or K == 0:
        return torch.zeros(R, dtype=torch.long, device=a.device)
    a_sorted, row, n_valid = _sorted_candidates(a, limit)
    theta = _theta(a_sorted, R, sps)  # (N+1,)
    n = torch.arange(1, theta.shape[0], device=a.device)  # (N,)
    ok = n <= n_valid  # (N,) invalid candidates are never admitted
    if early_stop:
        improving = (theta[1:] > theta[:-1]) & ok  # (N,) Θ(n) > Θ_best = Θ(n-1) while all before improved
        admitted = improving.long().cumprod(0).sum()
    else:
        admitted = torch.where(torch.cat([ok.new_ones(1), ok]), theta, -1.0).argmax()  # first best cut
    return _lengths(row, admitted, R)


def expected_throughput(a: torch.Tensor, lengths: torch.Tensor, sps: SPS) -> float:
    """Θ = τ*·SPS(B) of lengths ell (R,) under survival a (R, K)."""
    R, K = a.shape
    j = torch.arange(1, K + 1, device=a.device)
    tau = R + (a.double() * (j <= lengths.view(R, 1))).sum()
    B = R + lengths.sum()
    return float(tau * _sps_at(sps, B.view(1))[0])


def exhaustive_optimum(a: torch.Tensor, sps: SPS) -> tuple[torch.Tensor, float]:
    """The best lengths (R,) and Θ over all (K+1)^R choices; for tests on small cases."""
    R, K = a.shape
    if (K + 1) ** R > 200_000:
        raise ValueError(f"exhaustive search over {(K + 1) ** R} choices is too large (R={R}, K={K})")
    best, best_theta = None, float("-inf")
    for choice in itertools.product(range(K + 1), repeat=R):
        ell = torch.tensor(choice, dtype=torch.long, device=a.device)
        theta = expected_throughput(a, ell, sps)
        if theta > best_theta:
            best, best_theta = ell, theta
    return best, best_theta


class PrefixScheduler(Verifier):
    """Algorithm 1 with early stop: admit candidates by survival while expected throughput keeps rising.

    Lossless: each admission depends only on candidates of higher survival, i.e. on drafts before it.
    Without confidences every a = 1 and the cut is decided by the cost curve alone.
    """

    name = "scheduler"

    def __init__(self, cost: SPS, *, calibrator: STSCalibrator | None = None) -> None:
        self.cost, self.calibrator = cost, calibrator

    def lengths(self, proposal: Proposal, K: int) -> torch.Tensor:
        a = survival(calibrated_confidence(proposal, K, self.calibrator))  # (R, K)
        return schedule(a, self.cost, early_stop=True, limit=proposal.lengths)


class GlobalSearchScheduler(PrefixScheduler):
    """UNSAFE, NOT LOSSLESS: scans the whole sorted list and takes the best cut.

    The cut looks at confidences of later candidates, which depend on earlier sampled drafts, so whether a draft
    is verified depends on the drafts after it and the output distribution is biased (DSPARK.md §4.3: a target
    (0.7, 0.3) becomes (0.85, 0.15)). Kept only to demonstrate that bias in the losslessness tests.
    """

    name = "global-unsafe"
    lossless = False

    def lengths(self, proposal: Proposal, K: int) -> torch.Tensor:
        a = survival(calibrated_confidence(proposal, K, self.calibrator))  # (R, K)
        return schedule(a, self.cost, early_stop=False, limit=proposal.lengths)


class LaggedCapacityScheduler(Verifier):
    """Production variant: a batch capacity from confidences two rounds old, then top-capacity current candidates.

    Round t: the capacity n_cap = argmax_n Θ(n) is a global search over cuts of round t − 2's sorted survivals of
    the requests still in the batch (allowed: those drafts are already verified, so the search cannot look at the
    drafts it decides about, and it may cross jagged SPS cliffs). Then the current candidates are admitted top
    n_cap by a_{r,j}; whether (r, j) is admitted depends only on candidates of higher survival, never on drafts
    after x_{r,j}, so the policy is lossless. The first two rounds of a batch have no such history and fall back to
    Algorithm 1 with early stop on the current round (also lossless).
    """

    name = "lagged"
    lag = 2

    def __init__(self, cost: SPS, *, calibrator: STSCalibrator | None = None) -> None:
        self.cost, self.calibrator = cost, calibrator
        self.history: deque[tuple[torch.Tensor, torch.Tensor | None]] = deque(maxlen=self.lag)

    def begin(self, *, batch_size: int) -> None:
        self.history.clear()

    def select(self, rows: torch.Tensor) -> None:
        self.history = deque(((a[rows], None if limit is None else limit[rows]) for a, limit in self.history),
                             maxlen=self.lag)

    def capacity(self) -> torch.Tensor:
        """n_cap (0-dim long) from the oldest stored round; needs `lag` rounds of history."""
        a_old, limit_old = self.history[0]
        a_sorted, _, n_valid = _sorted_candidates(a_old, limit_old)
        theta = _theta(a_sorted, a_old.shape[0], self.cost)  # (N+1,)
        n = torch.arange(theta.shape[0], device=theta.device)
        return torch.where(n <= n_valid, theta, -1.0).argmax()

    def lengths(self, proposal: Proposal, K: int) -> torch.Tensor:
        a = survival(calibrated_confidence(proposal, K, self.calibrator))  # (R, K)
        if len(self.history) < self.lag:
            ell = schedule(a, self.cost, early_stop=True, limit=proposal.lengths)
        else:
            n_cap = self.capacity()  # decided before looking at this round's confidences
            a_sorted, row, n_valid = _sorted_candidates(a, proposal.lengths)
            ell = _lengths(row, torch.minimum(n_cap, n_valid), a.shape[0])
        self.history.append((a, proposal.lengths))
        return ell
