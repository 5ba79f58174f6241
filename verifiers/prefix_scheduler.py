"""Hardware-aware prefix scheduling (docs/DSPARK.md §4.3, Algorithm 1) and its lagged-capacity production variant,
priced by the verify forward the decode loop actually runs.

Shapes: R requests in the batch, K draft positions.

Notation: c_{r,j} confidence, a_{r,j} = Π_{i<=j} c_{r,i} survival, ell_r verified drafts of request r,
τ* = Σ_r (1 + Σ_{j<=ell_r} a_{r,j}) expected committed tokens, SPS(M) host verify steps per second at M tokens
per forward (docs/DSPARK.md's B; in this code B is always requests), t(R, T) = seconds of a forward, R rows of T tokens,
Θ = τ*·SPS = τ* / t expected throughput.

What a forward costs: `dspark.engine.decode` runs the verify step on a rectangular (R, L + 1) batch with L = max_r ell_r
(every row padded to the longest; the host step has no packed/ragged form), so a round costs
M = R·(L + 1) tokens (`verify_tokens`), not the Σ_r (1 + ell_r) of a packed forward that docs/DSPARK.md's Algorithm 1
assumes. Given the width L, positions j <= L of every row are computed anyway, so verifying them is free and only
adds expected tokens: the best lengths at width L are ell_r = min(L, limit_r). The scheduler therefore chooses
the width: Θ(L) = (R + Σ_r Σ_{j<=min(L, limit_r)} a_{r,j}) / t(R, L + 1) for L = 0..K, one cumsum over depths,
where t(R, T) is the profiled forward of R rows T tokens wide (`CostModel.step_seconds`; 1 / SPS(R·T) for tables
without that grid). why by shape and not by M = R·T alone: shapes with one M differ (on a small compiled host,
4 rows of 1 token run faster than 1 row of 4 tokens), and the SPS(M) table keeps the slowest, which prices plain
rows too dear.

Early stop (Algorithm 1's rule, over depths): deepen while Θ(L) > Θ(L − 1), stop at the first depth that does not
improve. Whether x_{r,j} is verified then depends only on survivals at depths <= j, i.e. on c_{r,<=j}, which
depend only on x_{r,<j} (and on other requests, whose drafts are independent of this one's): non-anticipating,
lossless. A global search takes argmax_L Θ(L), which looks at deeper survivals that depend on the drafts being
decided about, and is biased (kept as `GlobalSearchScheduler`).

When not to draft at all (`DraftGate`, on by default for the schedulers): verifying nothing still pays for the
draft forward, so after a round whose committed tokens did not pay for its verify forward plus the drafter's own
step (the cost table's `draft` entry), the next rounds are plain and a later round probes again.

`sps` arguments accept a `CostModel`, a vectorised callable mapping a long tensor of token counts to steps per
second, or a 1-D table indexed by M (table[M] = SPS(M); index 0 unused).
"""
from __future__ import annotations

import itertools
import math
import warnings
from collections import deque
from collections.abc import Callable, Sequence

import torch

from dspark.engine.protocol import Proposal, Verifier
from verifiers.calibration import STSCalibrator, calibrated_confidence
from verifiers.cost_model import CostModel, draft_key

SPS = CostModel | Callable[[torch.Tensor], torch.Tensor] | Sequence[float] | torch.Tensor


def _sps_at(sps: SPS, M: torch.Tensor) -> torch.Tensor:
    """SPS evaluated at token counts M (any shape, long) as float64 of the same shape."""
    if callable(sps):
        return torch.as_tensor(sps(M), dtype=torch.float64, device=M.device).expand(M.shape)
    table = torch.as_tensor(sps, dtype=torch.float64).to(M.device)
    if M.numel() and int(M.max()) >= len(table):
        raise ValueError(f"SPS table covers M <= {len(table) - 1} tokens, asked for M = {int(M.max())}")
    return table[M]


def forward_seconds(sps: SPS, R: int, width: torch.Tensor) -> torch.Tensor:
    """Seconds of a verify forward over R rows of `width` tokens each (long tensor, any shape), float64: by its shape
    from a profiled `CostModel` (`CostModel.step_seconds`), else 1 / SPS(R·width)."""
    if isinstance(sps, CostModel):
        return sps.step_seconds(R, width)
    return 1.0 / _sps_at(sps, R * width)


