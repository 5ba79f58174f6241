"""The slot engine (dspark.engine) against the eager loop, its oracle: fp32 on the CPU.

Every request's tokens equal those of the eager loop decoding it alone, for every drafter and verifier, with
requests admitted at different rounds (fewer slots than requests, different lengths and budgets) and in different
orders; greedy, and sampled with the same seeds where the verifier decides each request's lengths from that
request alone (the schedulers couple the batch: their lengths, hence the rounds that key draft noise, depend on the
companions; greedy output does not). Also: the static batch is the all-at-once case, requests in flight stay at C
while the queue lasts, the verify forward is as wide as the bucket of the widest verified row, and a round makes
one device-to-host copy when that width is known on the CPU (verify-all of K or of a drafter's declared width,
the lagged scheduler after its first two rounds, and any width read from the device once the runner proposes each
next draft at the end of a round), two in a round whose width is read from the device before its forward (the
first round, and one after an admission).

Shapes: n requests, C slots, K draft positions.
"""
from __future__ import annotations

import functools
import time

import pytest
import torch

import dspark.engine.graphs as graphs
import dspark.engine.serve as serve
from drafters import DRAFTERS
from dspark.engine.decode import generate
from dspark.engine.round import COLUMNS, width_bucket
from dspark.engine.sampling import SamplingConfig
from tests.conftest import random_prompts, with_draft_price
from tests.test_decode import K, build_any, trained_dspark
from verifiers import build_verifier
from verifiers.cost_model import CostModel

GREEDY, T1 = SamplingConfig(), SamplingConfig(temperature=1.0)


@pytest.fixture(autouse=True)
def lookahead_on_the_cpu(monkeypatch):
    """The runners propose each next draft at the end of a round on CUDA only; these tests run that path here."""
    monkeypatch.setattr(graphs, "LOOKAHEAD_DEVICES", ("cuda", "cpu"))


@pytest.fixture(params=["in-order", "overlapped"])
def overlap(request, monkeypatch):
    """The serve loop launches each round before committing the last one on CUDA only (serve.overlap_allowed);
    "overlapped" runs that order here (where it applies: plain decoding and verify-all of a known width)."""
    if request.param == "overlapped":
        monkeypatch.setattr(serve, "OVERLAP_DEVICES", ("cuda", "cpu"))
    return request.param == "overlapped"
LENGTHS = [5, 1, 12, 7, 3, 9]
LIMITS = [10, 4, 14, 6, 12, 3]  # different budgets: slots free at different rounds
SEEDS = [500 + 7 * i for i in range(len(LENGTHS))]
COST = CostModel.from_points({1: 50.0, 16: 45.0, 64: 10.0})


def prompts_of(host):
    """Six prompts; the repeated halves of random_prompts give the n-gram drafter matches."""
    return random_prompts(LENGTHS, host.vocab_size, seed=5)


def verifier_of(name: str):
    if name == "threshold":
        return build_verifier("threshold", threshold=0.3)
    if name in ("scheduler", "lagged"):  # drafting every round: these tests are about the lengths it picks
        return build_verifier(name, cost_table=COST, draft_gate=False)
    return build_verifier(name)


@functools.cache
def drafter_of(name: str, host, tmp_path_factory=None):
    if name == "dspark-trained":
        return trained_dspark(host)
    return build_any(name, host, _tmp())


@functools.cache
def _tmp():
    import tempfile
    from pathlib import Path

    return Path(tempfile.mkdtemp(prefix="engine-test-"))


def solo(host, drafter, verifier, prompt, limit, seed, sampling):
    """The oracle: the eager loop decoding this request alone."""
    out = generate(host, [prompt], drafter=drafter, verifier=verifier, draft_length=K, max_new_tokens=limit,
                   sampling=sampling, seeds=[seed], engine="eager")
    return out.token_ids[0]


def check_against_solo(host, drafter_name, verifier_name, sampling, concurrency, order, graphs=None):
    drafter = None if drafter_name == "none" else drafter_of(drafter_name, host)
    prompts = prompts_of(host)
    ids = [order(list(range(len(prompts))))][0]
    got = generate(host, [prompts[i] for i in ids], drafter=drafter, verifier=verifier_of(verifier_name),
                   draft_length=K, max_new_tokens=[LIMITS[i] for i in ids], sampling=sampling,
                   seeds=[SEEDS[i] for i in ids], concurrency=concurrency, graphs=graphs)
    assert got.batches > 1  # requests were admitted at different rounds
    for j, i in enumerate(ids):
        want = solo(host, drafter, verifier_of(verifier_name), prompts[i], LIMITS[i], SEEDS[i], sampling)
        assert got.token_ids[j] == want, f"{drafter_name}/{verifier_name}: request {i}"
    return got


