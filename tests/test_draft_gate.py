"""The schedulers' draft gate (verifiers.prefix_scheduler.DraftGate): when speculation does not pay for itself the
next rounds are plain (no draft forward, nothing verified), probing again after a wait that doubles while probes
keep failing; the drafter's own step, profiled into the cost table, is part of the price. Decoding stays exact:
greedy output equals plain decoding, and the slot engine and the eager loop make the same gate decisions (so even
sampled output agrees) because the gate reads only finished rounds.

Shapes: R rows of a forward, K draft positions.
"""
from __future__ import annotations

import warnings

import pytest
import torch

from dspark.engine.decode import generate
from dspark.engine.protocol import Drafter, Proposal, VerifyAll
from dspark.engine.sampling import SamplingConfig
from tests.conftest import random_prompts
from tests.test_decode import K, build_any
from verifiers import build_verifier
from verifiers.cost_model import CostModel, draft_key, profile_draft
from verifiers.prefix_scheduler import DraftGate

T1 = SamplingConfig(temperature=1.0)


class Named:
    """A stand-in drafter for the gate's bookkeeping: a name and no parameters."""

    name = "fake"


def gate_with(draft_ms: float | None, sps: float = 100.0) -> DraftGate:
    cost = CostModel.flat(sps)  # a verify step costs 1/sps whatever its width
    if draft_ms is not None:
        cost.draft[draft_key(Named(), K)] = {"batch_sizes": [1, 64], "seconds": [draft_ms / 1000] * 2}
    gate = DraftGate(cost)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gate.bind(drafter=Named(), K=K)
    return gate


def drafted_rounds(gate: DraftGate, tau_of, rounds: int = 40, rows: int = 4, expected_of=None) -> list[int]:
    """Drive the gate as the engine does; tau_of(round) = tokens each live row commits in a drafted round;
    expected_of(round), when given, the drafts each row's confidences expected to be accepted (what the engines
    tell the gate for a drafter with confidences)."""
    out = []
    for r in range(rounds):
        drafting = gate.draft_next()
        if drafting:
            out.append(r)
        committed = rows * (tau_of(r) if drafting else 1)
        expected = rows * expected_of(r) if drafting and expected_of is not None else None
        gate.after_round(slots=rows, rows=rows, width=K if drafting else 0, drafted=drafting, committed=committed,
                         expected=expected)
    return out


def drafted_rounds_overlapped(gate: DraftGate, tau_of, rounds: int = 40, rows: int = 4) -> list[int]:
    """As drafted_rounds, with the overlapped engine's order: round r + 1 is launched (draft_next) before round r is
    heard (after_round)."""
    out, told = [], None
    for r in range(rounds):
        drafting = gate.draft_next()
        if drafting:
            out.append(r)
        if told is not None:
            gate.after_round(**told)
        told = dict(slots=rows, rows=rows, width=K if drafting else 0, drafted=drafting,
                    committed=rows * (tau_of(r) if drafting else 1))
    return out


def test_the_gate_prices_plain_rows_at_their_own_shape():
    """A compiled small host's shapes: 4 plain rows take 1.29 ms, 1 row of 4 tokens 1.73. A drafted round of 4 rows at
    width 2 (3 tokens a row, 1.72 ms, plus a 0.43 ms draft) committing 5 tokens loses against plain (gain 0.75), but
    priced by SPS(M), where M = 4 is the slower one-row shape, it would look like a gain of 1.01 and the
    gate would keep drafting. Priced by shape it stops after that round."""
    from tests.test_cost_model import shaped_table

    cost = shaped_table({(1, 1): 1.28, (1, 2): 1.61, (1, 4): 1.73, (4, 1): 1.29, (4, 2): 1.65, (4, 4): 1.78})
    cost.draft[draft_key(Named(), K)] = {"batch_sizes": [1, 4], "seconds": [0.43e-3, 0.43e-3]}
    gate = DraftGate(cost)
    gate.bind(drafter=Named(), K=K)
    assert gate.draft_next()
    gate.after_round(slots=4, rows=4, width=2, drafted=True, committed=5)
    plain, spent = 1.29, (1.65 + 1.78) / 2 + 0.43  # (4, 3) between (4, 2) and (4, 4)
    assert gate.gain == pytest.approx(1.25 * plain / spent) and gate.gain < 1 and not gate.draft_next()
    assert 5 / 4 * 1.73 / (1000 / cost(12) + 0.43) > 1  # what the SPS(M) price said


