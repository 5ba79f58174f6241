"""EAGLE-3 drafter: greedy equality with the oracle, draft-cache consistency, TTT = the inference unroll, training,
checkpoints, and losslessness at T = 1."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from scipy.stats import chisquare

from drafters import build_drafter, load_drafter
from drafters.base import TrainBatch
from drafters.checkpoint import CheckpointError
from drafters.eagle3 import Eagle3Config, Eagle3Drafter, eagle3_feature_layers
from dspark.engine.decode import generate
from dspark.engine.host import Host
from dspark.engine.protocol import DraftState, Drafter, Proposal
from dspark.engine.reference import greedy, next_token_logits
from dspark.engine.sampling import SamplingConfig, process
from tests.conftest import random_prompts, tiny_model

K = 3


# ---- helpers shared with tests/test_drafters_small_lm.py ------------------------------------------------------

class Recorder(Drafter):
    """Delegates to a drafter and keeps a copy of every round's state and proposal."""

    def __init__(self, inner: Drafter) -> None:
        self.inner = inner
        self.feature_layers = inner.feature_layers
        self.records: list[tuple[DraftState, Proposal]] = []

    def begin(self, **kwargs) -> None:
        self.inner.begin(**kwargs)

    def observe(self, **kwargs) -> None:
        self.inner.observe(**kwargs)

    def prefill(self, **kwargs) -> None:
        self.inner.prefill(**kwargs)

    def propose(self, state: DraftState, K: int) -> Proposal:
        proposal = self.inner.propose(state, K)
        frozen = DraftState(seq=state.seq.clone(), seq_len=state.seq_len.clone(), seeds=state.seeds.clone(),
                            rounds=state.rounds.clone(), sampling=state.sampling)
        self.records.append((frozen, proposal))
        return proposal

    def select(self, rows: torch.Tensor) -> None:
        self.inner.select(rows)


def fresh_proposal(drafter: Drafter, host: Host, state: DraftState, K: int) -> Proposal:
    """What `drafter`, begun afresh, proposes for `state` after observing the committed prefix in one go."""
    B, W = state.seq.shape
    n_ctx = state.seq_len - 1  # every committed position but the anchor has host features
    drafter.begin(host=host, batch_size=B, max_len=W)
    out = host.step(host.new_cache(B, W), state.seq[:, : int(n_ctx.max())], n_ctx, taps=drafter.feature_layers)
    drafter.observe(features=out.features, start=torch.zeros_like(n_ctx), n_valid=n_ctx, state=state)
    return drafter.propose(state, K)


def check_cache_consistency(drafter: Drafter, host: Host, prompts, *, max_new_tokens: int) -> int:
    """Run many rounds at T = 1 (ragged acceptance) and compare every round's proposal with a fresh re-run."""
    recorder = Recorder(drafter)
    generate(host, prompts, drafter=recorder, draft_length=K, max_new_tokens=max_new_tokens,
             sampling=SamplingConfig(temperature=1.0), seed=3)
    for state, proposal in recorder.records:
        again = fresh_proposal(drafter, host, state, K)
        assert torch.equal(again.tokens, proposal.tokens)
        assert (again.q - proposal.q).abs().max() < 1e-4
    return len(recorder.records)


def chi_square_first_tokens(host: Host, drafter: Drafter, *, n: int = 4000) -> None:
    """Empirical joint of the first two generated tokens, and the marginal of the third (both decided by drafts
    at T = 1), against the exact host distributions; all seeds in one batched generate call."""
    prompt, V, cfg = [3, 1, 4, 1], host.vocab_size, SamplingConfig(temperature=1.0)
    out = generate(host, [prompt] * n, drafter=drafter, draft_length=K, max_new_tokens=4, sampling=cfg,
                   seeds=list(range(n)))
    assert all(len(t) == 4 for t in out.token_ids)
    assert float(torch.cat(out.log.accepted).float().mean()) > 0.2  # drafts are accepted, so they matter
    p1 = process(next_token_logits(host.model, prompt), cfg)  # (V,)
    p2 = torch.stack([process(next_token_logits(host.model, prompt + [a]), cfg) for a in range(V)])  # (V, V)
    joint = p1.unsqueeze(1) * p2  # (V, V)
    p3 = torch.zeros(V)
    for a in range(V):
        for b in range(V):
            p3 += joint[a, b] * process(next_token_logits(host.model, prompt + [a, b]), cfg)
    tokens = torch.tensor(out.token_ids)  # (n, 4)
    for expected, observed in ((joint.flatten(), torch.bincount(tokens[:, 0] * V + tokens[:, 1], minlength=V * V)),
                               (p3, torch.bincount(tokens[:, 2], minlength=V))):
        expected = expected.double()
        expected = expected / expected.sum() * n
        small = expected < 5  # why: chi-square needs expected counts >= 5; pool the rare cells into one
        f_exp, f_obs = expected[~small], observed[~small].double()
        if bool(small.any()):
            f_exp = torch.cat([f_exp, expected[small].sum(0, keepdim=True)])
            f_obs = torch.cat([f_obs, observed[small].double().sum(0, keepdim=True)])
        assert chisquare(f_obs.numpy(), f_exp.numpy()).pvalue > 1e-3