# graphs "static": the CUDA-graph round runner's own code (static buffers, widths captured mid-run with the slots
# paused, lookahead into the captured draft's buffers, static prefill) with each graph re-run instead of replayed
RUNNERS = pytest.mark.parametrize("graphs", [None, "static"], ids=["eager-rounds", "static-graph-rounds"])


@RUNNERS
@pytest.mark.parametrize("drafter_name",
                         ["none", "dspark-trained", "eagle3-vocab"] + sorted(set(DRAFTERS) - {"dspark"}))
def test_every_drafter_equals_solo_eager(tiny_host, drafter_name, graphs, overlap):
    for sampling in (GREEDY, T1):
        for concurrency, order in ((2, lambda x: x), (3, lambda x: x[::-1])):
            got = check_against_solo(tiny_host, drafter_name, "full", sampling, concurrency, order, graphs)
            # every drafter overlaps under verify-all (n-gram: after reading the draft proposed ahead)
            assert got.engine["overlapped"] == overlap


@RUNNERS
@pytest.mark.parametrize("verifier_name", ["threshold", "scheduler", "lagged"])
def test_every_verifier_equals_solo_eager(tiny_host, verifier_name, graphs, overlap):
    samplings = (GREEDY, T1) if verifier_name == "threshold" else (GREEDY,)
    for sampling in samplings:
        got = check_against_solo(tiny_host, "dspark-trained", verifier_name, sampling, 2, lambda x: x[1:] + x[:1],
                                 graphs)
        assert int(got.log.column("accepted").sum()) > 0  # acceptance was exercised
        assert got.engine["overlapped"] == overlap  # the schedulers' draft gates then lag one more round


def test_static_batch_is_all_requests_admitted_at_once(tiny_host):
    drafter = trained_dspark(tiny_host)
    prompts = prompts_of(tiny_host)
    kwargs = dict(drafter=drafter, draft_length=K, max_new_tokens=LIMITS, seeds=SEEDS, sampling=T1)
    static = generate(tiny_host, prompts, **kwargs)
    eager = generate(tiny_host, prompts, engine="eager", **kwargs)
    assert static.token_ids == eager.token_ids and static.batches == 1 and static.rounds == eager.rounds
    assert static.log.column("accepted").tolist() == eager.log.column("accepted").tolist()


def test_in_flight_stays_at_concurrency_until_the_queue_runs_dry(tiny_host):
    prompts = random_prompts([4] * 12, tiny_host.vocab_size, seed=2)
    out = generate(tiny_host, prompts, max_new_tokens=[3 + i % 4 for i in range(12)], concurrency=4)
    in_flight = out.engine["in_flight"]
    # after the last admission the queue is dry; before it every round ran with all 4 slots busy
    rounds_to_last_admission = len(in_flight) - next(i for i, c in enumerate(reversed(in_flight)) if c == 4)
    assert all(c == 4 for c in in_flight[:rounds_to_last_admission])
    assert out.batches > 1 and len(out.ttft) == 12 and all(t > 0 for t in out.ttft)


