"""The decode loop (dspark.engine.decode.generate), end to end on tiny seeded hosts, fp32 on the CPU.

Greedy speculative output equals plain greedy output token for token (every batch size, every registered drafter);
at T = 1 and under top-p the speculative sampler reproduces the host's distributions for full and partial
verification lengths (chi-square on the micro host); a request's tokens do not depend on its batch companions;
per-request lengths and stop tokens are honoured.

Shapes: B requests, K draft positions, V vocabulary, n seeds of a statistical test.
"""
from __future__ import annotations

import dataclasses

import functools
import warnings

import pytest
import torch
from scipy.stats import chisquare

from drafters import DRAFTERS, build_drafter
from drafters.base import TrainBatch
from drafters.dspark import DSparkConfig, DSparkDrafter
from drafters.ngram import NgramDrafter
from dspark.engine import reference
from dspark.engine.decode import generate
from dspark.engine.host import Host
from dspark.engine.protocol import Drafter, Proposal, Verifier, VerifyAll
from dspark.engine.sampling import SamplingConfig, process
from tests.conftest import random_prompts, tiny_model

K = 4  # draft length of the tiny-host tests
NEW = 24  # new tokens per request
LENGTHS = [3, 11, 6, 8, 1, 15, 4, 9]  # prompt lengths of the batch of 8 (all different)
GREEDY = SamplingConfig()
T1 = SamplingConfig(temperature=1.0)
TOP_P = SamplingConfig(temperature=1.0, top_p=0.8)
ALPHA = 1e-4  # per chi-square test; a test makes at most 3, so a correct sampler fails one with prob < 1e-3


# ---- shared helpers --------------------------------------------------------------------------------------------

def batch8(host: Host) -> list[list[int]]:
    """Eight prompts of different lengths; repeated halves give the n-gram drafter matches."""
    return random_prompts(LENGTHS, host.vocab_size, seed=11)


@functools.cache
def greedy_reference(host: Host, prompt: tuple[int, ...], n: int, stops: frozenset[int] = frozenset()) -> list[int]:
    """The oracle (full forward per token, no cache), memoised across tests."""
    return reference.greedy(host.model, list(prompt), n, stop_token_ids=set(stops))


