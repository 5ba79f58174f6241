"""Compiled host layers (dspark.engine.compiled): the same step as the eager layers, and the same tokens.

fp32 on the CPU, where inductor generates C++; the GPU run times them (benchmarks/speed.py --compile). Each
compilation takes seconds here, so the hosts are tiny and the shapes few.
"""
from __future__ import annotations

import pytest
import torch

import dspark.engine.compiled as compiled_module
from dspark.engine.decode import generate
from dspark.engine.host import Host
from dspark.engine.sampling import SamplingConfig
from tests.conftest import random_prompts, tiny_model
from tests.test_decode import K, build_any
from verifiers import build_verifier

pytestmark = pytest.mark.skipif(not hasattr(torch, "compile"), reason="torch.compile unavailable")


def _ragged_steps(host: Host, compiled: bool, attend):
    """A prefill (never compiled), then a 4-wide ragged decode step with taps: (hidden, features, keys, values),
    on the host's device (tests/test_engine_cuda.py runs it on CUDA)."""
    device = host.device
    prompts = torch.tensor(random_prompts([9, 9, 9], host.vocab_size, seed=4), device=device)
    cache = host.new_cache(3, 48)
    host.step(cache, prompts, torch.tensor([9, 6, 2], device=device), attend=9, compiled=False)
    cache.advance(torch.tensor([9, 6, 2], device=device))
    draft = torch.tensor(random_prompts([4, 4, 4], host.vocab_size, seed=5), device=device)
    out = host.step(cache, draft, torch.tensor([4, 1, 3], device=device), taps=(0, 2), attend=attend,
                    compiled=compiled)
    return out.hidden, out.features, cache.k.clone(), cache.v.clone()


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_compiled_step_equals_the_eager_layers(kind):
    host = Host(tiny_model(kind), name=kind)
    for attend in (None, 16):  # the graphs' whole cache, and the eager loop's window
        ref = _ragged_steps(host, False, attend)
        got = _ragged_steps(host, True, attend)
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_compile_flag_routes_decode_steps_only(monkeypatch):
    """With Host.compile, decode-sized steps run compiled; prefills and wider steps run the eager layers."""
    host = Host(tiny_model("llama"), name="tiny", compile=True)
    calls = []
    real = compiled_module.CompiledLayers.run
    monkeypatch.setattr(compiled_module.CompiledLayers, "run",
                        lambda self, h, x, *a: calls.append(x.shape[1]) or real(self, h, x, *a))
    prompts = random_prompts([20, 6], host.vocab_size, seed=2)
    generate(host, prompts, draft_length=K, max_new_tokens=4, engine="eager")
    assert calls and set(calls) == {1}  # plain decoding: one token per step; both prefills eager
    cache = host.new_cache(1, 64)
    host.step(cache, torch.zeros(1, compiled_module.COMPILE_MAX_T + 1, dtype=torch.long), torch.tensor([17]))
    assert set(calls) == {1}


def test_compiled_host_decodes_the_same_tokens():
    """The slot engine over a compiled host commits what the eager loop over the plain host commits (greedy, every
    request of a continuous batch), and sampled output with the same seeds too."""
    model = tiny_model("qwen2")
    plain, fast = Host(model, name="plain"), Host(model, name="fast", compile=True)
    prompts = random_prompts([5, 12, 7, 3], plain.vocab_size, seed=5)
    for sampling in (SamplingConfig(), SamplingConfig(temperature=1.0)):
        outs = []
        for host, engine in ((plain, "eager"), (fast, "slots")):
            drafter = build_any("ngram", host, None)
            outs.append(generate(host, prompts, drafter=drafter, verifier=build_verifier("full"), draft_length=K,
                                 max_new_tokens=[8, 5, 10, 6], sampling=sampling, seeds=[1, 2, 3, 4], engine=engine,
                                 concurrency=2 if engine == "slots" else None).token_ids)
        assert outs[0] == outs[1]


def test_unsupported_host_is_refused_with_the_reason():
    model = tiny_model("llama")
    model.config.hidden_act = "gelu"
    with pytest.raises(ValueError, match="gelu-host.*activation 'gelu'"):
        Host(model, name="gelu-host", compile=True)