@pytest.mark.parametrize("drafter_name, verifier_name, width_reads_of", [
    ("dspark-trained", "full", lambda rounds: 0),  # verify-all of K drafts: the width is K, known on the CPU
    ("mtp", "full", lambda rounds: 0),  # MTP-1 declares width 1
    # lookup lengths live on the device: the first round reads the longest before its forward; every later round
    # verifies the draft proposed at the end of the round before, whose longest length rode in that round's copy
    ("ngram", "full", lambda rounds: 1),
    ("dspark-trained", "threshold", lambda rounds: 1),
    ("dspark-trained", "scheduler", lambda rounds: 1),  # its widths too (a CostModel's lengths are capturable)
    # its capacity is decided a round ahead and rides in the round's copy; the first two rounds have no history
    ("dspark-trained", "lagged", lambda rounds: 2),
], ids=["full-K", "full-mtp", "full-ngram", "threshold", "scheduler", "lagged"])
@RUNNERS
def test_device_to_host_copies_per_round(tiny_host, monkeypatch, drafter_name, verifier_name, width_reads_of, graphs,
                                        overlap):
    copies = []
    real = torch.Tensor.cpu

    def counting(self, *args, **kwargs):
        copies.append(tuple(self.shape))
        return real(self, *args, **kwargs)

    prompts = prompts_of(tiny_host)
    drafter = drafter_of(drafter_name, tiny_host)
    kwargs = dict(drafter=drafter, draft_length=K, max_new_tokens=8, graphs=graphs)
    generate(tiny_host, prompts[:3], verifier=verifier_of(verifier_name), **kwargs)  # warm lazy inits
    monkeypatch.setattr(torch.Tensor, "cpu", counting)
    round_copy = serve.HostCopy.__init__  # the round's copy (a non-blocking copy_ on CUDA, not .cpu())
    monkeypatch.setattr(serve.HostCopy, "__init__", lambda self, packed: (copies.append(tuple(packed.shape)),
                                                                           round_copy(self, packed))[1])
    out = generate(tiny_host, prompts[:3], verifier=verifier_of(verifier_name), **kwargs)
    monkeypatch.undo()
    round_copies = [c for c in copies if c == (3, K + 1 + COLUMNS)]
    width_reads = [c for c in copies if c == ()]
    assert len(round_copies) == out.rounds > 2 and len(width_reads) == width_reads_of(out.rounds)
    # the rest: the admission's first tokens (one) and the confidences of the log, read once at the end
    assert len(copies) - len(round_copies) - len(width_reads) <= 2


@RUNNERS
def test_continuous_batching_reads_a_width_only_after_admissions(tiny_host, monkeypatch, graphs, overlap):
    """With requests arriving as others stop, a device-side width (n-gram lengths) is read before the forward only
    in a round after an admission (the first round included); the tokens are still the eager loop's."""
    drafter, prompts = drafter_of("ngram", tiny_host), prompts_of(tiny_host)
    reads = []
    real = torch.Tensor.cpu
    monkeypatch.setattr(torch.Tensor, "cpu", lambda self, *a, **kw: (reads.append(self.dim() == 0), real(self))[1])
    got = generate(tiny_host, prompts, drafter=drafter, draft_length=K, max_new_tokens=LIMITS, seeds=SEEDS,
                   concurrency=2, graphs=graphs)
    monkeypatch.undo()
    assert got.rounds > got.engine["admissions"] > 2 and sum(reads) == got.engine["admissions"]
    for i, p in enumerate(prompts):
        assert got.token_ids[i] == solo(tiny_host, drafter, verifier_of("full"), p, LIMITS[i], SEEDS[i], GREEDY)


def test_width_buckets():
    assert [width_bucket(L, 4) for L in range(5)] == [0, 1, 2, 3, 4]  # every width up to 8
    assert [width_bucket(L, 7) for L in range(8)] == list(range(8))
    assert [width_bucket(L, 20) for L in (7, 8, 12, 15, 16, 20)] == [7, 15, 15, 15, 20, 20]  # then 16, K + 1


@pytest.mark.parametrize("drafter_name, verifier_name", [("mtp", "full"), ("ngram", "full"),
                                                         ("dspark-trained", "scheduler"),
                                                         ("dspark-trained", "lagged")])
def test_verify_forward_is_as_wide_as_the_widest_verified_row(tiny_host, monkeypatch, drafter_name, verifier_name):
    """Per round, the host's verify forward runs bucket(max ell) + 1 tokens per slot, not K + 1."""
    widths = []
    step = tiny_host.step
    monkeypatch.setattr(tiny_host, "step", lambda cache, tokens, *a, **kw: (widths.append(tokens.shape[1]),
                                                                            step(cache, tokens, *a, **kw))[1])
    drafter = drafter_of(drafter_name, tiny_host)
    prompts = prompts_of(tiny_host)
    out = generate(tiny_host, prompts, drafter=drafter, verifier=verifier_of(verifier_name), draft_length=K,
                   max_new_tokens=LIMITS)  # one static batch: one prefill, then the rounds
    verified = [int(v.max()) for v in out.log.per_round("verified")]
    assert widths[1:] == out.engine["widths"] == [width_bucket(v, K) + 1 for v in verified]
    assert min(widths[1:]) < K + 1  # the case in point: narrower than K + 1
    want = [solo(tiny_host, drafter, verifier_of(verifier_name), p, n, 0, GREEDY) for p, n in zip(prompts, LIMITS)]
    assert out.token_ids == want


