"""Every verification policy inside the decode loop: greedy output is exact under all of them, and at T = 1 the
non-anticipating ones are lossless while the global search is not (docs/DSPARK.md §4.3).

The counterexample: a host whose next-token distribution is p = (0.7, 0.3) at every position, and a hand-made
drafter with q = (0.5, 0.5) whose confidence in x_{k+1} is high after x_k = 0 and low after x_k = 1 (a function of
x_<k+1 only, like DSpark's). On an SPS curve with a cliff the global search verifies x_1 exactly when x_1 = 0,
because only then is the later candidate x_2 worth crossing the cliff for; a drafted 0 is always accepted (p > q),
a drafted 1 is never looked at, so the next token is 0 with probability 0.5 + 0.5 * 0.7 = 0.85: the paper's
(0.7, 0.3) -> (0.85, 0.15). Early stop verifies nothing there, and the lagged variant decides from two rounds ago.

Shapes: B requests, K draft positions, V vocabulary, n seeds of a statistical test.
"""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from dspark.engine.decode import generate
from dspark.engine.host import Host
from dspark.engine.protocol import DraftState, Drafter, Proposal, Verifier, VerifyAll
from dspark.engine.sampling import STREAM_DRAFT, SamplingConfig, process, sample
from tests.conftest import tiny_model
from tests.test_decode import (ALPHA, K, NEW, accepted, batch8, chi2_pvalue, greedy_reference, micro_dspark,
                               trained_dspark)
from verifiers import VERIFIERS, build_verifier
from verifiers.cost_model import CostModel
from verifiers.prefix_scheduler import GlobalSearchScheduler, LaggedCapacityScheduler, PrefixScheduler
from verifiers.threshold import ThresholdVerifier

T1 = SamplingConfig(temperature=1.0)


# ---- greedy: exact under every policy --------------------------------------------------------------------------

def policy(name: str, B: int) -> Verifier:
    """Each registered verifier, configured so that it does cut verification on the tiny host."""
    # flat up to 3 tokens per request (two drafts each on average), then step time proportional to tokens
    cost = CostModel.from_points({1: 100.0, 3 * B: 100.0})
    return build_verifier(name, threshold=0.6 if name == "threshold" else None,
                          cost_table=cost if name in ("scheduler", "lagged", "global-unsafe") else None)


def length_caps(result, limit: int) -> torch.Tensor:
    """Per log row, the most drafts the decode loop lets a round verify: proposed, and never past the request's
    max_new_tokens (`limit` - committed so far - 1 for the token after the drafts)."""
    log, done, caps = result.log, {}, []
    for r, c, p in zip(log.column("request").tolist(), log.column("committed").tolist(),
                       log.column("proposed").tolist()):
        made = done.get(r, 1)  # the prefill token
        caps.append(min(p, max(limit - made - 1, 0)))
        done[r] = made + c
    return torch.tensor(caps)


@pytest.mark.parametrize("name", sorted(VERIFIERS))
def test_greedy_is_exact_under_every_policy(tiny_host, name):
    drafter = trained_dspark(tiny_host)  # gives confidences, and drafts that get accepted
    prompts = batch8(tiny_host)
    verified, caps = [], []
    for B in (1, 8):
        out = generate(tiny_host, prompts[:B], drafter=drafter, verifier=policy(name, B), draft_length=K,
                       max_new_tokens=NEW)
        assert out.token_ids == [greedy_reference(tiny_host, tuple(p), NEW) for p in prompts[:B]], f"batch {B}"
        assert accepted(out) > 0
        verified.append(out.log.column("verified"))
        caps.append(length_caps(out, NEW))
    verified, caps = torch.cat(verified), torch.cat(caps)
    assert bool((verified <= caps).all())
    if name == "full":
        assert bool((verified == caps).all())
    else:  # the policy did shorten verification, so exactness is checked for partial lengths too
        assert bool((verified < caps).any()) and bool((verified > 0).any())


# ---- the counterexample: p = (0.7, 0.3), q = (0.5, 0.5) --------------------------------------------------------

P = (0.7, 0.3)
CLIFF = CostModel.from_points({1: 100.0, 2: 40.0, 3: 60.0})  # SPS(M) at M = 1 + ell for one request (K = 2)
SMOOTH = CostModel.from_points({1: 100.0, 2: 90.0, 3: 80.0})
N_SEEDS = 8000
NEW_TOKENS = 6


class FixedHost(Host):
    """A real host forward (cache, masks, taps) whose next-token distribution is the same p at every position."""

    def __init__(self, p) -> None:
        super().__init__(tiny_model("llama", vocab=len(p), hidden=32, layers=1), name="fixed-p")
        self.log_p = torch.tensor(p, dtype=torch.float32).log()  # (V,)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.log_p.expand(*hidden.shape[:-1], len(self.log_p)).clone()