def survival(c: torch.Tensor) -> torch.Tensor:
    """a (R, K) = cumulative product of confidences c (R, K) along j."""
    return c.clamp(0.0, 1.0).cumprod(1)


def _theta(a: torch.Tensor, limit: torch.Tensor | None, sps: SPS) -> torch.Tensor:
    """Θ(L) for every verify width L = 0..K: (K+1,) float64, each row verifying min(L, limit_r) drafts."""
    R, K = a.shape
    a = a.double().clamp(min=0.0)  # (R, K)
    if limit is not None:  # a request never verifies past what it proposed: those positions add nothing
        a = a * (torch.arange(1, K + 1, device=a.device) <= limit.view(R, 1))
    tau = R + torch.cat([a.new_zeros(1), a.sum(0).cumsum(0)])  # (K+1,) τ*(L)
    width = torch.arange(K + 1, device=a.device)  # (K+1,)
    return tau / forward_seconds(sps, R, width + 1)  # each row carries the anchor plus L drafts


def _at_width(width: torch.Tensor, R: int, limit: torch.Tensor | None) -> torch.Tensor:
    """ell (R,) long = min(width, limit_r) for a 0-dim width; no device sync."""
    ell = width.long().expand(R).clone()
    return ell if limit is None else torch.minimum(ell, limit.long())


def schedule(a: torch.Tensor, sps: SPS, *, early_stop: bool = True,
             limit: torch.Tensor | None = None) -> torch.Tensor:
    """Lengths ell (R,) long from survival a (R, K); `limit` (R,) caps ell_r (what request r proposed).

    Chooses the verify width L (module docstring): early stop deepens while Θ(L) > Θ(L − 1); early_stop=False is
    the biased global search argmax_L Θ(L). Every row then verifies min(L, limit_r) drafts.
    """
    R, K = a.shape
    if R == 0 or K == 0:
        return torch.zeros(R, dtype=torch.long, device=a.device)
    theta = _theta(a, limit, sps)  # (K+1,)
    if early_stop:
        width = (theta[1:] > theta[:-1]).long().cumprod(0).sum()  # leading run of improving depths
    else:
        width = theta.argmax()  # first best width
    return _at_width(width, R, limit)


def expected_throughput(a: torch.Tensor, lengths: torch.Tensor, sps: SPS) -> float:
    """Θ = τ* / t(R, L + 1) of lengths ell (R,) under survival a (R, K): the forward padded to the longest row,
    L = max_r ell_r (`verify_tokens` counts its R·(L + 1) tokens)."""
    R, K = a.shape
    j = torch.arange(1, K + 1, device=a.device)
    tau = R + (a.double() * (j <= lengths.view(R, 1))).sum()
    width = (lengths.max() if R else lengths.new_zeros(())) + 1
    return float(tau / forward_seconds(sps, R, width.view(1))[0])


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


#: the draft gate's prior on its confidences' scale, in accepted drafts: (A + p) / (E + p) starts at 1 and follows
#: the realised ratio once the drafted rounds have expected a few times p drafts (DraftGate). why 1: the scale
#: multiplies the whole smoothed average, and a drafter whose confidences say 0.9 and which is never accepted
#: (tests/test_draft_gate.py) should stop within a few rounds, as it would if judged by its realised counts alone
CALIBRATION_PRIOR = 1.0