def test_bad_concurrency_is_refused(tiny_host):
    with pytest.raises(ValueError, match="concurrency"):
        generate(tiny_host, [[1, 2]], concurrency=0)
    with pytest.raises(ValueError, match="engine"):
        generate(tiny_host, [[1, 2]], engine="fast")


def test_device_ngram_lookup_equals_the_python_rule():
    from dspark.engine.protocol import DraftState
    from drafters.ngram import NgramDrafter

    g = torch.Generator().manual_seed(3)
    for max_n, min_n in ((3, 1), (4, 2), (1, 1)):
        drafter = NgramDrafter(max_ngram=max_n, min_ngram=min_n)
        seq = torch.randint(0, 5, (40, 30), generator=g)  # a small vocabulary: many matches of every length
        length = torch.randint(1, 31, (40,), generator=g)
        state = DraftState(seq=seq, seq_len=length, seeds=torch.zeros(40, dtype=torch.long),
                           rounds=torch.zeros(40, dtype=torch.long), sampling=GREEDY)
        for K in (1, 4, 7):
            got = drafter.propose(state, K)
            for b in range(40):
                want = drafter._lookup(seq[b, : int(length[b])].tolist(), K)
                n = int(got.lengths[b])
                assert got.tokens[b, :n].tolist() == want and n == len(want)
                assert got.tokens[b, n:].eq(0).all()


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_fused_host_layers_equal_the_module_path(kind):
    """The CUDA step's fused layers (one q|k|v and one gate|up projection, rotary over q and k together and
    rolled, one-call norms, residuals added in the GEMMs) compute what the host's own modules compute; run here on
    the CPU with fused=True, in float32 and (to the rounding of one bfloat16 step) in bfloat16."""
    from dspark.engine.host import Host
    from tests.conftest import tiny_model

    tiny_host = Host(tiny_model(kind), name=kind)
    tokens = torch.tensor(random_prompts([9, 9], tiny_host.vocab_size, seed=4))
    outs = []
    for fused in (False, True):
        cache = tiny_host.new_cache(2, 32)
        out = tiny_host.step(cache, tokens, torch.tensor([9, 6]), taps=(1, 2), fused=fused)
        outs.append((out, cache.k.clone()))
    (ref, ref_k), (got, got_k) = outs
    torch.testing.assert_close(got.hidden, ref.hidden, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.features, ref.features, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_k, ref_k, rtol=1e-5, atol=1e-5)
    # bfloat16: the fused kernels round once where the modules round twice (norm times weight, residual plus GEMM)
    half = Host(tiny_model(kind).to(torch.bfloat16), name=kind)
    steps = []
    for fused in (False, True):
        cache = half.new_cache(2, 32)
        steps.append(half.step(cache, tokens, torch.tensor([9, 6]), fused=fused).hidden.float())
    torch.testing.assert_close(steps[1], steps[0], rtol=0.05, atol=0.05)


def test_api_generate_takes_a_concurrency(tiny_host):
    import dspark

    prompts = prompts_of(tiny_host)
    static = dspark.generate(tiny_host, "ngram", prompts, max_new_tokens=6)
    continuous = dspark.generate(tiny_host, "ngram", prompts, max_new_tokens=6, concurrency=2)
    assert continuous.texts == static.texts and continuous.result.batches > 1


def test_a_round_output_overwritten_before_it_is_read_is_an_error(tiny_host, monkeypatch):
    """The CPU checks each live slot's committed length against the device's (SEQ_LEN): a packed output that
    something overwrote between accept and the copy (as a graph replayed in between could) fails loudly instead of
    committing other tokens than the device did and running a slot past its end."""
    from dspark.engine.round import N_ACCEPTED

    inner = graphs.GraphRound.__call__

    def overwritten(self, *args, **kwargs):
        out, draft, L = inner(self, *args, **kwargs)
        out[:, self.K + 1 + N_ACCEPTED] = out[:, self.K + 1 + N_ACCEPTED] + 1
        return out, draft, L

    monkeypatch.setattr(graphs.GraphRound, "__call__", overwritten)
    with pytest.raises(RuntimeError, match="overwritten before it was read"):
        generate(tiny_host, prompts_of(tiny_host), drafter=drafter_of("ngram", tiny_host), draft_length=K,
                 max_new_tokens=8, concurrency=2, graphs="static")