class CounterexampleDrafter(Drafter):
    """x_k ~ q = uniform over {0, 1}, independently (counter-based noise, fresh per round); c_1 = 0.5 and
    c_{k+1} = 0.9 after x_k = 0, 0.1 after x_k = 1."""

    name = "counterexample"

    def propose(self, state: DraftState, K: int) -> Proposal:
        B = state.seq.shape[0]
        q = torch.full((B, K, 2), 0.5)  # (B, K, V)
        counter = state.rounds.unsqueeze(1) * 1024 + torch.arange(K)  # (B, K)
        tokens = sample(q, state.seeds, counter, STREAM_DRAFT)  # (B, K)
        c = torch.full((B, K), 0.5)  # (B, K)
        c[:, 1:] = torch.where(tokens[:, :-1] == 0, 0.9, 0.1)
        return Proposal(tokens=tokens, q=q, confidence=c)


class AloneInBatch(Verifier):
    """Applies a policy to every request as if it were alone in its batch (R = 1, its own history), so one batched
    generate call decodes n independent single-request runs. At R = 1 a registered policy is a deterministic
    function of the request's last `HISTORY` proposals (the lagged one keeps two rounds besides the current), so
    each distinct such history is evaluated once, by replaying it into a fresh instance."""

    HISTORY = LaggedCapacityScheduler.lag + 1

    name = "alone"

    def __init__(self, factory) -> None:
        self.factory = factory
        self.memo: dict[tuple, int] = {}
        self.returned: Counter[int] = Counter()  # lengths the policy chose, before the decode loop's clipping

    def begin(self, *, batch_size: int) -> None:
        self.history: list[list[tuple]] = [[] for _ in range(batch_size)]

    def select(self, rows: torch.Tensor) -> None:
        self.history = [self.history[i] for i in rows.tolist()]

    def lengths(self, proposal: Proposal, K: int) -> torch.Tensor:
        tokens, conf = proposal.tokens.tolist(), proposal.confidence.tolist()
        ell = []
        for b, past in enumerate(self.history):
            past.append((tuple(tokens[b]), tuple(conf[b])))
            del past[: -self.HISTORY]
            key = tuple(past)
            if key not in self.memo:
                single = self.factory()
                single.begin(batch_size=1)
                for t, c in past:
                    out = single.lengths(Proposal(tokens=torch.tensor([t]), confidence=torch.tensor([c])), K)
                self.memo[key] = int(out[0])
            ell.append(self.memo[key])
            self.returned[ell[-1]] += 1
        return torch.tensor(ell, dtype=torch.long)


# name -> (policy factory, it must be lossless, verification lengths it must produce)
COUNTEREXAMPLE = {
    "full": (VerifyAll, True, {2}),
    "threshold": (lambda: ThresholdVerifier(0.3), True, {1, 2}),  # a_2 = 0.45 after a 0, 0.05 after a 1
    "scheduler": (lambda: PrefixScheduler(SMOOTH), True, {1, 2}),
    "scheduler-cliff": (lambda: PrefixScheduler(CLIFF), True, {0}),  # early stop refuses to cross the cliff
    "lagged-cliff": (lambda: LaggedCapacityScheduler(CLIFF), True, {0, 2}),  # capacity from 2 rounds ago
    "global-unsafe-cliff": (lambda: GlobalSearchScheduler(CLIFF), False, {0, 2}),
}


def test_counterexample_covers_every_registered_policy():
    covered = {factory().name for factory, _, _ in COUNTEREXAMPLE.values()}
    assert covered == set(VERIFIERS)
    for factory, lossless, _ in COUNTEREXAMPLE.values():
        assert factory().lossless == lossless


@pytest.fixture(scope="module")
def fixed_host() -> Host:
    return FixedHost(P)


