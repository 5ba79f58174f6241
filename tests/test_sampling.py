import math

import pytest
import torch

from dspark.engine.sampling import STREAM_SAMPLE, SamplingConfig, process, sample, uniform


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