def test_a_slot_with_its_budget_spent_commits_nothing_on_the_device(tiny_host):
    """Before the CPU retires it, a slot whose device budget is spent commits no token (no run past its rows)."""
    from dspark.engine.graphs import EagerRound
    from dspark.engine.slots import Request, Slots
    from verifiers import build_verifier

    drafter, verifier = drafter_of("ngram", tiny_host), build_verifier("full")
    verifier.bind(drafter=drafter, K=K)
    slots = Slots(tiny_host, drafter, verifier, capacity=2, max_len=40, sampling=GREEDY)
    prompts = prompts_of(tiny_host)
    slots.admit([0, 1], [Request(index=i, prompt=prompts[i], limit=10, seed=i) for i in (0, 1)])
    slots.remaining[0] = 0
    before = slots.state.seq_len.clone()
    out, _, _ = EagerRound(slots, tiny_host, drafter, verifier, K)()
    grew = slots.state.seq_len - before
    assert grew[0] == 0 and grew[1] >= 1
    assert out[0, K + 1] == 0 and out[1, K + 1] == grew[1] - 1  # N_ACCEPTED


@pytest.mark.parametrize("drafter_name", ["none", "dspark-trained", "ngram"])  # ngram: launched after the copy
def test_overlapped_rounds_stop_and_refill_slots_as_the_in_order_loop(tiny_host, monkeypatch, drafter_name):
    """Launching each round before the last one is committed: requests that stop on a stop token or by a callback
    (one round late for the device: that round's rows are nobody's) and the requests admitted into their slots get
    the in-order loop's tokens and finish reasons, and the run did overlap."""
    drafter = None if drafter_name == "none" else drafter_of(drafter_name, tiny_host)
    prompts = prompts_of(tiny_host)
    kwargs = dict(drafter=drafter, draft_length=K, max_new_tokens=LIMITS, seeds=SEEDS, concurrency=2)
    free = generate(tiny_host, prompts, stop_token_ids=[], **kwargs)
    stop = max(set(sum(free.token_ids, [])), key=lambda t: sum(ids.count(t) for ids in free.token_ids))

    def run(overlapped: bool):
        seen = {}

        def callback(i, ids):  # request 3 stops by callback after its fourth token
            seen[i] = seen.get(i, 0) + len(ids)
            return i == 3 and seen[i] >= 4

        with monkeypatch.context() as m:
            m.setattr(serve, "OVERLAP_DEVICES", ("cuda", "cpu") if overlapped else ())
            return generate(tiny_host, prompts, stop_token_ids=[stop], on_tokens=callback, **kwargs)

    in_order, overlapped = run(False), run(True)
    assert overlapped.engine["overlapped"] and not in_order.engine["overlapped"]
    assert overlapped.token_ids == in_order.token_ids and overlapped.finish_reasons == in_order.finish_reasons
    assert "stop" in in_order.finish_reasons and "length" in in_order.finish_reasons
    assert overlapped.batches > 2  # slots were refilled


@RUNNERS
@pytest.mark.parametrize("verifier_name", ["scheduler", "lagged"])
def test_gated_schedulers_keep_the_greedy_tokens_overlapped(tiny_host, monkeypatch, verifier_name, graphs):
    """With their draft gates on (plain rounds while drafting does not pay), overlapped: the gate learns of each
    round one round later, which changes which rounds draft but never a token (greedy). A plain round is launched
    without waiting for the last round's copy, and the draft a round proposed ahead is dropped when the next round
    is plain (the scheduler's lookahead)."""
    monkeypatch.setattr(serve, "OVERLAP_DEVICES", ("cuda", "cpu"))
    drafter, prompts = drafter_of("dspark-trained", tiny_host), prompts_of(tiny_host)
    cost = with_draft_price(CostModel.from_points({1: 50.0, 4: 48.0, 64: 10.0}), drafter, K, 1e-4)
    verifier = build_verifier(verifier_name, cost_table=cost)
    got = generate(tiny_host, prompts, drafter=drafter, verifier=verifier, draft_length=K, max_new_tokens=LIMITS,
                   seeds=SEEDS, concurrency=2, graphs=graphs)
    assert got.engine["overlapped"] and 0 < got.engine["drafted_rounds"] < got.rounds  # the gate skipped some
    for i, p in enumerate(prompts):
        assert got.token_ids[i] == solo(tiny_host, drafter, build_verifier("full"), p, LIMITS[i], SEEDS[i], GREEDY)


