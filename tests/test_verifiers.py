"""Verification policies on hand-made confidences and cost curves (no host, no decode loop)."""
from __future__ import annotations

import pytest
import torch

from dspark.engine.protocol import Proposal
from verifiers import VERIFIERS, build_verifier, policy_options
from verifiers.calibration import STSCalibrator
from verifiers.cost_model import CostModel, verify_tokens
from verifiers.prefix_scheduler import (LaggedCapacityScheduler, PrefixScheduler, exhaustive_optimum,
                                        expected_throughput, schedule, survival)
from verifiers.threshold import ThresholdVerifier

K = 5


def proposal(c: torch.Tensor | None, *, B: int | None = None, lengths: torch.Tensor | None = None) -> Proposal:
    B = c.shape[0] if c is not None else B
    return Proposal(tokens=torch.zeros(B, K if c is None else c.shape[1], dtype=torch.long), confidence=c,
                    lengths=lengths)


def steep() -> CostModel:
    """Memory-bound up to 16 tokens, then step time proportional to tokens."""
    return CostModel.from_points({1: 100.0, 16: 100.0})


def make(name: str):
    return build_verifier(name, threshold=0.3 if name == "threshold" else None,
                          cost_table=steep() if name in ("scheduler", "lagged", "global-unsafe") else None)


@pytest.mark.parametrize("name", sorted(VERIFIERS))
def test_contract(name):
    g = torch.Generator().manual_seed(0)
    v = make(name)
    v.begin(batch_size=6)
    lengths = torch.tensor([5, 0, 3, 5, 1, 2])
    for round_ in range(4):
        c = torch.rand(6 if round_ < 2 else 4, K, generator=g)
        prop = proposal(c, lengths=lengths[: c.shape[0]])
        ell = v.lengths(prop, K)
        assert ell.dtype == torch.long and ell.shape == (c.shape[0],)
        assert bool(((ell >= 0) & (ell <= K)).all())
        if name != "threshold":  # the threshold rule leaves clipping to the decode loop
            assert bool((ell <= prop.lengths).all())
        if round_ == 1:
            v.select(torch.tensor([0, 2, 3, 5]))
            lengths = lengths[torch.tensor([0, 2, 3, 5])]
    assert v.lossless == (name != "global-unsafe")


@pytest.mark.parametrize("name", sorted(VERIFIERS))
def test_without_confidence_flat_cost_verifies_all(name):
    v = build_verifier(name, threshold=0.5 if name == "threshold" else None,
                       cost_table=CostModel.flat() if name in ("scheduler", "lagged", "global-unsafe") else None)
    v.begin(batch_size=3)
    for _ in range(3):
        assert v.lengths(proposal(None, B=3), K).tolist() == [K, K, K]


def test_verify_all_uses_proposal_lengths():
    v = VERIFIERS["full"]()
    assert v.lengths(proposal(torch.rand(2, K), lengths=torch.tensor([2, 5])), K).tolist() == [2, 5]


def test_threshold_rules():
    c = torch.tensor([[0.9, 0.5, 0.95, 0.9, 0.9],
                      [0.99, 0.99, 0.99, 0.99, 0.2]])
    p = proposal(c)
    assert ThresholdVerifier(0.6, "position").lengths(p, K).tolist() == [1, 4]
    # a = [0.9, 0.45, ...] and [0.99, 0.98, 0.97, 0.96, 0.19]
    assert ThresholdVerifier(0.9, "cumulative").lengths(p, K).tolist() == [1, 4]
    assert ThresholdVerifier(0.0).lengths(p, K).tolist() == [K, K]
    assert ThresholdVerifier(1.0).lengths(p, K).tolist() == [0, 0]
    # monotone in the threshold
    prev = torch.full((2,), K)
    for tau in torch.linspace(0, 1, 21).tolist():
        ell = ThresholdVerifier(tau).lengths(p, K)
        assert bool((ell <= prev).all())
        prev = ell
    with pytest.raises(ValueError, match="mode"):
        ThresholdVerifier(0.5, "average")
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        ThresholdVerifier(1.5)