def test_compilations_do_not_grow_with_the_step_shapes():
    """Nine step shapes (rows x verify widths) compile each of the four pieces (the inputs, the first, middle and last
    layer pieces) a few times, not once per shape."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    host = Host(tiny_model("llama"), name="tiny", compile=True)
    for B in (2, 3, 5):
        for T in (2, 4, 8):
            host.step(host.new_cache(B, 48), torch.zeros(B, T, dtype=torch.long), torch.full((B,), T))
    assert 4 <= counters["stats"]["unique_graphs"] <= 12  # static: 36


@pytest.mark.parametrize("name", ["ngram", "dspark", "dflash", "eagle3", "eagle3-vocab", "mtp"])
def test_compiled_propose_decodes_the_same_tokens(name):
    """A compiled host compiles the drafter's propose too (greedy): the slot engine then commits, for every request
    of a continuous batch, the tokens of the eager loop over the plain host; sampled runs keep the eager propose."""
    model = tiny_model("llama")
    plain, fast = Host(model, name="plain"), Host(model, name="fast", compile=True)
    prompts = random_prompts([5, 12, 7], plain.vocab_size, seed=6)
    drafter = build_any(name, plain, None)  # one drafter object: the same weights on both hosts (same modules)
    want = generate(plain, prompts, drafter=drafter, draft_length=K, max_new_tokens=[9, 6, 11],
                    engine="eager").token_ids
    got = generate(fast, prompts, drafter=drafter, draft_length=K, max_new_tokens=[9, 6, 11], concurrency=2,
                   graphs="static")
    assert got.token_ids == want
    assert {"_compiled_propose", "_compiled_observe"} <= set(vars(drafter))  # the compiled paths ran
    from dspark.engine import round as round_module

    assert round_module._commit in compiled_module._COMPILED  # and the compiled acceptance and commit
    assert int(got.log.column("proposed").sum()) > 0
    assert compiled_module.drafter_fn(drafter, "propose", fast, greedy=False) == drafter.propose  # sampled: eager
    assert compiled_module.drafter_fn(drafter, "propose", plain) == drafter.propose  # an eager host: eager


def test_compile_defaults_to_cuda_only(monkeypatch):
    """Host(compile=None), the default, compiles on CUDA only (where triton is there); True / False force it."""
    model = tiny_model("llama")
    assert not Host(model).compiling  # a CPU host
    assert Host(model, compile=True).compiling and not Host(model, compile=False).compiling
    monkeypatch.setattr(Host, "device", property(lambda self: torch.device("cuda")))  # as a CUDA host sees it
    assert Host(model).compiling == compiled_module.HAS_TRITON
    assert not Host(model, compile=False).compiling


def test_small_lm_drafter_is_not_compiled_whole(tmp_path):
    """The small-LM drafter's steps are its own Host's (compiled piecewise with the host): never compiled whole."""
    host = Host(tiny_model("llama"), name="tiny", compile=True)
    drafter = build_any("small-lm", host, tmp_path)
    assert drafter.lm.compiling  # its LM runs as the host runs
    for method in ("propose", "observe"):
        assert compiled_module.drafter_fn(drafter, method, host) == getattr(drafter, method)


def test_cache_writes_traced_by_compile_equal_the_eager_scatter():
    """KVCache.write traced by torch.compile (an index_put_ on the whole cache, dspark.engine.kv_cache.index_write)
    leaves the cache exactly as the eager scatter does, for every layer and ragged positions."""
    from dspark.engine.kv_cache import KVCache

    def writes(cache, k, v, positions):
        for layer in range(3):
            cache.write(layer, k + layer, v - layer, positions + layer)
        return k.sum()

    caches = [KVCache(num_layers=3, batch_size=2, num_kv_heads=3, max_len=32, head_dim=8, dtype=torch.float32,
                      device="cpu") for _ in range(2)]
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, 3, 4, 8, generator=g), torch.randn(2, 3, 4, 8, generator=g)
    positions = torch.tensor([[3, 4, 5, 6], [10, 11, 12, 13]])
    writes(caches[0], k, v, positions)
    torch.compile(writes)(caches[1], k, v, positions)
    assert torch.equal(caches[0].k, caches[1].k) and torch.equal(caches[0].v, caches[1].v)
    assert caches[1].k.abs().sum() > 0


def test_repeated_runs_reuse_the_compilations():
    """Every generate() builds new slots, caches and buffers: the compiled pieces (host layers, the drafter's
    propose and observe, the commit) must not recompile for them, or a long sweep would hit dynamo's recompile limit
    and fall back to eager code without a word."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    host = Host(tiny_model("llama"), name="tiny", compile=True)
    drafter = build_any("dspark", host, None)
    prompts = random_prompts([5, 12, 7], host.vocab_size, seed=6)
    graphs = []
    for _ in range(3):
        generate(host, prompts, drafter=drafter, draft_length=K, max_new_tokens=[9, 6, 11], concurrency=2,
                 graphs="static")
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] > 0 and graphs[0] == graphs[1] == graphs[2]
