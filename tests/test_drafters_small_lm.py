"""Small-LM drafter: greedy equality with the oracle, a copy of the host as the perfect drafter, cache consistency
across rounds, save/load, vocabulary checks and losslessness at T = 1."""
from __future__ import annotations

import copy

import pytest
import torch

from drafters import build_drafter
from drafters.small_lm import SmallLMDrafter
from dspark.engine.decode import generate
from dspark.engine.protocol import DraftState
from dspark.engine.reference import greedy
from dspark.engine.sampling import SamplingConfig
from tests.conftest import random_prompts, tiny_model
from tests.test_drafters_eagle3 import (K, check_cache_consistency, chi_square_first_tokens, fresh_proposal,
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
