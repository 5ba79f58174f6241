"""Soak and determinism of the decode loop on the tiny host (CPU, fp32).

Fuzz: a few hundred random requests (prompt lengths, per-request max_new_tokens <= 12, stop tokens, batch sizes,
draft lengths) over every drafter (untrained ngram / dspark / dflash / eagle3 / mtp) x every policy (full / threshold /
scheduler / lagged), grouped in batches; greedy output must equal plain decoding token for token (finish
reasons too), and sampled runs must finish without exception within their limits. Then one long batch with mixed
stop conditions, and the determinism guarantees of docs/RELIABILITY.md (same seed, same output; batch invariance;
`dspark.set_deterministic`).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from conftest import random_prompts, with_draft_price

from drafters import build_drafter
import dspark
from dspark.engine.decode import generate
from dspark.engine.sampling import SamplingConfig
from verifiers import build_verifier
from verifiers.cost_model import CostModel

DRAFTERS = ("ngram", "dspark", "dflash", "eagle3", "mtp")
POLICIES = ("full", "threshold", "scheduler", "lagged")
BATCHES_PER_COMBINATION = 4  # x 20 combinations x ~4.5 requests per batch: ~360 greedy cases


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """why: these forwards are tiny; two intra-op threads on a busy 2-core machine spin-wait each other and run
    tens of times slower than one."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def drafters(tiny_host):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # untrained on purpose: low acceptance exercises rejections
        return {name: build_drafter(name, tiny_host) for name in DRAFTERS}


def random_verifier(name: str, g: torch.Generator, drafter, K: int):
    if name == "threshold":
        return build_verifier(name, threshold=[0.0, 0.2, 0.5, 0.9, 1.0][int(torch.randint(5, (1,), generator=g))])
    if name in ("scheduler", "lagged"):
        # a random cost curve: flat up to a knee, then slower; sometimes steep enough to trim verification to 0
        knee = int(torch.randint(1, 40, (1,), generator=g))
        sps = 100.0 * float(torch.rand(1, generator=g)) + 1.0
        table = CostModel.from_points({1: sps, knee + 1: sps * 0.9, knee + 64: sps * 0.05})
        return build_verifier(name, cost_table=with_draft_price(table, drafter, K, 0.5 / sps))  # half a step
    return build_verifier(name)


def random_batch(g: torch.Generator, vocab: int, max_draft_length: int = 7) -> dict:
    n = int(torch.randint(1, 9, (1,), generator=g))
    lengths = torch.randint(1, 25, (n,), generator=g).tolist()
    stops = torch.randint(0, vocab, (int(torch.randint(0, 4, (1,), generator=g)),), generator=g).tolist()
    return dict(prompts=random_prompts(lengths, vocab, seed=int(torch.randint(1 << 30, (1,), generator=g)),
                                       repeat=bool(torch.rand(1, generator=g) < 0.7)),
                max_new_tokens=torch.randint(1, 13, (n,), generator=g).tolist(), stop_token_ids=stops,
                batch_size=int(torch.randint(1, n + 1, (1,), generator=g)),
                draft_length=int(torch.randint(1, max_draft_length + 1, (1,), generator=g)))


def test_fuzz_greedy_equals_plain_decoding(tiny_host, drafters):
    g = torch.Generator().manual_seed(2024)
    cases = 0
    for drafter_name in DRAFTERS:
        for policy in POLICIES:
            for _ in range(BATCHES_PER_COMBINATION):
                case = random_batch(g, tiny_host.vocab_size)
                K = case.pop("draft_length")
                plain = generate(tiny_host, **case)
                spec = generate(tiny_host, **case, drafter=drafters[drafter_name],
                                verifier=random_verifier(policy, g, drafters[drafter_name], K), draft_length=K)
                where = f"{drafter_name}/{policy} draft_length={K} {case}"
                assert spec.token_ids == plain.token_ids, where
                assert spec.finish_reasons == plain.finish_reasons, where
                for ids, limit, reason in zip(spec.token_ids, case["max_new_tokens"], spec.finish_reasons):
                    assert 1 <= len(ids) <= limit
                    assert reason == ("stop" if ids[-1] in case["stop_token_ids"] else "length"), where
                    assert reason == "stop" or len(ids) == limit, where
                accepted, verified = spec.log.column("accepted"), spec.log.column("verified")
                assert bool((accepted <= verified).all()) and bool((verified <= K).all()), where
                cases += len(case["prompts"])
    assert cases >= 300