def test_threshold_applies_calibration():
    c = torch.full((1, K), 0.8)
    cal = STSCalibrator(temperatures=[4.0] * K)  # softens 0.8 to about 0.59
    assert ThresholdVerifier(0.7, "position").lengths(proposal(c), K).tolist() == [K]
    assert ThresholdVerifier(0.7, "position", calibrator=cal).lengths(proposal(c), K).tolist() == [0]


def test_every_request_verifies_up_to_one_width():
    """The loop pads every row to the longest, so positions up to the chosen width are verified in every row."""
    g = torch.Generator().manual_seed(1)
    for _ in range(20):
        R = int(torch.randint(1, 9, (1,), generator=g))
        a = survival(torch.rand(R, K, generator=g) * 0.5 + 0.5)
        limit = torch.randint(0, K + 1, (R,), generator=g)
        for early_stop in (True, False):
            ell = schedule(a, steep(), early_stop=early_stop, limit=limit)
            width = int(ell.max())
            assert ell.tolist() == torch.minimum(torch.tensor(width), limit).tolist()


def test_scheduler_prices_the_padded_verify_forward():
    """Two requests, one confident and one not: a packed forward would verify the confident one's first draft at
    B = 3 tokens, but the loop runs both rows at that width, B = 4, where the step is twice as slow."""
    a = survival(torch.tensor([[0.95, 0.95], [0.05, 0.05]]))
    table = [0.0, 100.0, 100.0, 100.0, 50.0, 50.0, 50.0]  # SPS indexed by B
    assert verify_tokens(torch.tensor(1), 2) == 4 and verify_tokens(torch.tensor([0, 2]), 3).tolist() == [3, 9]
    # Θ(width 0) = 2 * 100; Θ(width 1) = (2 + 0.95 + 0.05) * SPS(4) = 150: verify nothing
    assert schedule(a, table).tolist() == [0, 0]
    assert expected_throughput(a, torch.tensor([1, 0]), table) == pytest.approx(2.95 * 50.0)
    assert expected_throughput(a, torch.tensor([1, 1]), table) == pytest.approx(3.0 * 50.0)
    assert expected_throughput(a, torch.tensor([0, 0]), table) == pytest.approx(200.0)


def test_scheduler_prices_widths_by_the_forwards_shape():
    """Width 0 for 4 rows is the (4, 1) forward, not M = 4's slowest shape (1, 4): with a table where 4 rows of one
    token are cheap, drafts the SPS(M) price found worth verifying are not."""
    from tests.test_cost_model import shaped_table

    cost = shaped_table({(1, 1): 1.0, (1, 2): 1.1, (1, 4): 1.8, (4, 1): 1.0, (4, 2): 1.6, (4, 4): 2.0})
    a = survival(torch.full((4, 1), 0.5))
    # by shape: Θ(0) = 4 / 1.0 ms = 4000/s against Θ(1) = (4 + 4 * 0.5) / 1.6 ms = 3750/s; by SPS(M), where M = 4 is
    # priced at (1, 4)'s 1.8 ms: Θ(0) = 4 / 1.8 ms = 2222/s, so verifying looked better
    assert schedule(a, cost).tolist() == [0, 0, 0, 0]
    assert schedule(a, lambda M: cost(M)).tolist() == [1, 1, 1, 1]  # the same table read by M alone
    assert expected_throughput(a, torch.tensor([0, 0, 0, 0]), cost) == pytest.approx(4000.0)