@pytest.mark.parametrize("case", list(COUNTEREXAMPLE))
def test_counterexample_lossless_policies_pass_global_search_fails(fixed_host, case):
    """Joint of generated tokens 2..6 (all decided through drafts; token 1 is drawn at prefill) over N_SEEDS fixed
    seeds against i.i.d. p: the lossless policies pass, the global search is rejected with a tiny p-value and
    puts 0.85 on token 2, as in the paper."""
    factory, lossless, lengths = COUNTEREXAMPLE[case]
    verifier = AloneInBatch(factory)
    out = generate(fixed_host, [[0, 1, 1]] * N_SEEDS, drafter=CounterexampleDrafter(), verifier=verifier,
                   draft_length=2, max_new_tokens=NEW_TOKENS, sampling=T1, seeds=list(range(N_SEEDS)))
    tokens = torch.tensor(out.token_ids)  # (n, NEW_TOKENS)
    assert tokens.shape == (N_SEEDS, NEW_TOKENS)
    assert set(verifier.returned) == lengths  # the policy behaved as designed on this case
    m = NEW_TOKENS - 1
    drafted = tokens[:, 1:]  # (n, m) tokens 2.., i.i.d. p under a lossless policy
    cells = (drafted * (2 ** torch.arange(m))).sum(1)  # (n,) the m binary tokens as one cell index
    ones = torch.stack([(torch.arange(2 ** m) >> j) & 1 for j in range(m)], 1).sum(1)  # (2^m,) count of 1s
    probs = torch.tensor(P[0], dtype=torch.float64) ** (m - ones) * torch.tensor(P[1], dtype=torch.float64) ** ones
    pvalue = chi2_pvalue(torch.bincount(cells, minlength=2 ** m), probs)
    second_is_zero = float((tokens[:, 1] == 0).double().mean())
    if lossless:
        assert pvalue > ALPHA, f"{case}: p-value {pvalue:.2e}"
        assert abs(second_is_zero - P[0]) < 0.02
    else:
        assert pvalue < 1e-12, f"{case}: the biased policy was not detected (p-value {pvalue:.2e})"
        assert abs(second_is_zero - 0.85) < 0.02, second_is_zero  # the paper's (0.85, 0.15)


# ---- the real DSpark drafter on the micro host, batch-level policies -------------------------------------------

MICRO_PROMPT = [1, 5, 2, 1, 5, 2, 6]
MICRO_K = 3
MICRO_SEEDS = 8000


def exact_joint(host: Host, prompt: list[int], L: int, cfg: SamplingConfig) -> torch.Tensor:
    """The exact joint (V,)*L of the first L generated tokens, one plain batched forward per depth."""
    V = host.vocab_size
    joint = torch.ones(1, dtype=torch.float64)  # over the V**d prefixes of depth d
    prefixes = torch.zeros(1, 0, dtype=torch.long)  # (V**d, d)
    for _ in range(L):
        ids = torch.cat([torch.tensor(prompt).expand(len(prefixes), -1), prefixes], 1)
        with torch.no_grad():
            p = process(host.model(ids).logits[:, -1], cfg).double()  # (V**d, V)
        joint = (joint.unsqueeze(1) * p).flatten()
        prefixes = torch.cat([prefixes.repeat_interleave(V, 0), torch.arange(V).repeat(len(prefixes)).unsqueeze(1)],
                             1)
    return joint.view((V,) * L)


def micro_policy(name: str) -> Verifier:
    # flat up to 1.5 tokens per request over the whole batch, then step time proportional to tokens
    cost = CostModel.from_points({1: 100.0, MICRO_SEEDS * 3 // 2: 100.0})
    return build_verifier(name, threshold=0.3 if name == "threshold" else None,
                          cost_table=cost if name in ("scheduler", "lagged", "global-unsafe") else None)


@pytest.mark.parametrize("name", sorted(n for n, v in VERIFIERS.items() if v.lossless))
def test_lossless_policies_with_dspark_drafter_in_one_batch(micro_host, name):
    """All seeds share one batch, so the schedulers trade verification between requests; each request's output
    must still follow the host. Pairs (1, 2), (2, 3) and (3, 4) of the first four generated tokens."""
    host, V = micro_host, micro_host.vocab_size
    out = generate(host, [MICRO_PROMPT] * MICRO_SEEDS, drafter=micro_dspark(host), verifier=micro_policy(name),
                   draft_length=MICRO_K, max_new_tokens=5, sampling=T1, seeds=list(range(MICRO_SEEDS)))
    tokens = torch.tensor(out.token_ids)  # (n, 5)
    verified, acc = out.log.column("verified"), out.log.column("accepted")
    assert int(acc.sum()) > 0.05 * MICRO_SEEDS and bool((acc < verified).any())
    if name != "full":
        assert bool(((verified > 0) & (verified < MICRO_K)).any())
    joint = exact_joint(host, MICRO_PROMPT, 4, T1)  # (V, V, V, V)
    for i in range(3):
        pair = joint.sum(dim=tuple(d for d in range(4) if d not in (i, i + 1)))  # (V, V)
        pvalue = chi2_pvalue(torch.bincount(tokens[:, i] * V + tokens[:, i + 1], minlength=V * V), pair)
        assert pvalue > ALPHA, f"tokens {i + 1}-{i + 2}: p-value {pvalue:.2e}"
