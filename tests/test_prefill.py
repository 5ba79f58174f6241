"""Prefill of arrivals (dspark.engine.prefill): the graph path's buffers and padding, run here without capture
("static" mode), give what a fresh cache and the step as called give, for the host's prefill and the drafter's part
of an admission (DrafterPrefill); decoding through them gives every request the eager loop's tokens. The captured
replay itself is checked on a GPU (tests/test_engine_cuda.py)."""
from __future__ import annotations

import pytest
import torch

import dspark.engine.prefill as prefill_module
import dspark.engine.serve as serve_module
from dspark.engine.prefill import GRAPH_ROWS, DrafterPrefill, Prefill, _tensors
from dspark.engine.protocol import DraftState
from tests.conftest import random_prompts
from tests.test_engine import GREEDY, T1, check_against_solo, drafter_of


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
    prepared, drafter_prepared = [], []
    real = prefill_module.Prefill._prepare
    monkeypatch.setattr(prefill_module.Prefill, "_prepare", lambda self, N, P: prepared.append(N) or real(self, N, P))
    real_drafter = prefill_module.DrafterPrefill._prepare
    monkeypatch.setattr(prefill_module.DrafterPrefill, "_prepare",
                        lambda self, N, *a: drafter_prepared.append(N) or real_drafter(self, N, *a))
    for sampling in (GREEDY, T1):
        got = check_against_solo(tiny_host, drafter_name, "full", sampling, 3, lambda x: x[::-1])
        assert got.engine["prefill_graphs"] == 0
    assert prepared  # the static path ran
    # and the drafter's admission took its static path where the drafter allows it (not small-LM: its prefill
    # sizes its step by the prompts; none, n-gram: no state)
    assert bool(drafter_prepared) == (drafter_name in ("dspark-trained", "eagle3"))


def test_drafter_admission_as_called_when_switched_off(tiny_host, monkeypatch):
    """serve.CAPTURE_DRAFTER_ADMISSION = False (speed.py's --drafter-admission eager, an A/B): the host's prefill
    keeps its graph path, the drafter's part runs as called, and the tokens stay the eager loop's."""
    monkeypatch.setattr(serve_module, "prefill_mode", lambda graphs: "static")
    monkeypatch.setattr(serve_module, "CAPTURE_DRAFTER_ADMISSION", False)
    prepared = []
    monkeypatch.setattr(prefill_module.DrafterPrefill, "_prepare", lambda self, *a: prepared.append(a))
    check_against_solo(tiny_host, "eagle3", "full", GREEDY, 3, lambda x: x[::-1])
    assert not prepared
    # the same switch from the environment, for processes a driver starts; a wrong value is named
    for value, want in (("eager", False), ("captured", True)):
        monkeypatch.setenv("DSPARK_DRAFTER_ADMISSION", value)
        assert serve_module._drafter_admission_setting() is want
    monkeypatch.setenv("DSPARK_DRAFTER_ADMISSION", "graph")
    with pytest.raises(ValueError, match="DSPARK_DRAFTER_ADMISSION must be captured or eager"):
        serve_module._drafter_admission_setting()


def check_drafter_prefill(host, drafter, mode: str) -> None:
    """The drafter's state rows after an admission on zeroed scratch rows (padded to N; `mode` "static" or, on a
    GPU, "graph") equal begin + observe + prefill on the arrivals alone, for arrivals of 3 (128-wide), 1, then 3
    again 64-wide (scratch rows shared by the shapes: the 128-wide admission's keys past 64 must not survive into
    the 64-wide one's rows); the drafter's own state is put back."""
    max_len, device = 192, host.device
    host_prefill = Prefill(host, max_len=max_len, taps=drafter.feature_layers, mode="eager")
    drafter.begin(host=host, batch_size=4, max_len=max_len)  # the slots' own state, never touched here
    slots_state = [t.clone() for name in drafter.slot_state for t in _tensors(getattr(drafter, name))]
    eager = DrafterPrefill(drafter, host, max_len=max_len, mode="eager")
    fast = DrafterPrefill(drafter, host, max_len=max_len, mode=mode)
    assert fast.mode == mode and eager.mode == "eager"
    for n, P in ((3, 128), (1, 64), (3, 64)):
        tokens, plen = (t.to(device) for t in _prompts(host, n, P))
        _, hidden, features = host_prefill(tokens, plen)
        seq = torch.zeros(n, max_len, dtype=torch.long, device=device)
        seq[:, : tokens.shape[1]] = tokens
        seq.scatter_(1, plen.unsqueeze(1), torch.full((n, 1), 7, device=device))  # a first new token after each
        parts = []
        for run in (eager, fast):
            sub = DraftState(seq=seq.clone(), seq_len=plen + 1, seeds=torch.arange(n, device=device),
                             rounds=torch.zeros_like(plen), sampling=GREEDY)
            parts.append({name: [t.clone() for t in _tensors(part)]
                          for name, part in run(features, plen, sub).items()})
        assert parts[0].keys() == parts[1].keys() == set(drafter.slot_state)
        for name in drafter.slot_state:
            for want, got in zip(parts[0][name], parts[1][name]):
                assert got.shape == want.shape
                torch.testing.assert_close(got, want, msg=f"{drafter.name}.{name}, {n} arrivals, {mode}")
    assert sorted(fast.shapes) == [(1, 64), (4, 64), (4, 128)] and not eager.shapes
    assert fast.graphs == (3 if mode == "graph" else 0)
    after = [t for name in drafter.slot_state for t in _tensors(getattr(drafter, name))]
    assert all(torch.equal(a, b) for a, b in zip(after, slots_state))


@pytest.mark.parametrize("drafter_name", ["dspark-trained", "eagle3", "mtp"])
def test_static_drafter_prefill_equals_as_called(tiny_host, drafter_name):
    check_drafter_prefill(tiny_host, drafter_of(drafter_name, tiny_host), "static")


def test_drafter_prefill_refuses_nonzero_begin_state(tiny_host, monkeypatch):
    drafter = drafter_of("eagle3", tiny_host)
    drafter.begin(host=tiny_host, batch_size=2, max_len=96)
    real = type(drafter).begin

    def begin(self, **kw):
        real(self, **kw)
        self.last_hidden.fill_(1.0)

    monkeypatch.setattr(type(drafter), "begin", begin)
    with pytest.raises(ValueError, match=r"begin\(\) state is not all zeros"):
        DrafterPrefill(drafter, tiny_host, max_len=96, mode="static")
    assert DrafterPrefill(drafter, tiny_host, max_len=96, mode="eager").mode == "eager"  # as called: no check
    with pytest.raises(ValueError, match="prefill mode"):
        DrafterPrefill(drafter, tiny_host, max_len=96, mode="fast")