def peaked_micro_host() -> Host:
    """V = 8 host whose next-token distributions are peaked but spread (initializer_range 0.2): rejections and
    residual draws both happen often, and few chi-square cells are rare."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1)
    config = LlamaConfig(vocab_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, initializer_range=0.2,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return Host(LlamaForCausalLM(config).eval(), name="peaked-micro")


# ---- fixtures --------------------------------------------------------------------------------------------------

def self_distilled_batch(host: Host, drafter: Eagle3Drafter, prompts, new_tokens: int) -> TrainBatch:
    """Prompts + the host's own greedy continuations, loss on the continuations, host outputs computed online."""
    outs = generate(host, prompts, max_new_tokens=new_tokens).token_ids
    rows = [p + o for p, o in zip(prompts, outs)]
    T = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), T, dtype=torch.long)
    mask = torch.zeros(len(rows), T, dtype=torch.long)
    doc = torch.zeros(len(rows), T, dtype=torch.long)
    for b, (p, r) in enumerate(zip(prompts, rows)):
        ids[b, : len(r)] = torch.tensor(r)
        mask[b, len(p): len(r)] = 1
        doc[b, len(r):] = 1  # the padding is its own document
    out = host.forward(ids, document_ids=doc, taps=drafter.feature_layers)
    return TrainBatch(input_ids=ids, loss_mask=mask, document_ids=doc, features=out.features,
                      host_logits=host.logits(out.hidden))


PROMPTS = random_prompts([6, 9, 4, 11], 128, seed=5)


@pytest.fixture(scope="module")
def untrained(tiny_host) -> Eagle3Drafter:
    torch.manual_seed(0)
    return Eagle3Drafter(tiny_host, Eagle3Config(ttt_length=4))


@pytest.fixture(scope="module")
def trained(tiny_host, untrained):
    """The untrained drafter after 30 steps on a fixed self-distilled batch: (drafter, losses, first gradients)."""
    drafter = Eagle3Drafter(tiny_host, untrained.config)
    drafter.load_state_dict(untrained.state_dict())
    batch = self_distilled_batch(tiny_host, drafter, PROMPTS, new_tokens=24)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    losses, grads = [], None
    for step in range(30):
        out = drafter.training_loss(batch)
        optimizer.zero_grad()
        out.loss.backward()
        if step == 0:
            grads = {n: p.grad.clone() for n, p in drafter.named_parameters()}
        optimizer.step()
        losses.append(float(out.loss.detach()))
    return drafter, losses, grads, out


# ---- tests -----------------------------------------------------------------------------------------------------

def test_feature_layers_follow_eagle3():
    assert eagle3_feature_layers(32) == (1, 15, 28)
    assert eagle3_feature_layers(36) == (1, 17, 32)
    assert eagle3_feature_layers(4) == (0, 2, 3)  # too shallow for EAGLE-3's rule: low/mid/high spread
    assert eagle3_feature_layers(1) == (0,)


@pytest.mark.parametrize("which", ["untrained", "trained"])
@pytest.mark.parametrize("lengths", [[7], [5, 9, 3, 12]])
def test_greedy_matches_reference(tiny_host, untrained, trained, which, lengths):
    drafter = untrained if which == "untrained" else trained[0]
    prompts = random_prompts(lengths, tiny_host.vocab_size, seed=len(lengths))
    out = generate(tiny_host, prompts, drafter=drafter, draft_length=K, max_new_tokens=14)
    for prompt, tokens in zip(prompts, out.token_ids):
        assert tokens == greedy(tiny_host.model, prompt, 14)


def test_training_decreases_loss_and_reaches_every_trainable_parameter(tiny_host, trained):
    drafter, losses, grads, out = trained
    assert losses[-1] < losses[0] - 0.5
    assert out.acceptance.shape == (4,) and bool(((out.acceptance >= 0) & (out.acceptance <= 1)).all())
    assert set(grads) == {n for n, _ in drafter.named_parameters()}
    assert all(g.abs().sum() > 0 for g in grads.values())
    # the host's embedding and LM head are shared, frozen and neither parameters nor state of the drafter
    assert tiny_host.embed_tokens.weight.grad is None and tiny_host.lm_head.weight.grad is None
    own = {id(p) for p in drafter.parameters()}
    assert id(tiny_host.embed_tokens.weight) not in own and id(tiny_host.lm_head.weight) not in own
    assert not any("embed_tokens" in k or "lm_head" in k for k in drafter.state_dict())