@pytest.mark.parametrize("drafter_name", DRAFTERS)
def test_fuzz_sampling_never_fails(tiny_host, drafters, drafter_name):
    g = torch.Generator().manual_seed(7 + DRAFTERS.index(drafter_name))
    for policy in POLICIES:
        case = random_batch(g, tiny_host.vocab_size)
        K = case.pop("draft_length")
        sampling = SamplingConfig(temperature=[0.5, 1.0, 1.5][int(torch.randint(3, (1,), generator=g))],
                                  top_p=[1.0, 0.9, 0.5][int(torch.randint(3, (1,), generator=g))],
                                  top_k=[0, 5][int(torch.randint(2, (1,), generator=g))])
        out = generate(tiny_host, **case, drafter=drafters[drafter_name],
                       verifier=random_verifier(policy, g, drafters[drafter_name], K),
                       draft_length=K, sampling=sampling, seed=int(torch.randint(1000, (1,), generator=g)))
        for ids, limit, reason in zip(out.token_ids, case["max_new_tokens"], out.finish_reasons):
            assert 1 <= len(ids) <= limit and all(0 <= t < tiny_host.vocab_size for t in ids)
            assert reason == "stop" or len(ids) == limit
            assert all(t not in case["stop_token_ids"] for t in ids[:-1])  # nothing after a stop token