class DraftGate:
    """When not to speculate: the schedulers skip the draft forward while speculation does not pay for itself, and
    probe again later.

    After each drafted round the gate prices what the round bought. Its `rows` live requests committed c tokens in
    a round that cost t_v(R, L + 1) + t_d(R): the verify forward of the R rows of the forward at its width L (each
    row L + 1 tokens), plus the drafter's own step, both from the cost table (`CostModel.step_seconds`, and
    `CostModel.draft` from `profile_draft`). Plain decoding would have committed one token per live row in t_v(R, 1).
    So gain = (c / rows)·t_v(R, 1) / (t_v(R, L + 1) + t_d(R)),
    smoothed over a streak of drafted rounds (exponential moving average, weight `smoothing` on the newest; the
    default 0.1, about ten rounds of memory, because acceptance comes in bursts: with 0.3 a run of a few rejected
    rounds stops an n-gram drafter that pays on average; chosen among 0.3 / 0.1 / 0.05 on SmolLM2 n-gram traces
    replayed with the llama-8b table, both in benchmarks/results/cost-model/; a drafter that never pays is still
    stopped by its first round, since a streak starts from that round alone).
    While gain <= 1, the next rounds are plain: no draft forward, nothing verified. Then one round drafts again as
    a probe and is judged on its own (one round also where rounds overlap: those launched before its outcome is
    heard are plain, `draft_next`); a probe that pays resumes drafting every round. The wait after a failure is
    the longer of two: one that doubles with each failed probe (1, 2, 4, ... up to `max_wait` rounds), and the
    one that keeps probing within `probe_budget` of the time: a probe costs what the failed round cost beyond a
    plain round, t_v(R, L + 1) + t_d(R) - t_v(R, 1), so it waits that over probe_budget·t_v(R, 1) rounds (a drafter
    that costs two plain steps, as the quickstart's 2-layer DSpark does on a 2-core CPU, is probed about every
    200 rounds at the default 1 %; the first round always drafts).

    Where the drafter has confidences, a drafted round's c counts the drafts its confidences expected to be accepted
    (`expected`: the sum over rows of acceptance.expected_accepted over what each verified), scaled by what the
    drafted rounds of this decode realised against what they expected, (A + p) / (E + p) with a prior of p =
    CALIBRATION_PRIOR drafts (so over- or under-confident confidences are corrected as evidence comes in, and the
    price never rests on calibration alone). The gain is linear in that scale, so the gate smooths its two terms
    apart (the bonus token's plain / spent, and the drafts' share) and applies today's scale to the whole average: a
    scale that falls lowers every round's price at once. why: a realised count is one draw of a noisy outcome, and a
    probe that draws high restarts a streak that takes many losing rounds to end; DSpark's confidences track
    its realised acceptance closely, and its accepted counts are not bursty (unlike the n-gram's), so a
    paying probe says little about the next round (benchmarks/results/concurrency/ runs the scheduler with this gate
    from C = 1 to 512). A drafter without confidences (the n-gram) is priced by its realised counts.

    Lossless: whether a round drafts depends only on finished rounds (their counts and their drafts' confidences,
    both known before the rounds it decides about are drafted) and on whether a launched probe was heard yet, never
    on drafts not yet made, and a plain round is an ordinary round with nothing proposed.
    """

    def __init__(self, cost: SPS, *, smoothing: float = 0.1, max_wait: int = 64, probe_budget: float = 0.01) -> None:
        if not 0.0 < smoothing <= 1.0 or max_wait < 1 or not 0.0 < probe_budget <= 1.0:
            raise ValueError(f"need 0 < smoothing <= 1, max_wait >= 1 and 0 < probe_budget <= 1, got {smoothing}, "
                             f"{max_wait}, {probe_budget}")
        self.cost, self.smoothing, self.max_wait, self.probe_budget = cost, smoothing, max_wait, probe_budget
        self.key: str | None = None
        self.fixed_draft_s: float | None = None  # a draft price given directly (the replay simulator's)
        self.begin()

    def bind(self, *, drafter, K: int) -> None:
        """Start over for a decode of `drafter` at K (once per generate call: what the gate learnt carries over
        from one static batch to the next, as the workload does)."""
        self.begin()
        self.key = draft_key(drafter, K)
        draft = getattr(self.cost, "draft", {})
        if K and self.key not in draft:
            warnings.warn(f"the cost table has no draft cost for {self.key!r} (profiled: {sorted(draft) or 'none'}): "
                          "the scheduler prices the drafter's own step as free and so speculates more than pays; "
                          "profile it (`dspark profile --drafter-path ...`, verifiers.cost_model.profile_draft)",
                          stacklevel=3)

    def begin(self) -> None:
        self.gain: float | None = None  # smoothed gain of speculating over plain decoding
        self.wait, self.skip_left, self.probing = 1, 0, False
        self.awaiting = False  # a probe was launched and its outcome has not been heard (after_round) yet
        self.seen_accepted = self.seen_expected = 0.0  # over this decode's drafted rounds with confidences
        self.bonus = self.drafts = 0.0  # the smoothed gain's two terms (after_round)

    def scale(self) -> float:
        """The confidences' correction: realised over expected accepted drafts of this decode's drafted rounds with
        confidences, (A + p) / (E + p), p = CALIBRATION_PRIOR; 1 before any (and for a drafter without them)."""
        return (self.seen_accepted + CALIBRATION_PRIOR) / (self.seen_expected + CALIBRATION_PRIOR)

    def draft_next(self) -> bool:
        """Whether the next round drafts. A probe (the first round, or the first after a wait) is one round: the
        rounds launched before its outcome is heard are plain. why: the overlapped slot engine launches round r + 1
        before it commits round r, so without this a failed probe would draft twice, paying a drafted round's
        cost (a few plain rounds') once more; in order, the outcome is always heard first and nothing changes."""
        if self.skip_left > 0 or self.awaiting:
            return False
        self.awaiting = self.gain is None or self.probing
        return True

    def _seconds(self, rows: int, width: int) -> float:
        return float(forward_seconds(self.cost, rows, torch.tensor([width]))[0])

    def after_round(self, *, slots: int, rows: int, width: int, drafted: bool, committed: int,
                    expected: float | None = None) -> None:
        if not drafted:
            self.skip_left = max(0, self.skip_left - 1)
            return
        self.awaiting = False  # heard, whatever it shows (a round of no live rows shows nothing: probed again next)
        if rows == 0:
            return
        draft_s = self.fixed_draft_s
        if draft_s is None and self.key is not None:
            draft_s = getattr(self.cost, "draft_seconds", lambda *_: None)(self.key, slots)
        if width == 0 and not draft_s:  # nothing verified, nothing spent (an n-gram drafter without a match):
            return  # no evidence either way; judged as a failed probe, it would gate off a free drafter for nothing
        plain, spent = self._seconds(slots, 1), self._seconds(slots, width + 1) + (draft_s or 0.0)
        # gain = (rows + accepted) / rows * plain / spent, kept as its two terms: the one token a row commits anyway,
        # and the accepted drafts' share, whose scale (the confidences' correction) applies to the whole average
        bonus, drafts = plain / spent, (committed - rows if expected is None else expected) / rows * plain / spent
        if expected is not None:  # the confidences' expectation, scaled by what was realised against it (docstring)
            self.seen_accepted += committed - rows
            self.seen_expected += expected
        fresh = self.gain is None or self.probing
        w = 1.0 if fresh else self.smoothing
        self.bonus = w * bonus + (1 - w) * self.bonus
        self.drafts = w * drafts + (1 - w) * self.drafts
        self.gain = self.bonus + self.scale() * self.drafts
        self.probing = False
        if self.gain > 1.0:
            self.wait = 1
        else:
            amortised = math.ceil(max(spent - plain, 0.0) / (self.probe_budget * plain))
            self.skip_left, self.probing = max(self.wait, amortised), True
            self.wait = min(2 * self.wait, self.max_wait)