def test_overlapped_a_probe_is_one_round_and_a_paying_drafter_still_drafts_every_round():
    """Launched before a probe's outcome is known, the next round stays plain: a failed probe costs one drafted
    round, not two (before: rounds 0 and 1 drafted, then every failed probe twice); a probe that pays resumes
    drafting from the round after the plain one."""
    failing = drafted_rounds_overlapped(gate_with(0.0), lambda r: 1)
    assert failing[0] == 0 and all(b - a > 1 for a, b in zip(failing, failing[1:]))
    assert failing == [0, 3, 7, 13, 23]  # waits 1, 2, 4, 8 after the round launched before each outcome
    assert drafted_rounds_overlapped(gate_with(1.0), lambda r: 3) == [0] + list(range(2, 40))
    got = drafted_rounds_overlapped(gate_with(0.0), lambda r: 1 if r < 10 else 3)
    assert got[:3] == [0, 3, 7] and got[3:] == [13] + list(range(15, 40))


def test_gate_skips_while_drafts_do_not_pay_and_probes_with_a_doubling_wait():
    assert drafted_rounds(gate_with(0.0), lambda r: 1) == [0, 2, 5, 10, 19, 36]  # waits 1, 2, 4, 8, 16


def test_gate_drafts_every_round_while_it_pays():
    assert drafted_rounds(gate_with(1.0), lambda r: 3) == list(range(40))


def test_the_drafters_own_step_is_part_of_the_price_and_spaces_the_probes():
    # tau 2 doubles the tokens of a 10 ms verify step; a 15 ms draft makes the round cost 25 ms: 0.8x plain. A
    # probe costs 15 ms beyond a plain round: within 1 % of the time means 15 / (0.01 * 10) = 150 plain rounds
    assert drafted_rounds(gate_with(15.0), lambda r: 2, rounds=320) == [0, 151, 302]
    assert drafted_rounds(gate_with(5.0), lambda r: 2) == list(range(40))  # 15 ms for 2 tokens: 1.33x plain
    # the doubling wait takes over once it is the longer one: a 0.45 ms draft is 4.5 (so 5) rounds of budget
    assert drafted_rounds(gate_with(0.45), lambda r: 1, rounds=50) == [0, 6, 12, 18, 27, 44]


def test_a_probe_that_pays_resumes_drafting_every_round():
    got = drafted_rounds(gate_with(0.0), lambda r: 1 if r < 10 else 3)
    assert got[:4] == [0, 2, 5, 10] and got[4:] == list(range(11, 40))


def test_a_streak_is_smoothed_one_bad_round_does_not_stop_it():
    assert drafted_rounds(gate_with(0.0), lambda r: 1 if r == 5 else 3) == list(range(40))


def test_bursty_acceptance_that_pays_on_average_keeps_drafting():
    """A burst of 8 tokens every 12th round and nothing between, with a 1 ms draft on a 10 ms verify: 1.44x plain on
    average, yet 11 rejected rounds in a row. The default memory (smoothing 0.1) drafts every round; a short one
    (0.3) stops after each run of rejections and misses most bursts."""
    bursts = lambda r: 8 if r % 12 == 0 else 1  # noqa: E731
    assert drafted_rounds(gate_with(1.0), bursts, rounds=120) == list(range(120))
    short = gate_with(1.0)
    short.smoothing = 0.3
    assert len(drafted_rounds(short, bursts, rounds=120)) < 40


