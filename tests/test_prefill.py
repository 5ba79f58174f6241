"""Prefill of arrivals (dspark.engine.prefill): the graph path's buffers and padding, run here without capture
("static" mode), give what a fresh cache and the step as called give; decoding through it gives every request the
eager loop's tokens. The captured replay itself is checked on a GPU (tests/test_engine_cuda.py)."""
from __future__ import annotations

import pytest
import torch

import dspark.engine.prefill as prefill_module
import dspark.engine.serve as serve_module
from dspark.engine.prefill import GRAPH_ROWS, Prefill
from tests.conftest import random_prompts
from tests.test_engine import GREEDY, T1, check_against_solo


def _prompts(host, n: int, P: int = 64):
    lengths = [3 + (7 * i) % 40 for i in range(n)]
    tokens = torch.zeros(n, P, dtype=torch.long)
    for b, p in enumerate(random_prompts(lengths, host.vocab_size, seed=n)):
        tokens[b, : len(p)] = torch.tensor(p)
    return tokens, torch.tensor(lengths)


def test_static_prefill_equals_the_step_as_called(tiny_host):
    eager = Prefill(tiny_host, max_len=96, taps=(0, 2), mode="eager")
    static = Prefill(tiny_host, max_len=96, taps=(0, 2), mode="static")
    for n in (3, 1, 3):  # padded to 4 rows, then 1, then the first shape again (its buffers reused)
        tokens, plen = _prompts(tiny_host, n)
        (ref_cache, ref_hidden, ref_features), (cache, hidden, features) = eager(tokens, plen), static(tokens, plen)
        assert cache.lengths.tolist() == plen.tolist() == ref_cache.lengths.tolist()
        for b, length in enumerate(plen.tolist()):  # what later rounds read: each row's committed positions
            torch.testing.assert_close(cache.k[:, b, :, :length], ref_cache.k[:, b, :, :length])
            torch.testing.assert_close(cache.v[:, b, :, :length], ref_cache.v[:, b, :, :length])
            torch.testing.assert_close(hidden[b, :length], ref_hidden[b, :length])
            torch.testing.assert_close(features[b, :length], ref_features[b, :length])
    assert sorted(static.shapes) == [(1, 64), (4, 64)] and static.graphs == 0


def test_many_arrivals_or_long_prompts_run_as_called(tiny_host):
    static = Prefill(tiny_host, max_len=96, taps=(), mode="static")
    static(*_prompts(tiny_host, GRAPH_ROWS + 1))
    assert not static.shapes
    with pytest.raises(ValueError, match="prefill mode"):
        Prefill(tiny_host, max_len=96, taps=(), mode="fast")


@pytest.mark.parametrize("drafter_name", ["none", "dspark-trained", "eagle3", "small-lm", "ngram"])
def test_decoding_through_static_prefill_equals_solo_eager(tiny_host, drafter_name, monkeypatch):
    monkeypatch.setattr(serve_module, "prefill_mode", lambda graphs: "static")
    prepared = []
    real = prefill_module.Prefill._prepare
    monkeypatch.setattr(prefill_module.Prefill, "_prepare", lambda self, N, P: prepared.append(N) or real(self, N, P))
    for sampling in (GREEDY, T1):
        got = check_against_solo(tiny_host, drafter_name, "full", sampling, 3, lambda x: x[::-1])
        assert got.engine["prefill_graphs"] == 0
    assert prepared  # the static path ran
