import math

import pytest
import torch

from dspark.engine.sampling import STREAM_SAMPLE, SamplingConfig, argmax, process, sample, uniform


@pytest.mark.parametrize("kwargs,match", [
    ({"temperature": -1.0}, "temperature"), ({"temperature": math.nan}, "temperature"),
    ({"temperature": math.inf}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"top_p": math.nan}, "top_p"), ({"top_k": -2}, "top_k"), ({"top_k": 1.5}, "top_k"),
])
def test_invalid_sampling_parameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingConfig(**kwargs)


def test_noise_is_keyed_not_stateful():
    seeds = torch.tensor([3, 4, 5])
    counter = torch.tensor([[1, 2], [1, 2], [7, 8]])
    u = uniform(seeds, counter, STREAM_SAMPLE, 6)
    again = uniform(seeds[1:], counter[1:], STREAM_SAMPLE, 6)  # a row's noise ignores its companions
    assert torch.equal(u[1:], again)
    assert not torch.equal(u[0], u[1])
    assert 0 < float(u.min()) and float(u.max()) < 1


def test_sample_matches_probs():
    probs = torch.tensor([0.5, 0.25, 0.125, 0.125]).expand(40000, 4)
    draws = sample(probs, torch.arange(40000), torch.zeros(40000, dtype=torch.long), STREAM_SAMPLE)
    freq = torch.bincount(draws, minlength=4).float() / 40000
    assert torch.allclose(freq, probs[0], atol=0.01)


def test_top_k_top_p_and_greedy():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert torch.equal(process(logits, SamplingConfig()), torch.tensor([[1.0, 0, 0, 0]]))
    p = process(logits, SamplingConfig(temperature=1.0, top_k=2))
    assert torch.allclose(p, torch.tensor([[0.625, 0.375, 0, 0]]))
    p = process(logits, SamplingConfig(temperature=1.0, top_p=0.8))  # smallest set with mass >= 0.8
    assert torch.allclose(p, torch.tensor([[0.625, 0.375, 0, 0]]))
    p = process(logits, SamplingConfig(temperature=2.0))
    assert torch.allclose(p, torch.softmax(logits / 2, -1))


@pytest.mark.parametrize("vocab", [151936, 49152, 32000, 50257, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_is_torch_argmax(vocab, dtype):
    """The two-stage argmax (split rows) and the one-stage fallback (odd or short rows) return torch's index, ties
    (the first maximal index, also across chunks) and NaN (the largest) included."""
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(4, 3, vocab, generator=g).to(dtype)
    x[0, 0] = 0.0  # every entry ties
    x[0, 1, ::7] = 5.0  # ties in many chunks
    x[0, 2, vocab // 2] = x[0, 2, vocab - 1] = 9.0  # a tie between two far chunks
    x[1, 0] = x[1, 0].round()  # ties within chunks
    x[2, 0, 100] = x[2, 0, vocab - 5] = float("nan")
    x[3, 1, vocab - 1] = 1e4  # the last entry
    assert torch.equal(argmax(x), x.argmax(-1))
    assert torch.equal(argmax(x[:, 1]), x[:, 1].argmax(-1))  # a strided (non-contiguous) row batch
    assert argmax(x[:0]).shape == (0, 3)
