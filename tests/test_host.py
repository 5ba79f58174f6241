import pytest
import torch

from dspark.engine.host import Host
from tests.conftest import tiny_model


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_ragged_step_matches_transformers(kind):
    model = tiny_model(kind)
    host = Host(model)
    lens, pre = [5, 9, 3, 12], [2, 4, 1, 0]
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, host.vocab_size, (n,), generator=g) for n in lens]
    cache = host.new_cache(4, 64)

    def batch(parts):
        T = max(len(p) for p in parts)
        out = torch.zeros(len(parts), T, dtype=torch.long)
        for b, p in enumerate(parts):
            out[b, : len(p)] = p
        return out, torch.tensor([len(p) for p in parts])

    # a first ragged step (one row has nothing to add), then a second ragged step over the rest
    tokens, n = batch([s[:p] for s, p in zip(seqs, pre)])
    if tokens.shape[1]:
        host.step(cache, tokens, n, attend=tokens.shape[1])
    cache.advance(n)
    tokens, n = batch([s[p:] for s, p in zip(seqs, pre)])
    out = host.step(cache, tokens, n, taps=(0, 2))
    logits = host.logits(out.hidden)
    for b, s in enumerate(seqs):
        ref = model(s[None], output_hidden_states=True)
        assert (ref.logits[0, pre[b]:] - logits[b, : n[b]]).abs().max() < 1e-4
        taps = torch.cat([ref.hidden_states[1], ref.hidden_states[3]], -1)[0, pre[b]:]
        assert (taps - out.features[b, : n[b]]).abs().max() < 1e-4


def test_rollback_is_moving_a_length(tiny_host):
    g = torch.Generator().manual_seed(1)
    a = torch.randint(0, tiny_host.vocab_size, (1, 6), generator=g)
    b = torch.randint(0, tiny_host.vocab_size, (1, 3), generator=g)
    cache = tiny_host.new_cache(1, 32)
    tiny_host.step(cache, a, torch.tensor([6]))
    cache.advance(torch.tensor([6]))
    tiny_host.step(cache, torch.randint(0, 128, (1, 4)), torch.tensor([4]))  # rejected drafts: not advanced
    out = tiny_host.step(cache, b, torch.tensor([3]))
    ref = tiny_host.model(torch.cat([a, b], 1)).logits[0, 6:]
    assert (tiny_host.logits(out.hidden)[0] - ref).abs().max() < 1e-4


def test_packed_forward_keeps_documents_apart(tiny_host):
    g = torch.Generator().manual_seed(2)
    a = torch.randint(0, 128, (1, 5), generator=g)
    b = torch.randint(0, 128, (1, 7), generator=g)
    out = tiny_host.forward(torch.cat([a, b], 1), document_ids=torch.tensor([[0] * 5 + [1] * 7]))
    logits = tiny_host.logits(out.hidden)[0]
    assert (logits[:5] - tiny_host.model(a).logits[0]).abs().max() < 1e-4
    assert (logits[5:] - tiny_host.model(b).logits[0]).abs().max() < 1e-4


def test_unsupported_architecture_is_named():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(ValueError, match="gpt2.*not supported.*llama, qwen2, qwen3, mistral"):
        Host(model)


def test_bad_taps_and_full_cache(tiny_host):
    with pytest.raises(ValueError, match="do not exist"):
        tiny_host.check_taps((0, 99))
    with pytest.raises(ValueError, match="repeat"):
        tiny_host.check_taps((1, 1))
    cache = tiny_host.new_cache(1, 4)
    with pytest.raises(ValueError, match="cache of 4 positions is full"):
        tiny_host.step(cache, torch.zeros(1, 5, dtype=torch.long), torch.tensor([5]))