@functools.cache
def trained_dspark(host: Host) -> DSparkDrafter:
    """A small DSpark drafter fitted for 20 steps to the host's own greedy continuations of batch8(host).

    why: an untrained drafter's drafts are essentially never accepted under greedy decoding, so acceptance,
    partial acceptance and cuts inside an accepted block would go untested.
    """
    torch.manual_seed(0)
    drafter = DSparkDrafter(host, DSparkConfig(num_layers=2, rank=16, block_size=K, feature_layers=(0, 1, 2)))
    prompts = batch8(host)
    rows = [p + o for p, o in zip(prompts, generate(host, prompts, max_new_tokens=NEW).token_ids)]
    T = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), T, dtype=torch.long)  # (B, T)
    mask = torch.zeros(len(rows), T, dtype=torch.long)
    doc = torch.zeros(len(rows), T, dtype=torch.long)
    for b, (p, r) in enumerate(zip(prompts, rows)):
        ids[b, : len(r)] = torch.tensor(r)
        mask[b, len(p): len(r)] = 1
        doc[b, len(r):] = 1  # padding is its own document
    out = host.forward(ids, document_ids=doc, taps=drafter.feature_layers)
    batch = TrainBatch(input_ids=ids, loss_mask=mask, document_ids=doc, features=out.features,
                       host_logits=host.logits(out.hidden), generator=torch.Generator())
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    for _ in range(20):
        batch.generator.manual_seed(0)
        loss = drafter.training_loss(batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return drafter.eval()


def make_drafter(name: str, host: Host) -> Drafter:
    return NgramDrafter() if name == "ngram" else trained_dspark(host)


def accepted(result) -> int:
    return int(result.log.column("accepted").sum())


def chi2_pvalue(observed: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square goodness of fit of counts (C,) to cell probabilities (C,); rare cells (expected < 5) pooled.

    Cells of probability 0 must be empty (asserted), and take no part in the statistic.
    """
    observed, probs = observed.double().flatten(), probs.double().flatten()
    n = float(observed.sum())
    impossible = probs <= 0
    assert float(observed[impossible].sum()) == 0, "tokens of probability 0 were generated"
    expected = probs / probs.sum() * n
    rare = (expected < 5) & ~impossible
    keep = (expected >= 5)
    f_obs, f_exp = observed[keep], expected[keep]
    if bool(rare.any()):
        f_obs = torch.cat([f_obs, observed[rare].sum(0, keepdim=True)])
        f_exp = torch.cat([f_exp, expected[rare].sum(0, keepdim=True)])
    return float(chisquare(f_obs.numpy(), f_exp.numpy()).pvalue)


# ---- greedy: speculative == plain, token for token -------------------------------------------------------------

@pytest.mark.parametrize("B,batch_size", [(1, None), (3, None), (8, None), (8, 3)])
def test_greedy_speculative_equals_plain_greedy(tiny_host, B, batch_size):
    prompts = batch8(tiny_host)[:B]
    want = [greedy_reference(tiny_host, tuple(p), NEW) for p in prompts]
    spec = generate(tiny_host, prompts, drafter=NgramDrafter(), verifier=VerifyAll(), draft_length=K,
                    max_new_tokens=NEW, batch_size=batch_size)
    assert spec.token_ids == want
    assert spec.finish_reasons == ["length"] * B
    assert accepted(spec) > 0  # drafts were accepted, so the comparison exercises acceptance
    plain = generate(tiny_host, prompts, max_new_tokens=NEW, batch_size=batch_size)
    assert plain.token_ids == want and plain.stats["tau"] == 1.0


SMOLLM2_TEXTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "Once upon a time, in a land far away, there lived a",
    "1, 2, 3, 4, 5, 6, 7, 8,",
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog again and",
    "Q: What is the boiling point of water at sea level?\nA:",
    "Water boils at",
    "Hello",
]


@pytest.fixture(scope="module")
def smollm2_prompts(smollm2_host):
    return [smollm2_host.tokenizer.encode(t) for t in SMOLLM2_TEXTS]


@pytest.mark.slow
@pytest.mark.parametrize("B", [1, 3, 8])
def test_greedy_speculative_equals_plain_greedy_smollm2(smollm2_host, smollm2_prompts, B):
    host, n = smollm2_host, 24
    prompts = smollm2_prompts[:B] if B != 3 else smollm2_prompts[3:6]
    assert len({len(p) for p in prompts}) == B  # different lengths
    stops = frozenset(host.stop_token_ids)
    want = [greedy_reference(host, tuple(p), n, stops) for p in prompts]
    spec = generate(host, prompts, drafter=NgramDrafter(), verifier=VerifyAll(), draft_length=5, max_new_tokens=n)
    assert spec.token_ids == want
    assert accepted(spec) > 0
    assert generate(host, prompts, max_new_tokens=n).token_ids == want


# ---- every registered drafter is greedy-exact ------------------------------------------------------------------

def build_any(name: str, host: Host, tmp_path, **extra) -> Drafter:
    """Each registered drafter through build_drafter, small and untrained (small-lm: a saved 1-layer LM), and
    "eagle3-vocab", EAGLE-3 with a draft vocabulary; `extra` adds to the drafter's settings."""
    torch.manual_seed(0)
    if name == "small-lm":
        tiny_model("llama", layers=1, seed=3).save_pretrained(tmp_path / "small")
        return build_drafter(name, host, checkpoint=tmp_path / "small")
    if name == "eagle3-vocab":  # EAGLE-3 drafting over half the host's vocabulary (every other token id)
        drafter = build_any("eagle3", host, tmp_path, draft_vocab=host.vocab_size // 2)
        drafter.set_draft_vocab(torch.arange(1, host.vocab_size, 2)[: host.vocab_size // 2])
        return drafter
    overrides = {"dspark": dict(num_layers=1, rank=16, block_size=K, feature_layers=(0, 1, 2)),
                 "dflash": dict(num_layers=1, block_size=K, feature_layers=(0, 1, 2)),
                 "eagle3": dict(ttt_length=K)}.get(name, {})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "random weights": intended here
        return build_drafter(name, host, **overrides, **extra)


@pytest.mark.parametrize("name", sorted(DRAFTERS))
def test_every_drafter_is_greedy_exact_at_batch_1_and_4(name, tiny_host, tmp_path):
    drafter = build_any(name, tiny_host, tmp_path)
    prompts = batch8(tiny_host)[2:6]  # lengths 6, 8, 1, 15
    want = [greedy_reference(tiny_host, tuple(p), 12) for p in prompts]
    for batch_size in (1, 4):
        out = generate(tiny_host, prompts, drafter=drafter, draft_length=K, max_new_tokens=12, batch_size=batch_size)
        assert out.token_ids == want, f"{name}, batch {batch_size}"
        assert int(out.log.column("proposed").sum()) > 0  # it did propose drafts


@pytest.mark.parametrize("name", ["ngram", "mtp", "ngram-no-width"])
def test_verify_all_forward_is_only_as_wide_as_the_proposals(name, tiny_host, tmp_path, monkeypatch):
    """Verify-all runs 1 + the longest proposal per round, not 1 + K, when the drafter proposes fewer than K
    (n-gram: what the lookup found, MTP-1: one); without a stated `width` the loop reads the lengths instead."""
    drafter = build_any(name.removesuffix("-no-width"), tiny_host, tmp_path)
    if name.endswith("-no-width"):
        propose = drafter.propose
        monkeypatch.setattr(drafter, "propose", lambda state, K: dataclasses.replace(propose(state, K), width=None))
    widths = []
    step = tiny_host.step
    monkeypatch.setattr(tiny_host, "step", lambda cache, tokens, *a, **kw: (widths.append(tokens.shape[1]),
                                                                            step(cache, tokens, *a, **kw))[1])
    prompts = batch8(tiny_host)[2:6]
    out = generate(tiny_host, prompts, drafter=drafter, draft_length=K, max_new_tokens=12)
    assert out.token_ids == [greedy_reference(tiny_host, tuple(p), 12) for p in prompts]
    drafts = [w - 1 for w in widths[1:]]  # per round after the prefill: drafts per row in the verify forward
    proposed = [int(p.max()) for p in out.log.per_round("proposed")]  # per round, the longest proposal
    verified = [int(v.max()) for v in out.log.per_round("verified")]
    assert len(drafts) == len(proposed) and all(v <= d <= p for d, p, v in zip(drafts, proposed, verified))
    assert sum(d < K for d in drafts) >= len(drafts) // 2  # the case in point: mostly fewer than K proposed
    if name.endswith("-no-width"):
        assert drafts == verified


def test_full_width_ngram_verifies_k_wide_and_overlaps(tiny_host, monkeypatch):
    """NgramDrafter(full_width=True) states K for its width: every verify forward is K + 1 wide (or the budget's
    width), the tokens are still the greedy reference's, and the slot engine may then overlap its rounds without
    waiting for a width (serve.overlap_allowed, on any device when asked)."""
    from drafters import build_drafter
    from dspark.engine import serve

    widths = []
    step = tiny_host.step
    monkeypatch.setattr(tiny_host, "step", lambda cache, tokens, *a, **kw: (widths.append(tokens.shape[1]),
                                                                            step(cache, tokens, *a, **kw))[1])
    prompts = batch8(tiny_host)[2:6]
    full_k = {}
    for full in (False, True):
        widths.clear()
        drafter = build_drafter("ngram", tiny_host, full_width=full)
        out = generate(tiny_host, prompts, drafter=drafter, draft_length=K, max_new_tokens=12)
        assert out.token_ids == [greedy_reference(tiny_host, tuple(p), 12) for p in prompts]
        full_k[full] = sum(w == K + 1 for w in widths[1:])  # forwards K + 1 wide, after the prefill
        if full:  # K + 1 wide until the first budget nears its end (then min(K, budget - 1) + 1)
            assert widths[1:4] == [K + 1] * 3 and full_k[True] > len(widths[1:]) // 2
            overlapped = generate(tiny_host, prompts, drafter=drafter, draft_length=K, max_new_tokens=12,
                                  concurrency=2, graphs="static", overlap=True)  # the graph path, rounds overlapped
            assert overlapped.token_ids == out.token_ids and overlapped.engine["overlapped"]
    assert full_k[True] > full_k[False]
    assert serve.overlap_allowed(_runner_for(tiny_host, drafter), VerifyAll(), K, True) == "known"
    with pytest.raises(ValueError, match="full_width"):
        build_drafter("ngram", tiny_host, full_width="yes")


def _runner_for(host, drafter):
    from dspark.engine.graphs import round_runner
    from dspark.engine.sampling import SamplingConfig
    from dspark.engine.slots import Slots

    verifier = VerifyAll()
    verifier.bind(drafter=drafter, K=K)
    slots = Slots(host, drafter, verifier, capacity=2, max_len=64, sampling=SamplingConfig())
    return round_runner(slots, host, drafter, verifier, K, graphs="static")


# ---- losslessness at T = 1 and top-p: chi-square on the micro host ---------------------------------------------

class FixedLength(Verifier):
    """Verifies the first m drafts of every request (partial verification, independent of the drafts)."""

    name = "fixed"

    def __init__(self, m: int) -> None:
        self.m = m

    def lengths(self, proposal: Proposal, K: int) -> torch.Tensor:
        return torch.full((proposal.tokens.shape[0],), min(self.m, K), dtype=torch.long)


class RandomLength(Verifier):
    """Verifies a uniformly random 0..K drafts per request and round, from its own generator (not the drafts)."""

    name = "random"

    def __init__(self, seed: int) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def lengths(self, proposal: Proposal, K: int) -> torch.Tensor:
        return torch.randint(0, K + 1, (proposal.tokens.shape[0],), generator=self.generator)


class WhileEven(Verifier):
    """Verifies x_1, then x_{k+1} while x_1..x_k are all even: draft-dependent but non-anticipating (whether x_k
    is verified depends only on x_<k), so still lossless (docs/DSPARK.md §4.3)."""

    name = "while-even"

    def lengths(self, proposal: Proposal, K: int) -> torch.Tensor:
        even = (proposal.tokens[:, : K - 1] % 2 == 0).long()  # (B, K-1)
        return 1 + even.cumprod(1).sum(1)


MICRO_K = 3
MICRO_PROMPT = [1, 5, 2, 1, 5, 2, 6]  # repeats: the n-gram drafter finds matches
N_SEEDS = 8000


@functools.cache
def micro_dspark(host: Host) -> DSparkDrafter:
    """An untrained DSpark drafter whose q is far from p (sharpened head), so acceptance tests, rejections and
    residual draws all matter."""
    torch.manual_seed(0)
    drafter = DSparkDrafter(host, DSparkConfig(num_layers=1, rank=8, block_size=MICRO_K))
    with torch.no_grad():
        drafter.W2.weight.mul_(300.0)
    return drafter


@functools.cache
def exact_tables(host: Host, cfg: SamplingConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The host's exact distributions after MICRO_PROMPT: p1 (V,), p2 (V, V) = p(b | a), p3 (V, V, V) = p(c | a, b),
    from plain transformers forwards (dspark.engine.reference), processed like the sampler does (temperature, top-p)."""
    V = host.vocab_size

    def p(prefix):
        return process(reference.next_token_logits(host.model, MICRO_PROMPT + list(prefix)), cfg).double()

    p1 = p(())
    p2 = torch.stack([p((a,)) for a in range(V)])
    p3 = torch.stack([torch.stack([p((a, b)) for b in range(V)]) for a in range(V)])
    return p1, p2, p3


VERIFIERS_UNDER_TEST = {
    "full": VerifyAll,
    "fixed-1": lambda: FixedLength(1),
    "random": lambda: RandomLength(seed=7),
    "while-even": WhileEven,
}


@pytest.mark.parametrize("drafter_name,cfg_name,verifier_name", [
    ("dspark", "T1", "full"), ("dspark", "T1", "random"), ("dspark", "top-p", "fixed-1"),
    ("dspark", "top-p", "while-even"), ("ngram", "T1", "random"), ("ngram", "top-p", "full"),
])
def test_speculative_sampling_reproduces_host_distribution(micro_host, drafter_name, cfg_name, verifier_name):
    """Joint of generated tokens (1, 2) and of (2, 3) over N_SEEDS fixed seeds against the exact host
    distributions. Token 1 is drawn at prefill; tokens 2 and 3 are decided by round 1's drafts."""
    host, V = micro_host, micro_host.vocab_size
    cfg = {"T1": T1, "top-p": TOP_P}[cfg_name]
    drafter = micro_dspark(host) if drafter_name == "dspark" else NgramDrafter()
    verifier = VERIFIERS_UNDER_TEST[verifier_name]()
    out = generate(host, [MICRO_PROMPT] * N_SEEDS, drafter=drafter, verifier=verifier, draft_length=MICRO_K,
                   max_new_tokens=4, sampling=cfg, seeds=list(range(10_000, 10_000 + N_SEEDS)))
    tokens = torch.tensor(out.token_ids)  # (n, 4)
    assert tokens.shape == (N_SEEDS, 4)
    # the test must exercise acceptances, rejections and (for partial policies) lengths 0 < ell < K
    verified, acc = out.log.column("verified"), out.log.column("accepted")
    assert int(acc.sum()) > 0.05 * N_SEEDS and bool((acc < verified).any())
    if verifier_name != "full":
        assert bool(((verified > 0) & (verified < MICRO_K)).any())
    p1, p2, p3 = exact_tables(host, cfg)
    joint12 = p1.unsqueeze(1) * p2  # (V, V)
    joint23 = (joint12.unsqueeze(2) * p3).sum(0)  # (V, V)
    for what, probs, cells in (("tokens 1-2", joint12, tokens[:, 0] * V + tokens[:, 1]),
                               ("tokens 2-3", joint23, tokens[:, 1] * V + tokens[:, 2])):
        pvalue = chi2_pvalue(torch.bincount(cells, minlength=V * V), probs)
        assert pvalue > ALPHA, f"{what}: p-value {pvalue:.2e}"


# ---- batch invariance ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("cfg_name", ["greedy", "T1"])
@pytest.mark.parametrize("drafter_name", ["ngram", "dspark"])
def test_request_output_does_not_depend_on_its_batch(tiny_host, drafter_name, cfg_name):
    cfg = {"greedy": GREEDY, "T1": T1}[cfg_name]
    drafter = make_drafter(drafter_name, tiny_host)
    prompts = batch8(tiny_host)
    seeds = [1000 + 37 * i for i in range(8)]
    kwargs = dict(drafter=drafter, draft_length=K, max_new_tokens=NEW, sampling=cfg)
    batched = generate(tiny_host, prompts, seeds=seeds, **kwargs)
    assert accepted(batched) > 0
    in_threes = generate(tiny_host, prompts, seeds=seeds, batch_size=3, **kwargs)
    assert in_threes.token_ids == batched.token_ids
    for i in (0, 4, 7):  # first, the length-1 prompt, last
        alone = generate(tiny_host, [prompts[i]], seeds=[seeds[i]], **kwargs)
        assert alone.token_ids[0] == batched.token_ids[i], f"request {i}"
    if not cfg.greedy:  # the seed, not the batch, is what decides the tokens
        reseeded = generate(tiny_host, prompts, seeds=[s + 1 for s in seeds], **kwargs)
        assert reseeded.token_ids != batched.token_ids


# ---- stops: per-request lengths, stop tokens, prompts of one token ----------------------------------------------

@pytest.mark.parametrize("drafter_name", ["none", "ngram", "dspark"])
def test_per_request_max_new_tokens(tiny_host, drafter_name):
    drafter = None if drafter_name == "none" else make_drafter(drafter_name, tiny_host)
    prompts = batch8(tiny_host)
    limits = [1, 2, 5, 9, 13, 24, 3, 7]
    out = generate(tiny_host, prompts, drafter=drafter, draft_length=K, max_new_tokens=limits)
    assert out.token_ids == [greedy_reference(tiny_host, tuple(p), NEW)[:m] for p, m in zip(prompts, limits)]
    assert out.finish_reasons == ["length"] * 8
    sampled = generate(tiny_host, prompts, drafter=drafter, draft_length=K, max_new_tokens=limits, sampling=T1)
    assert [len(t) for t in sampled.token_ids] == limits and sampled.finish_reasons == ["length"] * 8
    # the log agrees: every request committed exactly its limit, never more
    log = out.log
    for r, m in enumerate(limits):
        assert int(log.column("committed")[log.column("request") == r].sum()) + 1 == m  # + the prefill token


def mid_block_token(result, stops: set[int]) -> int | None:
    """A token that some request generated for the first time inside a round's block, before that round's last
    committed token, with no token of `stops` before it: as a further stop token it cuts that block short."""
    log = result.log
    start = {r: 1 for r in range(len(result.token_ids))}  # the prefill token is index 0
    for r, c in zip(log.column("request").tolist(), log.column("committed").tolist()):
        out = result.token_ids[r]
        for j in range(start[r], start[r] + c - 1):
            if not ({out[j]} | stops) & set(out[:j]) and out[j] not in stops:
                return out[j]
        start[r] += c
    return None


@pytest.mark.parametrize("drafter_name", ["none", "ngram", "dspark"])
def test_stop_tokens_end_requests(tiny_host, drafter_name):
    drafter = None if drafter_name == "none" else make_drafter(drafter_name, tiny_host)
    prompts = batch8(tiny_host)
    full = [greedy_reference(tiny_host, tuple(p), NEW) for p in prompts]
    # why: a prompt that holds the start of its own greedy continuation lets the n-gram drafter's accepted
    # drafts be tokens the request has not generated yet, so a stop can fall inside an accepted block
    prompts.append(prompts[3] + full[3][:10])
    full.append(greedy_reference(tiny_host, tuple(prompts[8]), NEW))
    kwargs = dict(drafter=drafter, draft_length=K, max_new_tokens=NEW)
    # a token generated first by request 0 (it stops at once), one generated later by request 3, and (with a
    # drafter) one that ends a request inside a round's accepted block
    stops = {full[0][0], full[3][8]}
    if drafter is not None:
        stops.add(mid_block_token(generate(tiny_host, prompts, **kwargs), stops))
    stops = frozenset(stops)
    want = [greedy_reference(tiny_host, tuple(p), NEW, stops) for p in prompts]
    out = generate(tiny_host, prompts, stop_token_ids=stops, **kwargs)
    assert out.token_ids == want
    reasons = ["stop" if any(t in stops for t in w) else "length" for w in want]
    assert out.finish_reasons == reasons and "stop" in reasons and "length" in reasons
    assert out.token_ids[0] == [full[0][0]]
    if drafter is not None:  # a stop did cut a round's accepted block short (committed < accepted + 1)
        assert bool((out.log.column("committed") < out.log.column("accepted") + 1).any())


@pytest.mark.parametrize("drafter_name", ["ngram", "dspark"])
def test_stop_tokens_at_temperature_one_cut_the_same_tokens(tiny_host, drafter_name):
    """Stops only end requests: with the same seeds a stopped run is the unstopped one cut after the first stop."""
    drafter = make_drafter(drafter_name, tiny_host)
    prompts = batch8(tiny_host)
    kwargs = dict(drafter=drafter, draft_length=K, max_new_tokens=NEW, sampling=T1, seed=5)
    free = generate(tiny_host, prompts, **kwargs).token_ids
    stops = {free[1][3], free[6][10]}
    out = generate(tiny_host, prompts, stop_token_ids=stops, **kwargs)
    for f, got, reason in zip(free, out.token_ids, out.finish_reasons):
        first = next((j for j, t in enumerate(f) if t in stops), None)
        assert got == (f if first is None else f[: first + 1])
        assert reason == ("length" if first is None else "stop")
    assert "stop" in out.finish_reasons


@pytest.mark.parametrize("drafter_name", ["ngram", "dspark"])
def test_prompts_of_length_one(tiny_host, drafter_name):
    drafter = make_drafter(drafter_name, tiny_host)
    prompts = [[5], [17], [99], [5, 5]]
    want = [greedy_reference(tiny_host, tuple(p), NEW) for p in prompts]
    out = generate(tiny_host, prompts, drafter=drafter, draft_length=K, max_new_tokens=NEW)
    assert out.token_ids == want
    alone = generate(tiny_host, [[17]], drafter=drafter, draft_length=K, max_new_tokens=NEW)
    assert alone.token_ids == [want[1]]
    one = generate(tiny_host, prompts, drafter=drafter, draft_length=K, max_new_tokens=1)
    assert one.token_ids == [w[:1] for w in want] and one.rounds == 0  # the prefill token only
    sampled = generate(tiny_host, prompts, drafter=drafter, draft_length=K, max_new_tokens=NEW, sampling=T1)
    assert [len(t) for t in sampled.token_ids] == [NEW] * 4


# ---- drafters decode in the host's dtype -----------------------------------------------------------------------

@pytest.mark.parametrize("name", ["dspark", "dflash", "eagle3", "mtp"])
def test_a_resolved_drafter_decodes_in_the_hosts_dtype(name, tmp_path):
    """resolve_drafter (the CLI, the experiments, the transformers drop-in) casts a built or loaded drafter to a
    bf16 host's dtype, since its float32 master weights doubled every draft step's reads on a GPU; the draft
    still decodes (greedy, bf16 on the CPU) and a saved checkpoint keeps float32. A Drafter object passed in,
    dtype="float32" (`--drafter-dtype float32`) and build_drafter (what training uses) stay float32."""
    from safetensors.torch import load_file

    from dspark.api import resolve_drafter

    model = tiny_model("qwen2")
    host = Host(model.to(torch.bfloat16), name="bf16")
    built = build_any(name, host, tmp_path)
    assert {p.dtype for p in built.parameters()} == {torch.float32}
    assert resolve_drafter(host, built) is built and next(built.parameters()).dtype == torch.float32
    built.save_pretrained(tmp_path / name)
    drafter = resolve_drafter(host, drafter_path=tmp_path / name)
    assert {p.dtype for p in drafter.parameters() if p.is_floating_point()} == {torch.bfloat16}
    kept = resolve_drafter(host, drafter_path=tmp_path / name, dtype="float32")  # `--drafter-dtype float32`
    assert {p.dtype for p in kept.parameters()} == {torch.float32}
    with pytest.raises(ValueError, match="drafter dtype"):
        resolve_drafter(host, drafter_path=tmp_path / name, dtype="float16")
    prompts = random_prompts([5, 9], host.vocab_size, seed=4)
    out = generate(host, prompts, drafter=drafter, draft_length=K, max_new_tokens=8)
    assert [len(t) for t in out.token_ids] == [8, 8] and int(out.log.column("proposed").sum()) > 0
    saved = load_file(str(tmp_path / name / "model.safetensors"))
    assert {t.dtype for t in saved.values() if t.is_floating_point()} == {torch.float32}