def test_a_round_that_verified_nothing_for_free_is_no_evidence():
    """A free drafter that proposed nothing (an n-gram drafter without a match: width 0) neither pays nor costs: the
    gate keeps drafting; a drafter with a cost of its own is still judged on such a round (it spent its step)."""
    for draft_ms, expect in ((0.0, [True] * 10), (1.0, [True, False])):
        gate, seen = gate_with(draft_ms), []
        for _ in range(len(expect)):
            seen.append(gate.draft_next())
            gate.after_round(slots=4, rows=4, width=0, drafted=seen[-1], committed=4)
        assert seen == expect


def test_a_missing_or_foreign_draft_cost_warns(tiny_host):
    cost = CostModel.flat(100.0)
    cost.draft["dspark/K4/1"] = {"batch_sizes": [1], "seconds": [0.001]}
    with pytest.warns(UserWarning, match="no draft cost for 'fake/K4/0'.*dspark/K4/1"):
        DraftGate(cost).bind(drafter=Named(), K=K)


class Rejected(Drafter):
    """Proposes K copies of a token the tiny host's greedy choice never is (so nothing is ever accepted), with
    confidences, so the scheduler would verify them."""

    name = "rejected"
    capturable = True

    def __init__(self, token: int) -> None:
        self.token = token

    def propose(self, state, K):
        B = state.seq.shape[0]
        tokens = torch.full((B, K), self.token, dtype=torch.long, device=state.seq.device)
        return Proposal(tokens=tokens, confidence=torch.full((B, K), 0.9, device=state.seq.device))


def gated(draft_ms: float) -> object:
    cost = CostModel.flat(100.0)
    cost.draft[draft_key(Rejected(0), K)] = {"batch_sizes": [1], "seconds": [draft_ms / 1000]}
    return build_verifier("scheduler", cost_table=cost)


def test_gated_decoding_is_exact_and_both_engines_decide_alike(tiny_host):
    prompts = random_prompts([5, 9, 3, 7], tiny_host.vocab_size, seed=11)
    plain = generate(tiny_host, prompts, max_new_tokens=20)
    never = next(t for t in range(tiny_host.vocab_size) if all(t not in out for out in plain.token_ids))
    for sampling in (SamplingConfig(), T1):
        runs = {engine: generate(tiny_host, prompts, drafter=Rejected(never), verifier=gated(1.0), draft_length=K,
                                 max_new_tokens=20, sampling=sampling, engine=engine, seeds=[3, 4, 5, 6])
                for engine in ("eager", "slots")}
        eager, slots = runs["eager"], runs["slots"]
        assert eager.token_ids == slots.token_ids
        halves = [generate(tiny_host, prompts, drafter=Rejected(never), verifier=gated(1.0), draft_length=K,
                           max_new_tokens=20, sampling=sampling, engine=engine, seeds=[3, 4, 5, 6], batch_size=2)
                  for engine in ("eager", "slots")]  # two static batches: the gate carries over, alike
        assert halves[0].token_ids == halves[1].token_ids
        assert halves[0].log.column("proposed").tolist() == halves[1].log.column("proposed").tolist()
        assert eager.log.column("proposed").tolist() == slots.log.column("proposed").tolist()
        if sampling.greedy:
            assert eager.token_ids == plain.token_ids
        proposed = slots.log.column("proposed")
        drafted = slots.engine["drafted_rounds"]
        assert 0 < drafted < slots.rounds // 2  # it stopped drafting, and probed
        assert int((proposed > 0).sum()) <= drafted * len(prompts)
        conf = slots.log.confidences()  # one row per log row: the plain rounds' rows are zeros
        assert conf.shape == (len(proposed), K) and bool((conf[proposed == 0] == 0).all())
        assert bool((conf[proposed > 0] == 0.9).all())