@RUNNERS
@pytest.mark.parametrize("drafter_name", ["ngram", "dspark-trained"])
def test_a_draft_proposed_ahead_is_dropped_before_a_plain_round(tiny_host, drafter_name, graphs):
    """A gate that drafts every third round (EveryThird): each drafted round proposes the next draft at its end
    (lookahead), the plain round after it drops that draft, and the next drafted round proposes afresh: the eager
    loop's tokens, greedy and sampled (rounds in order)."""
    from tests.test_draft_gate import EveryThird

    drafter, prompts = drafter_of(drafter_name, tiny_host), prompts_of(tiny_host)
    for sampling in (GREEDY, T1):
        runs = [generate(tiny_host, prompts, drafter=drafter, verifier=EveryThird(), draft_length=K,
                         max_new_tokens=LIMITS, sampling=sampling, seeds=SEEDS, engine=engine, graphs=g)
                for engine, g in (("eager", None), ("slots", graphs))]
        assert runs[0].token_ids == runs[1].token_ids
        assert 0 < runs[1].engine["drafted_rounds"] < runs[1].rounds


def drafter_context(drafter, slots) -> list[torch.Tensor]:
    """What a drafter holds of each live slot's context when it proposes: DSpark's cached context keys; EAGLE-3's
    keys of the committed positions before the anchor and its layer output at the last observed one."""
    out = []
    for s in slots.active.nonzero().flatten().tolist():  # an idle slot's state waits for its next admission
        if drafter.name == "eagle3":
            n = int(slots.state.seq_len[s]) - 1
            out += [drafter.cache.k[:, s, :, :n].clone(), drafter.last_hidden[s].clone()]
        else:
            out.append(drafter.cache.k[:, s, :, : int(drafter.cache.lengths[s])].clone())
    return out


@RUNNERS
@pytest.mark.parametrize("widths", [1, 3], ids=["backlog-1-width", "backlog-3-widths"])
@pytest.mark.parametrize("name", ["dspark-trained", "eagle3"])
def test_a_gated_drafter_observes_its_plain_rounds_later_as_it_would_have(tiny_host, monkeypatch, graphs, overlap,
                                                                           name, widths):
    """Under a draft gate, the plain rounds of DSpark and EAGLE-3 (Drafter.observe_batched) keep their features and
    the drafter observes them before the next drafted round (graphs.defers_observe), and when the backlog is full
    (one or three verify widths here; a flush observes all of its widths in one call, round.flush_observe):
    every round drafts and accepts what it does with an observe per round, the drafter holds the same context at
    every propose, and the tokens are the same."""
    import dspark.engine.graphs as runners

    monkeypatch.setattr(runners, "backlog_rounds", lambda K: widths * (K + 1))
    flushed, spans = [], []  # whether each flush came before a drafted round; the verify widths each observed
    due, take = runners.Backlog.due, runners.Backlog.take

    def recorded(self, drafting):
        if due(self, drafting):
            flushed.append(drafting)
            return True
        return False

    def counted(self):
        spans.append(take(self))
        return spans[-1]
    monkeypatch.setattr(runners.Backlog, "due", recorded)
    monkeypatch.setattr(runners.Backlog, "take", counted)
    drafter, prompts = drafter_of(name, tiny_host), prompts_of(tiny_host)
    assert drafter.observe_batched
    cost = with_draft_price(CostModel.from_points({1: 50.0, 4: 48.0, 64: 10.0}), drafter, K, 1e-4)
    runs, contexts = {}, {}
    for defer in (True, False):
        seen = contexts[defer] = []  # what the drafter holds when it proposes

        def holding(slots, *args, seen=seen, propose=runners.propose):
            seen.extend(drafter_context(drafter, slots))
            return propose(slots, *args)
        with pytest.MonkeyPatch.context() as m:
            m.setattr(runners, "propose", holding)
            if not defer:
                m.setattr(runners, "defers_observe", lambda *a: False)
            runs[defer] = generate(tiny_host, prompts, drafter=drafter, draft_length=K, max_new_tokens=LIMITS,
                                   verifier=build_verifier("scheduler", cost_table=cost), seeds=SEEDS, concurrency=2,
                                   graphs=graphs)
    deferred, each = runs[True], runs[False]
    assert 0 < deferred.engine["drafted_rounds"] < deferred.rounds
    assert deferred.token_ids == each.token_ids
    for column in ("accepted", "verified", "proposed"):
        assert deferred.log.column(column).tolist() == each.log.column(column).tolist(), column
    assert len(contexts[True]) == len(contexts[False]) > 0
    for got, want in zip(contexts[True], contexts[False]):  # EAGLE-3's layer output: attention over more rows
        assert got.shape == want.shape and torch.allclose(got, want, atol=1e-5)
    assert True in flushed  # before drafted rounds
    if widths == 1:
        assert False in flushed  # and a full backlog mid plain run
    else:
        assert max(spans) > 1  # one observe over several verify widths