def test_training_raises_acceptance_on_what_it_learned(tiny_host, untrained, trained):
    taus = [generate(tiny_host, PROMPTS, drafter=d, draft_length=K, max_new_tokens=24).stats["tau"]
            for d in (untrained, trained[0])]
    assert taus[1] > taus[0] + 0.5


def test_ttt_unroll_is_the_inference_unroll(tiny_host, trained):
    """Step j of training at index i equals drafting step j+1 at anchor i+1 with the true tokens fed back."""
    drafter = trained[0]
    ids = torch.tensor([random_prompts([20], tiny_host.vocab_size, seed=9, repeat=False)[0]])  # (1, T)
    out = tiny_host.forward(ids, taps=drafter.feature_layers)
    steps = list(drafter.ttt_logits(ids, out.features, torch.zeros_like(ids)))
    state = DraftState(seq=ids, seq_len=torch.tensor([0]), seeds=torch.zeros(1, dtype=torch.long),
                       rounds=torch.zeros(1, dtype=torch.long), sampling=SamplingConfig())
    with torch.no_grad():
        for i in (0, 5, 11):
            drafter.begin(host=tiny_host, batch_size=1, max_len=ids.shape[1] + 8)
            drafter.observe(features=out.features[:, : i + 1], start=torch.tensor([0]), n_valid=torch.tensor([i + 1]),
                            state=state)
            g = drafter.last_hidden.unsqueeze(1)  # (1, 1, H)
            for j in range(len(steps)):
                if j > 0:
                    g = drafter._cached_step(g, ids[:, i + 1 + j: i + 2 + j], torch.tensor([[i + j]]))
                assert (drafter._logits(g[:, 0]) - steps[j][:, i]).abs().max() < 1e-4


def test_draft_cache_is_consistent_across_rounds(tiny_host, trained):
    prompts = random_prompts([5, 9, 3], tiny_host.vocab_size, seed=7)
    assert check_cache_consistency(trained[0], tiny_host, prompts, max_new_tokens=30) >= 8


def test_save_load_gives_identical_proposals(tiny_host, trained, tmp_path):
    drafter = trained[0]
    path = drafter.save_pretrained(tmp_path / "eagle3")
    saved = json.loads((path / "config.json").read_text())
    assert saved["kind"] == "eagle3" and saved["config"]["feature_layers"] == [0, 2, 3]
    assert set(load_file(str(path / "model.safetensors"))) == set(drafter.state_dict())  # no host weights
    for loaded in (Eagle3Drafter.from_pretrained(path, tiny_host), load_drafter(path, tiny_host),
                   build_drafter("eagle3", tiny_host, checkpoint=path)):
        assert isinstance(loaded, Eagle3Drafter) and loaded.config == drafter.config
        state = DraftState(seq=torch.tensor([PROMPTS[1] + [0] * 8]), seq_len=torch.tensor([len(PROMPTS[1])]),
                           seeds=torch.tensor([1]), rounds=torch.tensor([2]),
                           sampling=SamplingConfig(temperature=0.7))
        a, b = fresh_proposal(drafter, tiny_host, state, K), fresh_proposal(loaded, tiny_host, state, K)
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.q, b.q)


def test_checkpoint_for_another_host_is_refused(trained, tmp_path):
    path = trained[0].save_pretrained(tmp_path / "eagle3")
    with pytest.raises(CheckpointError, match="vocab_size=128.*vocab_size=64"):
        Eagle3Drafter.from_pretrained(path, Host(tiny_model("llama", vocab=64)))
    with pytest.raises(CheckpointError, match="num_layers=4.*num_layers=6"):
        Eagle3Drafter.from_pretrained(path, Host(tiny_model("llama", layers=6)))
    with pytest.raises(CheckpointError, match="ttt_length=4"):
        Eagle3Drafter.from_pretrained(path, Host(tiny_model("llama")), ttt_length=7)


def test_lossless_at_temperature_one():
    host = peaked_micro_host()
    torch.manual_seed(1)
    chi_square_first_tokens(host, Eagle3Drafter(host))


# ---- draft vocabulary (EAGLE-3's reduced vocabulary) ---------------------------------------------------------