def test_long_batch_with_mixed_stop_conditions(tiny_host, drafters):
    """48 requests in batches of 16: per-request limits 1..40, a stop token set, and a streaming callback that
    ends some requests early; greedy speculative output equals plain decoding and the stream is the output.

    The callback sees a round's tokens at once, so a request it ends may run a few tokens past its rule under
    speculation: those requests are compared as prefixes."""
    g = torch.Generator().manual_seed(11)
    n = 48
    prompts = random_prompts(torch.randint(1, 40, (n,), generator=g).tolist(), tiny_host.vocab_size, seed=5)
    limits = torch.randint(1, 41, (n,), generator=g).tolist()
    plain_free = generate(tiny_host, prompts, max_new_tokens=limits, stop_token_ids=[])
    # stop tokens that some requests actually produce: tokens from a few of the unstopped outputs
    stops = {plain_free.token_ids[i][len(plain_free.token_ids[i]) // 2] for i in range(0, n, 7)}

    def external(i, ids, seen):  # an external rule: request i (i % 5 == 0) ends after 6 tokens
        seen[i].extend(ids)
        return i % 5 == 0 and len(seen[i]) >= 6

    results = []
    table = with_draft_price(CostModel.from_points({1: 50.0, 48: 40.0, 400: 4.0}), drafters["dspark"], 5, 0.004)
    for drafter, verifier in [(None, None), (drafters["dspark"], build_verifier("scheduler", cost_table=table)),
                              (drafters["ngram"], build_verifier("full"))]:
        seen = {i: [] for i in range(n)}
        out = generate(tiny_host, prompts, drafter=drafter, verifier=verifier, draft_length=5, max_new_tokens=limits,
                       stop_token_ids=stops, batch_size=16, on_tokens=lambda i, ids, s=seen: external(i, ids, s))
        assert [seen[i] for i in range(n)] == out.token_ids  # streamed exactly what was returned
        for i, (ids, reason) in enumerate(zip(out.token_ids, out.finish_reasons)):
            assert 1 <= len(ids) <= limits[i]
            stopped_by_token = ids[-1] in stops
            assert all(t not in stops for t in ids[:-1])
            if i % 5 == 0 and reason == "stop" and not stopped_by_token:
                assert len(ids) >= 6  # the external rule
            elif not stopped_by_token:
                assert reason == "length" and len(ids) == limits[i]
        assert out.batches == 3
        results.append(out)
    plain = results[0]
    for out in results[1:]:
        for i in range(n):
            if i % 5:
                assert out.token_ids[i] == plain.token_ids[i] and out.finish_reasons[i] == plain.finish_reasons[i]
            else:
                short = min(len(out.token_ids[i]), len(plain.token_ids[i]))
                assert out.token_ids[i][:short] == plain.token_ids[i][:short]
                assert short == min(len(plain.token_ids[i]), 6) or short == len(plain.token_ids[i])
    assert {"stop", "length"} <= set(plain.finish_reasons)


# ---- determinism ---------------------------------------------------------------------------------------------------
def _sampled(host, drafter, prompts, **kw):
    return generate(host, prompts, drafter=drafter, draft_length=4, max_new_tokens=10,
                    sampling=SamplingConfig(temperature=1.0, top_p=0.95), **kw)


def test_same_seed_same_outputs(tiny_host, drafters):
    prompts = random_prompts([3, 8, 13, 5], tiny_host.vocab_size, seed=9)
    first = _sampled(tiny_host, drafters["dspark"], prompts, seed=42)
    torch.manual_seed(12345)  # global RNG state plays no part: noise is counter-based
    torch.rand(100)
    again = _sampled(tiny_host, drafters["dspark"], prompts, seed=42)
    other = _sampled(tiny_host, drafters["dspark"], prompts, seed=43)
    assert again.token_ids == first.token_ids
    assert other.token_ids != first.token_ids


def test_batch_invariance_fp32(tiny_host, drafters):
    """A request's output depends on its prompt and seed only: alone, in a batch, with other companions, in
    another position of the batch and under another batch_size; sampled and greedy."""
    prompts = random_prompts([3, 8, 13, 5, 21, 2], tiny_host.vocab_size, seed=4)
    seeds = [100 + i for i in range(6)]
    for drafter in (None, drafters["dspark"], drafters["eagle3"]):
        together = _sampled(tiny_host, drafter, prompts, seeds=seeds).token_ids
        alone = [_sampled(tiny_host, drafter, [p], seeds=[s]).token_ids[0] for p, s in zip(prompts, seeds)]
        reversed_ = _sampled(tiny_host, drafter, prompts[::-1], seeds=seeds[::-1]).token_ids[::-1]
        split = _sampled(tiny_host, drafter, prompts, seeds=seeds, batch_size=4).token_ids
        assert together == alone == reversed_ == split
        greedy = generate(tiny_host, prompts, drafter=drafter, draft_length=4, max_new_tokens=10).token_ids
        assert greedy == [generate(tiny_host, [p], drafter=drafter, draft_length=4, max_new_tokens=10).token_ids[0]
                          for p in prompts]


@pytest.fixture
def restore_determinism(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    saved = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic,
             torch.backends.cudnn.benchmark, torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32,
             torch.get_float32_matmul_precision())
    yield
    torch.use_deterministic_algorithms(saved[0])
    (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark, torch.backends.cudnn.allow_tf32,
     torch.backends.cuda.matmul.allow_tf32) = saved[1:5]
    torch.set_float32_matmul_precision(saved[5])


def test_set_deterministic_switches_and_decodes(tiny_host, drafters, restore_determinism):
    prompts = random_prompts([4, 9], tiny_host.vocab_size, seed=2)
    before = _sampled(tiny_host, drafters["dspark"], prompts).token_ids
    dspark.set_deterministic()
    assert torch.are_deterministic_algorithms_enabled()
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    assert not torch.backends.cudnn.allow_tf32 and not torch.backends.cuda.matmul.allow_tf32
    assert torch.get_float32_matmul_precision() == "highest"
    # every op of the decode loop has a deterministic CPU kernel (it would raise otherwise), and fp32 CPU
    # decoding was deterministic already, so the outputs do not change
    assert _sampled(tiny_host, drafters["dspark"], prompts).token_ids == before
    dspark.set_deterministic(False)
    assert not torch.are_deterministic_algorithms_enabled() and torch.backends.cudnn.allow_tf32


def test_deterministic_flag_calls_the_switch_before_loading(monkeypatch):
    from dspark import api
    from dspark.cli import HostOptions, _host
    from dspark.config import parse

    calls = []
    monkeypatch.setattr(api, "set_deterministic", lambda enabled=True: calls.append("deterministic"))
    monkeypatch.setattr(api, "load_host", lambda *a, **k: calls.append("load") or "host")
    (opts,) = parse([HostOptions], ["--host", "random:tiny-llama", "--deterministic"])
    assert _host(opts) == "host" and calls == ["deterministic", "load"]
    (opts,) = parse([HostOptions], ["--host", "random:tiny-llama"])
    calls.clear()
    _host(opts)
    assert calls == ["load"]


_RUN = """
import json, sys, warnings
sys.path.insert(0, "tests")
warnings.simplefilter("ignore")
from conftest import tiny_model, random_prompts
from drafters import build_drafter
from dspark.engine.decode import generate
from dspark.engine.host import Host
from dspark.engine.sampling import SamplingConfig
host = Host(tiny_model("llama"), name="tiny")
out = generate(host, random_prompts([3, 8, 13], 128, seed=9), drafter=build_drafter("mtp", host), draft_length=3,
               max_new_tokens=10, sampling=SamplingConfig(temperature=1.0), seed=7)
print(json.dumps(out.token_ids))
"""


@pytest.mark.slow
def test_same_seed_same_outputs_across_processes():
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root)}
    runs = [subprocess.run([sys.executable, "-c", _RUN], cwd=root, env=env, capture_output=True, text=True,
                           check=True).stdout for _ in range(2)]
    assert json.loads(runs[0]) == json.loads(runs[1])