@pytest.mark.parametrize("name", ["dspark", "eagle3"])
def test_a_backlog_observe_reaching_past_the_drafter_cache_keeps_its_committed_positions(tiny_host, name):
    """A flush observes several verify widths in one call (round.flush_observe), so a row whose backlog is short
    (admitted mid-backlog, or idle) pads past its length by up to the whole window, which may reach past the
    drafter's cache: those padding positions are clamped to its last one (Drafter.observe_batched), never an error
    and never a committed position, and the row's length is start + n_valid."""
    from dspark.engine.protocol import DraftState

    drafter = build_any(name, tiny_host, None)
    B, max_len, taps = 2, 16, drafter.feature_layers
    drafter.begin(host=tiny_host, batch_size=B, max_len=max_len)
    cap = drafter.cache.max_len
    F = len(taps) * tiny_host.hidden_size
    seq = torch.randint(0, tiny_host.vocab_size, (B, cap + 1))
    state = DraftState(seq=seq, seq_len=torch.full((B,), cap - 2), seeds=torch.zeros(B, dtype=torch.long),
                       rounds=torch.zeros(B, dtype=torch.long), sampling=SamplingConfig())
    torch.manual_seed(1)
    committed = cap - 3  # one position short of the cache's end but two
    drafter.observe(features=torch.randn(B, committed, F), start=torch.zeros(B, dtype=torch.long),
                    n_valid=torch.full((B,), committed), state=state)
    before = drafter.cache.k[:, :, :, :committed].clone()
    width = 12  # e.g. three verify widths of K + 1 = 4: far past the cache's end
    drafter.observe(features=torch.randn(B, width, F), start=torch.full((B,), committed),
                    n_valid=torch.tensor([0, 1]), state=state)
    assert torch.equal(drafter.cache.k[:, :, :, :committed], before)
    if name == "dspark":  # its cache's lengths follow observe (EAGLE-3 masks by position)
        assert drafter.cache.lengths.tolist() == [committed, committed + 1]


def test_generate_takes_overlap(tiny_host):
    """generate(overlap=...): None overlaps on CUDA only, False never, True on any device (same tokens); the
    eager reference loop has no rounds to overlap."""
    prompts = prompts_of(tiny_host)
    kw = dict(drafter=drafter_of("ngram", tiny_host), draft_length=K, max_new_tokens=LIMITS, seeds=SEEDS,
              concurrency=2)
    runs = {o: generate(tiny_host, prompts, overlap=o, **kw) for o in (None, False, True)}
    assert [runs[o].engine["overlapped"] for o in (None, False, True)] == [False, False, True]
    assert runs[True].token_ids == runs[False].token_ids == runs[None].token_ids
    with pytest.raises(ValueError, match="overlap"):
        generate(tiny_host, prompts, overlap=True, engine="eager")