class _Gated(Verifier):
    """A scheduler that drafts only while it pays (`DraftGate`); gate=False drafts every round."""

    def _init_gate(self, cost: SPS, gate: bool) -> None:
        self.gate = DraftGate(cost) if gate else None
        self.gates_drafts = gate

    def bind(self, *, drafter, K: int) -> None:
        if self.gate is not None:
            self.gate.bind(drafter=drafter, K=K)

    def draft_next(self) -> bool:
        return self.gate is None or self.gate.draft_next()

    def after_round(self, **round_) -> None:
        if self.gate is not None:
            self.gate.after_round(**round_)


class PrefixScheduler(_Gated):
    """Algorithm 1 with early stop, over verify widths: deepen while expected throughput keeps rising.

    Lossless: verifying depth j depends only on survivals at depths <= j, i.e. on drafts before x_j.
    Without confidences every a = 1 and the width is decided by the cost curve alone. With `gate` (the default)
    it also knows when not to speculate: `DraftGate` skips the draft forward while drafting does not pay.
    """

    name = "scheduler"

    def __init__(self, cost: SPS, *, calibrator: STSCalibrator | None = None, gate: bool = True) -> None:
        self.cost, self.calibrator = cost, calibrator
        # lengths() is tensor-only with a CostModel (its interpolation grid is built on the device at the first
        # call, before any capture); a table or another callable may read values back, a calibrator is not vetted
        self.capturable = calibrator is None and isinstance(cost, CostModel)
        self._init_gate(cost, gate)

    def lengths(self, proposal: Proposal, K: int) -> torch.Tensor:
        a = survival(calibrated_confidence(proposal, K, self.calibrator))  # (R, K)
        return schedule(a, self.cost, early_stop=True, limit=proposal.lengths)