@pytest.fixture(scope="module")
def small_vocab(tiny_host):
    """An EAGLE-3 drafting over the 48 host tokens its self-distilled batch targets most, trained 30 steps."""
    torch.manual_seed(0)
    drafter = Eagle3Drafter(tiny_host, Eagle3Config(ttt_length=4, draft_vocab=48))
    batch = self_distilled_batch(tiny_host, drafter, PROMPTS, new_tokens=24)
    counts = torch.bincount(batch.input_ids[batch.loss_mask.bool()], minlength=tiny_host.vocab_size)
    drafter.set_draft_vocab(drafter.draft_vocab_from_counts(counts))
    optimizer = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=3e-3)
    outs = []
    for _ in range(30):
        outs.append(drafter.training_loss(batch))
        optimizer.zero_grad()
        outs[-1].loss.backward()
        optimizer.step()
    return drafter, outs


def test_draft_vocab_starts_from_the_host_rows_of_its_most_frequent_targets(tiny_host):
    drafter = Eagle3Drafter(tiny_host, Eagle3Config(ttt_length=2, draft_vocab=3))
    counts = torch.zeros(tiny_host.vocab_size, dtype=torch.long)
    counts[[5, 9, 40, 41]] = torch.tensor([7, 3, 3, 1])
    ids = drafter.draft_vocab_from_counts(counts)
    assert ids.tolist() == [5, 9, 40]  # the ties at count 3 keep both; at equal counts the lower id wins
    drafter.set_draft_vocab(ids)
    assert torch.equal(drafter.d2t, ids) and torch.equal(drafter.draft_head.weight, tiny_host.lm_head.weight[ids])
    assert {"d2t", "draft_head.weight"} <= set(drafter.state_dict())
    for bad in ([5, 5, 9], [5, 9], [5, 9, tiny_host.vocab_size]):
        with pytest.raises(ValueError, match="distinct host token ids"):
            drafter.set_draft_vocab(torch.tensor(bad))
    with pytest.raises(ValueError, match="smaller than the host's vocabulary"):
        Eagle3Drafter(tiny_host, Eagle3Config(draft_vocab=tiny_host.vocab_size))
    with pytest.raises(ValueError, match="draft_vocab must be"):
        Eagle3Config(draft_vocab=-1)


def test_draft_vocab_trains_and_proposes_only_its_tokens_losslessly(tiny_host, small_vocab):
    drafter, outs = small_vocab
    assert float(outs[-1].loss.detach()) < float(outs[0].loss.detach()) - 0.5
    assert bool(((outs[-1].acceptance >= 0) & (outs[-1].acceptance <= 1)).all())
    recorder = Recorder(drafter)
    prompts = random_prompts([5, 9, 3], tiny_host.vocab_size, seed=7)
    out = generate(tiny_host, prompts, drafter=recorder, draft_length=K, max_new_tokens=14)
    for prompt, tokens in zip(prompts, out.token_ids):
        assert tokens == greedy(tiny_host.model, prompt, 14)
    allowed = set(drafter.d2t.tolist())
    assert recorder.records and all(set(p.tokens.flatten().tolist()) <= allowed for _, p in recorder.records)
    fresh = Eagle3Drafter(tiny_host, drafter.config)
    fresh.set_draft_vocab(drafter.d2t)
    taus = [generate(tiny_host, PROMPTS, drafter=d, draft_length=K, max_new_tokens=24).stats["tau"]
            for d in (fresh, drafter)]
    assert taus[1] > taus[0] + 0.5  # it learnt what it trained on, within its vocabulary


def test_draft_vocab_sampled_q_lives_on_the_host_vocabulary_and_checkpoints(tiny_host, small_vocab, tmp_path):
    drafter = small_vocab[0]
    state = DraftState(seq=torch.tensor([PROMPTS[1] + [0] * 8]), seq_len=torch.tensor([len(PROMPTS[1])]),
                       seeds=torch.tensor([1]), rounds=torch.tensor([2]), sampling=SamplingConfig(temperature=0.7))
    a = fresh_proposal(drafter, tiny_host, state, K)
    assert a.q.shape == (1, K, tiny_host.vocab_size)
    outside = torch.ones(tiny_host.vocab_size, dtype=torch.bool)
    outside[drafter.d2t] = False
    assert float(a.q[..., outside].abs().max()) == 0 and torch.allclose(a.q.sum(-1), torch.ones(1, K))
    assert bool((a.q.gather(-1, a.tokens.unsqueeze(-1)) > 0).all())  # each token drawn from its own q
    path = drafter.save_pretrained(tmp_path / "eagle3")
    loaded = load_drafter(path, tiny_host)
    assert loaded.config.draft_vocab == 48 and torch.equal(loaded.d2t, drafter.d2t)
    b = fresh_proposal(loaded, tiny_host, state, K)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.q, b.q)


def test_draft_vocab_lossless_at_temperature_one():
    host = peaked_micro_host()
    torch.manual_seed(1)
    drafter = Eagle3Drafter(host, Eagle3Config(draft_vocab=5))
    drafter.set_draft_vocab(torch.tensor([0, 2, 3, 5, 6]))
    chi_square_first_tokens(host, drafter)