def test_stage_timer_leaves_out_rounds_that_captured(monkeypatch):
    """A round that captured a graph (its warm-up and capture run inside it) is dropped from the stage sums, and the
    sums cover the rounds timed (StageTimer.rounds), so a capture never shows as a stage's time."""
    from dspark.engine.graphs import StageTimer

    clock = iter(range(1000))

    class FakeEvent:  # elapsed_time in ms, as CUDA events give it; each record is one ms after the last
        def __init__(self, enable_timing):
            self.t = None

        def record(self):
            self.t = next(clock)

        def elapsed_time(self, other):
            return other.t - self.t

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    timer = StageTimer(True)
    for captured in (False, True, False):
        timer.mark(start=True)
        if captured:
            timer.discard()
        for _ in StageTimer.STAGES:
            timer.mark()
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    assert timer.rounds == 2
    assert timer.seconds() == {"draft": 0.004, "verify": 0.002, "accept": 0.002}  # lookahead counts as draft


def test_device_work_queued_before_a_capture_counts_as_run_time_not_warm_up(tiny_host, monkeypatch):
    """Device work queued before a capture (here: the admission's prefill, still running when the first round
    captures its widths) is the run's: the warm-up clock starts after it is done, so the run's seconds keep it and
    warmup_s (left out of them) does not. On a GPU a capture's synchronize otherwise waits for that work inside the
    warm-up window: plain decoding's prefill would vanish from its time, and settings whose first round reads the
    device before capturing (the n-gram drafter, the schedulers) would look slower by it (most at a high C).

    The device is simulated on the static runner: an admission leaves QUEUED seconds of work queued, and the first
    synchronize waits them out."""
    from dspark.engine.slots import Slots

    QUEUED = 0.5  # seconds: far above the tiny host's own warm-up (milliseconds)
    queue = {"s": 0.0}
    admit = Slots.admit

    def admit_leaving_work(self, *args, **kwargs):
        out = admit(self, *args, **kwargs)
        queue["s"] = QUEUED
        return out

    def synchronize(self):
        time.sleep(queue["s"])
        queue["s"] = 0.0

    monkeypatch.setattr(Slots, "admit", admit_leaving_work)
    monkeypatch.setattr(graphs.GraphRound, "_synchronize", synchronize)
    for drafter in (None, drafter_of("ngram", tiny_host)):
        out = generate(tiny_host, prompts_of(tiny_host)[:2], drafter=drafter, draft_length=K, max_new_tokens=4,
                       concurrency=2, graphs="static")
        assert out.engine["warmup_s"] < QUEUED <= out.seconds


@pytest.mark.parametrize("freeze", [True, False])
def test_the_loop_freezes_what_lived_before_it_and_counts_its_garbage_collections(tiny_host, monkeypatch, freeze):
    """serve.quiet_gc: inside the loop the objects alive at its start are frozen (FREEZE_GC) and released after;
    a collection that runs inside is counted and timed in the engine's stats; the tokens do not change."""
    import gc

    monkeypatch.setattr(serve, "FREEZE_GC", freeze)
    prompts = prompts_of(tiny_host)
    seen: list[int] = []

    def callback(i, ids):
        seen.append(gc.get_freeze_count())
        if len(seen) <= 2:  # a full collection inside the loop, as a threshold would trigger (two: unfrozen, each
            gc.collect()  # scans every object of the test process)
        return False

    assert gc.get_freeze_count() == 0
    out = generate(tiny_host, prompts, max_new_tokens=4, concurrency=2, on_tokens=callback)
    assert gc.get_freeze_count() == 0  # released
    assert seen and (min(seen) > 0 if freeze else max(seen) == 0)
    assert out.engine["gc_collections"][2] >= 2 and out.engine["gc_s"] > 0
    assert out.token_ids == generate(tiny_host, prompts, max_new_tokens=4, concurrency=2).token_ids


def test_the_loop_leaves_a_callers_frozen_objects_frozen(tiny_host, monkeypatch):
    """Where the caller froze objects before (gc.freeze), the loop neither freezes more nor unfreezes theirs. why
    the calls are watched rather than gc.get_freeze_count() compared: a frozen object can still be freed (its last
    reference dropped, e.g. a cache entry replaced), which lowers the count (by 4 once in a full CI run)."""
    import gc

    gc.freeze()
    try:
        calls = []
        monkeypatch.setattr(gc, "freeze", lambda: calls.append("freeze"))
        monkeypatch.setattr(gc, "unfreeze", lambda: calls.append("unfreeze"))
        generate(tiny_host, prompts_of(tiny_host), max_new_tokens=3, concurrency=2)
        assert calls == [] and gc.get_freeze_count() > 0
    finally:
        monkeypatch.undo()
        gc.unfreeze()