class GlobalSearchScheduler(PrefixScheduler):
    """UNSAFE, NOT LOSSLESS: scans every width and takes the best.

    The choice looks at survivals of deeper positions, which depend on earlier sampled drafts, so whether a draft
    is verified depends on the drafts after it and the output distribution is biased (docs/DSPARK.md §4.3: a target
    (0.7, 0.3) becomes (0.85, 0.15)). Kept only to demonstrate that bias in the losslessness tests.
    """

    name = "global-unsafe"
    lossless = False

    def lengths(self, proposal: Proposal, K: int) -> torch.Tensor:
        a = survival(calibrated_confidence(proposal, K, self.calibrator))  # (R, K)
        return schedule(a, self.cost, early_stop=False, limit=proposal.lengths)


class LaggedCapacityScheduler(_Gated):
    """Production variant: the batch's verify width from confidences two rounds old.

    Round t: the capacity L_cap = argmax_L Θ(L) is a global search over the widths of round t − 2's survivals of
    the requests still in the batch (allowed: those drafts are already verified, so the search cannot look at the
    drafts it decides about, and it may cross jagged SPS cliffs). The current round then verifies
    ell_r = min(L_cap, limit_r): the forward is R·(L_cap + 1) tokens wide whatever the current confidences say,
    and positions inside it cost nothing more (docs/DSPARK.md's "top-capacity current candidates" is the packed-forward
    form of the same rule). Nothing of the current round decides its lengths, so the policy is lossless. The first
    two rounds of a batch have no such history and fall back to early stop on the current round (also lossless).
    """

    name = "lagged"
    lag = 2

    def __init__(self, cost: SPS, *, calibrator: STSCalibrator | None = None, gate: bool = True) -> None:
        self.cost, self.calibrator = cost, calibrator
        self.history: deque[tuple[torch.Tensor, torch.Tensor | None]] = deque(maxlen=self.lag)
        self._init_gate(cost, gate)

    def begin(self, *, batch_size: int) -> None:
        self.history.clear()

    def select(self, rows: torch.Tensor) -> None:
        self.history = deque(((a[rows], None if limit is None else limit[rows]) for a, limit in self.history),
                             maxlen=self.lag)

    def capacity(self) -> torch.Tensor:
        """L_cap (0-dim long), the verify width, from the oldest stored round; needs `lag` rounds of history."""
        a_old, limit_old = self.history[0]
        return _theta(a_old, limit_old, self.cost).argmax()

    def next_width(self) -> torch.Tensor | None:
        """The next round's capacity: the oldest stored round is the one the next lengths() will search."""
        return self.capacity() if len(self.history) == self.lag else None

    def lengths(self, proposal: Proposal, K: int) -> torch.Tensor:
        a = survival(calibrated_confidence(proposal, K, self.calibrator))  # (R, K)
        if len(self.history) < self.lag:
            ell = schedule(a, self.cost, early_stop=True, limit=proposal.lengths)
        else:  # decided before looking at this round's confidences
            ell = _at_width(self.capacity().clamp(max=K), a.shape[0], proposal.lengths)
        self.history.append((a, proposal.lengths))
        return ell