def test_priced_tokens_are_the_tokens_the_decode_loop_runs(tiny_host, monkeypatch):
    """Every verify round of a real decode: the host step gets exactly verify_tokens(max ell, R) tokens."""
    from drafters.ngram import NgramDrafter
    from dspark.engine.decode import generate
    from tests.conftest import random_prompts, with_draft_price

    steps = []
    step = tiny_host.step
    monkeypatch.setattr(tiny_host, "step", lambda cache, tokens, *a, **kw: (steps.append(tokens.shape),
                                                                            step(cache, tokens, *a, **kw))[1])
    prompts = random_prompts([12, 20, 9], tiny_host.vocab_size)
    drafter = NgramDrafter()
    verifier = PrefixScheduler(with_draft_price(steep(), drafter, K, 1e-6))  # a lookup: next to nothing
    out = generate(tiny_host, prompts, drafter=drafter, verifier=verifier, draft_length=K, max_new_tokens=16)
    rounds, chosen = steps[1:], out.log.per_round("verified")  # after the prefill; the lengths verified per round
    assert len(rounds) == len(chosen) > 0
    ragged = 0
    for (R, T), ell in zip(rounds, chosen):
        assert R * T == int(verify_tokens(ell.max(), R))  # what the scheduler priced is what ran
        ragged += int((ell + 1).sum()) != R * T
    assert ragged > 0  # rows verified different lengths, so a packed price would have been wrong


def test_budget_shrinks_with_concurrency_and_grows_with_flat_cost():
    c = torch.tensor([0.9, 0.85, 0.8, 0.75, 0.7])
    per_request = []
    for R in (1, 2, 4, 8, 16, 32):
        ell = schedule(survival(c.expand(R, K)), steep())
        per_request.append(ell.float().mean().item())
        flat = schedule(survival(c.expand(R, K)), CostModel.flat())
        assert flat.tolist() == [K] * R  # a flat curve makes every draft worth verifying
    assert all(b <= a for a, b in zip(per_request, per_request[1:])), per_request
    assert per_request[0] == K and per_request[-1] < 1, per_request


def test_scheduler_never_beats_exhaustive_optimum_and_global_search_reaches_it():
    g = torch.Generator().manual_seed(2)
    for _ in range(60):
        R, k = int(torch.randint(1, 4, (1,), generator=g)), int(torch.randint(1, 4, (1,), generator=g))
        a = survival(torch.rand(R, k, generator=g))
        table = [0.0] + (torch.rand(R * (k + 1), generator=g) * 100 + 1).tolist()  # jagged SPS indexed by B
        _, best = exhaustive_optimum(a, table)
        early = expected_throughput(a, schedule(a, table), table)
        full = expected_throughput(a, schedule(a, table, early_stop=False), table)
        assert early <= best + 1e-9
        # for a fixed B the best tau* takes the top survivals, so the best cut of the sorted list is optimal
        assert full == pytest.approx(best)


def test_early_stop_and_global_search_differ_across_an_sps_cliff():
    a = survival(torch.tensor([[0.9, 0.9, 0.9]]))
    table = [0.0, 100.0, 40.0, 90.0, 90.0]  # a cliff at M = 2 tokens, recovery at M = 3
    # Θ(0) = 100, Θ(1) = 1.9 * 40 = 76: early stop verifies nothing; Θ(3) = 3.44 * 90 = 310 is the best cut
    assert schedule(a, table).tolist() == [0]
    assert schedule(a, table, early_stop=False).tolist() == [3]
    p = proposal(a.new_tensor([[0.9, 0.9, 0.9]]))
    assert PrefixScheduler(table).lengths(p, 3).tolist() == [0]
    assert VERIFIERS["global-unsafe"](table).lengths(p, 3).tolist() == [3]


def test_schedule_respects_limits():
    a = survival(torch.full((2, K), 0.9))
    assert schedule(a, CostModel.flat(), limit=torch.tensor([1, 3])).tolist() == [1, 3]
    assert schedule(a, CostModel.flat(), limit=torch.tensor([0, 0]), early_stop=False).tolist() == [0, 0]