def test_without_the_gate_every_round_drafts(tiny_host):
    prompts = random_prompts([5, 9], tiny_host.vocab_size, seed=11)
    cost = CostModel.flat(100.0)
    out = generate(tiny_host, prompts, drafter=Rejected(0), draft_length=K, max_new_tokens=12,
                   verifier=build_verifier("scheduler", cost_table=cost, draft_gate=False))
    assert out.engine["drafted_rounds"] == out.rounds
    with pytest.raises(ValueError, match="draft_gate"):
        build_verifier("full", draft_gate=False)


@pytest.mark.parametrize("name", ["dspark", "eagle3", "mtp", "small-lm", "ngram"])
def test_profile_draft_times_every_drafter_and_round_trips(tiny_host, tmp_path, name):
    drafter = build_any(name, tiny_host, tmp_path)
    entry = profile_draft(tiny_host, drafter, batch_sizes=[2, 1], draft_length=K, context=8, repeats=2, warmup=1)
    assert entry["batch_sizes"] == [1, 2] and all(s > 0 for s in entry["seconds"])
    cost = CostModel.flat(50.0)
    cost.draft[draft_key(drafter, K)] = entry
    cost.save(tmp_path / "cost.json")
    loaded = CostModel.load(tmp_path / "cost.json")
    assert loaded.draft == cost.draft
    s1, s2 = entry["seconds"]
    assert loaded.draft_seconds(draft_key(drafter, K), 1) == pytest.approx(s1)
    assert loaded.draft_seconds(draft_key(drafter, K), 4) == pytest.approx(s2 * 2)  # proportional past the last
    assert loaded.draft_seconds("other/K4/0", 1) is None


def test_a_bad_draft_entry_is_refused():
    with pytest.raises(ValueError, match="draft cost"):
        CostModel(tokens=[1], sps=[10.0], draft={"x/K1/0": {"batch_sizes": [2, 1], "seconds": [0.1, 0.1]}})
    with pytest.raises(ValueError, match="draft cost"):
        CostModel(tokens=[1], sps=[10.0], draft={"x/K1/0": {"batch_sizes": [1], "seconds": [0.0]}})


def test_draft_key_tells_drafters_of_other_sizes_apart(tiny_host, tmp_path):
    small, other = build_any("dspark", tiny_host, tmp_path), build_any("eagle3", tiny_host, tmp_path)
    assert draft_key(small, 4) != draft_key(small, 5)
    assert draft_key(small, 4).split("/")[2] != "0" and draft_key(other, 4).startswith("eagle3/K4/")


class EveryThird(VerifyAll):
    """Verify-all that drafts only every third round (a fixed, non-anticipating gate)."""

    def begin(self, *, batch_size: int) -> None:
        self.rounds = 0

    def draft_next(self) -> bool:
        return self.rounds % 3 == 0

    def after_round(self, **_) -> None:
        self.rounds += 1


@pytest.mark.parametrize("name", ["dspark", "dflash", "eagle3", "mtp", "small-lm", "ngram"])
def test_every_drafter_survives_plain_rounds(tiny_host, tmp_path, name):
    """Skipped proposes leave every drafter's state right: exact greedy output, and the engines agree at T = 1."""
    drafter = build_any(name, tiny_host, tmp_path)
    prompts = random_prompts([6, 3, 9], tiny_host.vocab_size, seed=4)
    plain = generate(tiny_host, prompts, max_new_tokens=16)
    for sampling in (SamplingConfig(), T1):
        runs = [generate(tiny_host, prompts, drafter=drafter, verifier=EveryThird(), draft_length=K,
                         max_new_tokens=16, sampling=sampling, engine=engine, seeds=[1, 2, 3])
                for engine in ("eager", "slots")]
        assert runs[0].token_ids == runs[1].token_ids
        if sampling.greedy:
            assert runs[0].token_ids == plain.token_ids
        assert runs[1].engine["drafted_rounds"] == -(-runs[1].rounds // 3)


def test_small_lm_keeps_no_stale_draft_keys_across_a_plain_round(tiny_host, tmp_path):
    """A rejected draft's keys sit past the committed end; a later round without a propose commits tokens over
    those positions and must not count the stale keys as theirs."""
    from dspark.engine.protocol import DraftState

    drafter = build_any("small-lm", tiny_host, tmp_path)
    c = 6
    seq = torch.tensor([random_prompts([c], tiny_host.vocab_size, seed=1)[0] + [0] * 20])
    state = DraftState(seq=seq, seq_len=torch.tensor([c]), seeds=torch.zeros(1, dtype=torch.long),
                       rounds=torch.zeros(1, dtype=torch.long), sampling=SamplingConfig())
    drafter.begin(host=tiny_host, batch_size=1, max_len=seq.shape[1])
    drafted = drafter.propose(state, K).tokens  # feeds positions < c, drafts keys at c .. c+K-2
    seq[0, c] = (int(drafted[0, 0]) + 1) % tiny_host.vocab_size  # the host rejects x1: another token at c
    drafter.observe(features=None, start=torch.tensor([c - 1]), n_valid=torch.tensor([1]), state=state)
    state.seq_len += 1
    assert int(drafter.cache.lengths[0]) == c  # position c not fed yet
    seq[0, c + 1] = 5  # a plain round commits the next token: no propose in between
    drafter.observe(features=None, start=torch.tensor([c]), n_valid=torch.tensor([1]), state=state)
    assert int(drafter.cache.lengths[0]) == c  # not c + 1: the key at c is the rejected draft's


def test_a_lucky_probe_with_low_confidences_starts_no_streak():
    """A drafter that usually accepts nothing and, by luck, accepts all its drafts in the round its second probe
    lands on. Judged by its realised counts, that probe restarts a streak of drafted rounds; judged by its
    confidences (0.02 accepted drafts a row expected, after a history in which they matched what was realised:
    the gate's scale is 1), it stays off and probes on schedule. Rounds cost 10 ms, the draft 0.5 ms."""
    def lucky(r):
        return K + 1 if r == 7 else 1
    realised = drafted_rounds(gate_with(0.5), lucky, rounds=60)
    assert realised[:3] == [0, 7, 8]  # the probe at 7 paid: round 8 drafts again
    gate = gate_with(0.5)
    gate.seen_accepted = gate.seen_expected = 100.0  # calibrated so far
    confident = drafted_rounds(gate, lucky, rounds=60, expected_of=lambda r: 0.02)
    assert confident[:3] == [0, 7, 14]  # the lucky probe is priced at its confidences: the next waits its turn


def test_the_confidences_scale_follows_what_was_realised():
    """Overconfident confidences (they expect 3 accepted drafts a row where 1 is accepted, which at a 4 ms draft on
    10 ms rounds pays: 2 tokens a row for 1.4 rounds' time) are corrected by the realised ratio: the drafter keeps
    drafting every round, and the gate's scale approaches 1 / 3. Confidences that expect 3 where none is ever
    accepted stop the drafter within a few rounds."""
    gate = gate_with(4.0)
    assert drafted_rounds(gate, lambda r: 2, rounds=60, expected_of=lambda r: 3.0) == list(range(60))
    assert gate.scale() == pytest.approx(1 / 3, rel=0.02)
    never = drafted_rounds(gate_with(4.0), lambda r: 1, rounds=60, expected_of=lambda r: 3.0)
    assert never[0] == 0 and len([r for r in never if r < 10]) <= 4


def test_without_confidences_the_gate_is_priced_as_before():
    """expected=None (the n-gram, or any drafter without confidences): the smoothed gain is the average of the
    realised per-round gains, as for a gate that has no confidences to use."""
    gate = gate_with(2.0)
    smoothed = None
    for tau in [3, 2, 1, 2, 3, 1]:
        assert gate.draft_next()
        gate.after_round(slots=4, rows=4, width=K, drafted=True, committed=4 * tau)
        gain = tau * 10.0 / 12.0
        smoothed = gain if smoothed is None else 0.1 * gain + 0.9 * smoothed
        assert gate.gain == pytest.approx(smoothed)


class Recording:
    """A gated scheduler that records what each round tells it."""

    def __init__(self, inner) -> None:
        self.inner, self.heard = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def after_round(self, **round_) -> None:
        self.heard.append(round_)
        self.inner.after_round(**round_)


def test_both_engines_tell_the_gate_the_confidences_expectation(tiny_host):
    """The slot engine (the packed output's EXPECTED column) and the eager loop tell the gate the same expected
    accepted drafts for every drafted round: the sum over live rows of sum_{k <= ell} 0.9^k (the Rejected drafter's
    confidences are 0.9), None for plain rounds."""
    prompts = random_prompts([5, 9, 3, 7], tiny_host.vocab_size, seed=11)
    plain = generate(tiny_host, prompts, max_new_tokens=12)
    never = next(t for t in range(tiny_host.vocab_size) if all(t not in out for out in plain.token_ids))
    heard = {}
    for engine in ("eager", "slots"):
        verifier = Recording(gated(1.0))
        out = generate(tiny_host, prompts, drafter=Rejected(never), verifier=verifier, draft_length=K,
                       max_new_tokens=12, engine=engine)
        heard[engine] = verifier.heard
        verified = out.log.column("verified")
        rows = out.log.column("round")
        drafted = [h for h in verifier.heard if h["drafted"]]
        assert drafted and all(h["expected"] is None for h in verifier.heard if not h["drafted"])
        first = drafted[0]  # round 0 drafts for every request: each verifies its ell of K drafts
        want = sum(sum(0.9 ** k for k in range(1, int(v) + 1)) for v in verified[rows == 0].tolist())
        assert first["expected"] == pytest.approx(want, abs=1e-3)
    assert [h["drafted"] for h in heard["eager"]] == [h["drafted"] for h in heard["slots"]]
    for a, b in zip(heard["eager"], heard["slots"]):
        assert (a["expected"] is None) == (b["expected"] is None)
        assert a["expected"] is None or a["expected"] == pytest.approx(b["expected"], abs=1e-3)


def heard_expectations(host, drafter, engine: str, graphs: bool | str | None = None) -> tuple[list, list]:
    """(token ids, the expected accepted drafts told to a recording verify-all verifier each round) of a static
    batch of four prompts, greedy: what the engine's round hands the gate, without a gate deciding anything."""
    verifier = Recording(build_verifier("full"))
    prompts = random_prompts([5, 9, 3, 7], host.vocab_size, seed=11)
    out = generate(host, prompts, drafter=drafter, verifier=verifier, draft_length=K, max_new_tokens=12,
                   engine=engine, graphs=graphs)
    # rounds with a live row: overlapped captured rounds launch one more round before the CPU has seen every
    # request finish, which commits nothing (rows = 0)
    return out.token_ids, [h["expected"] for h in verifier.heard if h["rows"]]


def test_a_real_drafters_confidences_reach_the_gate_alike_from_both_engines(tiny_host, tmp_path, monkeypatch):
    """DSpark's own confidence head (random weights: confidences strictly between 0 and 1) through the slot
    engine's graph-mode round (the packed EXPECTED column, as captured on CUDA: test_engine_cuda has that twin)
    and through the eager loop: the same tokens and the same expectation every round (0 in the last round, whose
    rows have one token of budget left and verify no draft)."""
    from dspark.engine import serve

    monkeypatch.setattr(serve, "OVERLAP_DEVICES", ("cpu",))  # rounds overlapped, as on CUDA
    drafter = build_any("dspark", tiny_host, tmp_path)
    eager_ids, eager = heard_expectations(tiny_host, drafter, "eager")
    fast_ids, fast = heard_expectations(tiny_host, drafter, "slots", graphs="static")
    assert eager_ids == fast_ids and len(eager) == len(fast) > 1
    assert all(e is not None and e > 0 for e in eager[:-1]) and eager[-1] == 0
    assert fast == pytest.approx(eager, abs=1e-3)