def test_lagged_capacity_uses_only_old_confidences():
    g = torch.Generator().manual_seed(3)
    cost = CostModel.from_points({1: 100.0, 8: 100.0, 48: 40.0})  # gradual decline: capacity depends on a
    c1, c2 = torch.rand(8, K, generator=g), torch.rand(8, K, generator=g)
    totals, capacities = [], []
    for c3 in (torch.rand(8, K, generator=g), torch.full((8, K), 0.99), torch.full((8, K), 0.01)):
        v = LaggedCapacityScheduler(cost)
        v.begin(batch_size=8)
        # the first two rounds fall back to Algorithm 1 on the current round
        assert v.lengths(proposal(c1), K).tolist() == schedule(survival(c1), cost).tolist()
        v.lengths(proposal(c2), K)
        capacities.append(int(v.capacity()))
        totals.append(int(v.lengths(proposal(c3), K).sum()))
    assert len(set(capacities)) == 1 and len(set(totals)) == 1  # current confidences cannot move the budget
    assert totals[0] == int(schedule(survival(c1), cost, early_stop=False).sum())  # global search on round t-2
    # ... but the round-(t-2) confidences do
    v = LaggedCapacityScheduler(cost)
    v.begin(batch_size=8)
    v.lengths(proposal(torch.full((8, K), 0.99)), K)
    v.lengths(proposal(c2), K)
    assert int(v.capacity()) > capacities[0]


def test_lagged_verifies_the_old_rounds_width_and_follows_select():
    cost = CostModel.from_points({1: 100.0, 4: 100.0})
    v = LaggedCapacityScheduler(cost)
    v.begin(batch_size=4)
    old = torch.tensor([0.9, 0.8, 0.7, 0.6, 0.5]).expand(4, K)
    v.lengths(proposal(old), K)
    v.lengths(proposal(old), K)
    v.select(torch.tensor([1, 3]))
    assert v.history[0][0].shape == (2, K)
    width = int(v.capacity())
    assert 0 < width < K
    cur = torch.tensor([[0.99] * K, [0.5] * K])
    assert v.lengths(proposal(cur), K).tolist() == [width, width]  # the whole width, whatever the confidences
    v.lengths(proposal(cur), K)
    assert v.lengths(proposal(cur, lengths=torch.tensor([1, K])), K).tolist() == [1, int(v.capacity())]
    v.begin(batch_size=2)
    assert len(v.history) == 0


@pytest.mark.parametrize("name", sorted(VERIFIERS))
def test_policy_options_give_each_policy_what_it_takes(name):
    """A sweep shares one threshold and one cost table among its policies; each gets only its own."""
    cost = CostModel.flat()
    options = policy_options(name, threshold=0.5, cost_table=cost)
    assert (options["threshold"] is not None) == (name == "threshold")
    assert (options["cost_table"] is cost) == (name in ("scheduler", "lagged", "global-unsafe"))
    assert isinstance(build_verifier(name, **options), VERIFIERS[name])


def test_build_verifier_errors(tmp_path):
    with pytest.raises(ValueError, match="choose one of.*full.*scheduler"):
        build_verifier("medusa")
    with pytest.raises(ValueError, match="needs cost_table"):
        build_verifier("scheduler")
    with pytest.raises(ValueError, match="needs threshold"):
        build_verifier("threshold")
    with pytest.raises(ValueError, match="only to the 'threshold'"):
        build_verifier("full", threshold=0.5)
    with pytest.raises(ValueError, match="cost table applies only"):
        build_verifier("threshold", threshold=0.5, cost_table=CostModel.flat())
    path = tmp_path / "cost.json"
    CostModel.from_points({1: 10.0, 8: 5.0}, host="h", device="cpu").save(path)
    assert isinstance(build_verifier("lagged", cost_table=path, expect_host="h", expect_device="cpu"),
                      LaggedCapacityScheduler)
    with pytest.raises(ValueError, match="profiled for host 'h'"):
        build_verifier("scheduler", cost_table=path, expect_host="other")
    cal = tmp_path / "sts.json"
    STSCalibrator(temperatures=[1.5] * K).save(cal)
    assert build_verifier("scheduler", cost_table=path, calibration=cal, positions=K).calibrator.positions == K
    assert build_verifier("scheduler", cost_table=path, calibration=cal, positions=3).calibrator.positions == K
    with pytest.raises(ValueError, match=f"fitted for {K} draft positions, but {K + 2} are in use"):
        build_verifier("scheduler", cost_table=path, calibration=cal, positions=K + 2)
    with pytest.raises(ValueError, match=f"fitted for {K} draft positions, but {K + 1} are in use"):
        build_verifier("threshold", threshold=0.5, calibration=STSCalibrator.load(cal), positions=K + 1)
