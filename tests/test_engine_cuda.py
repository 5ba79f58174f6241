"""The slot engine's CUDA-graph rounds against its eager rounds, on a CUDA device (skipped without one, so in CI).

fp32 tiny host: for every drafter, greedy and sampled, continuous batching with graphs replayed gives every request
the tokens the eager loop gives it decoding alone; the graphs are captured once per run and verify width: a
propose graph with a capturable drafter and verifier, and a verify and an accept graph for each width the rounds
used; rounds overlap (each launched before the last one is committed). Run on a GPU machine
with `pytest tests/test_engine_cuda.py`.
"""
from __future__ import annotations

import pytest
import torch

from drafters import DRAFTERS
from dspark.engine.decode import generate
from dspark.engine.host import Host
from dspark.engine.sampling import SamplingConfig
from tests.conftest import random_prompts, tiny_model
from tests.test_decode import K, build_any

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

LIMITS = [10, 4, 14, 6, 12, 3]


@pytest.fixture(scope="module")
def cuda_host():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    # eager layers: these tests check the rounds against the eager loop (the compiled layers and drafters, the
    # default on CUDA, have test_compiled_layers_in_captured_rounds_equal_eager; compiling per test is slow)
    return Host(tiny_model("llama").to("cuda"), name="tiny-llama-cuda", compile=False)


@pytest.mark.parametrize("sampling", [SamplingConfig(), SamplingConfig(temperature=1.0)], ids=["greedy", "T1"])
@pytest.mark.parametrize("name", ["none"] + sorted(DRAFTERS))
def test_graph_rounds_equal_eager_solo(cuda_host, name, sampling, tmp_path):
    drafter = None if name == "none" else build_any(name, cuda_host, tmp_path)
    if drafter is not None and isinstance(drafter, torch.nn.Module):
        drafter = drafter.to("cuda")
    prompts = random_prompts([5, 1, 12, 7, 3, 9], cuda_host.vocab_size, seed=5)
    seeds = [500 + 7 * i for i in range(6)]
    got = generate(cuda_host, prompts, drafter=drafter, draft_length=K, max_new_tokens=LIMITS, sampling=sampling,
                   seeds=seeds, concurrency=2, graphs=True)
    used = set(got.engine["widths"])  # verify widths (L + 1) the rounds ran at, each captured on first use
    # verify-all is capturable: the propose stage is captured too (plain decoding has none to capture)
    whole = drafter is not None and drafter.capturable
    # one per (arrivals, prompt width) shape (6 arrivals, 1 or 2 at a time), and as many of the drafter's admission
    # where it is captured too (dspark.engine.prefill.DrafterPrefill)
    prefills = got.engine["prefill_graphs"]
    per_shape = 2 if getattr(drafter, "admit_capturable", False) else 1
    assert prefills % per_shape == 0 and 1 <= prefills // per_shape <= 4
    assert got.engine["graphs"] == 2 * len(used) + whole + prefills and got.batches > 1
    if name in ("mtp", "ngram"):  # proposals shorter than K: narrower forwards than K + 1
        assert min(used) < K + 1
    # each round launched before the last one was committed (serve.overlap_allowed; n-gram: once its copy is read)
    assert got.engine["overlapped"]
    for i, p in enumerate(prompts):
        alone = generate(cuda_host, [p], drafter=drafter, draft_length=K, max_new_tokens=LIMITS[i],
                         sampling=sampling, seeds=[seeds[i]], engine="eager")
        assert got.token_ids[i] == alone.token_ids[0], f"{name}: request {i}"


@pytest.mark.parametrize("name", ["dspark", "eagle3", "small-lm", "ngram"])
def test_plain_rounds_in_captured_runs_equal_eager(cuda_host, name, tmp_path):
    """Rounds the verifier does not draft in (Verifier.draft_next) replay the width-0 graphs over a draft that
    proposes nothing: the tokens of the eager loop, static batch, greedy and sampled."""
    from tests.test_draft_gate import EveryThird

    from dspark.engine import serve

    drafter = build_any(name, cuda_host, tmp_path)
    if isinstance(drafter, torch.nn.Module):
        drafter = drafter.to("cuda")
    prompts = random_prompts([5, 1, 12, 7], cuda_host.vocab_size, seed=5)
    # overlapped, the gate hears of each round one round later and drafts in other rounds than the eager loop:
    # greedy tokens are still the same, sampled ones are compared with the rounds in order
    for sampling, devices in ((SamplingConfig(), ("cuda",)), (SamplingConfig(temperature=1.0), ())):
        runs = []
        for engine, graphs in (("eager", None), ("slots", True)):
            with pytest.MonkeyPatch.context() as m:
                m.setattr(serve, "OVERLAP_DEVICES", devices)
                runs.append(generate(cuda_host, prompts, drafter=drafter, verifier=EveryThird(), draft_length=K,
                                     max_new_tokens=12, sampling=sampling, seeds=[1, 2, 3, 4], engine=engine,
                                     graphs=graphs))
        assert runs[0].token_ids == runs[1].token_ids and 1 in runs[1].engine["widths"]
        assert runs[1].engine["overlapped"] == bool(devices)


@pytest.mark.parametrize("name",
                         ["none", "dspark", "dflash", "eagle3", "eagle3-vocab", "mtp", "ngram", "small-lm"])
def test_compiled_layers_in_captured_rounds_equal_eager(name, tmp_path):
    """torch.compile'd host layers and drafter propose / observe (dspark.engine.compiled, the default on CUDA)
    inside the captured graphs: greedy tokens of the eager loop over the same host with its eager layers (fp32, no
    TF32)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    model = tiny_model("qwen2").to("cuda")
    plain, fast = Host(model, name="eager-layers", compile=False), Host(model, name="compiled", compile=True)
    drafter = None if name == "none" else build_any(name, plain, tmp_path)
    if drafter is not None and isinstance(drafter, torch.nn.Module):
        drafter = drafter.to("cuda")
    # the small LM steps through its own Host, compiled as the host it is built for: the captured run gets one built
    # on the compiled host (the same saved weights), or its compiled propose would go untested (it once recompiled
    # inside the capture: its warm-ups attended a bucketed prefix, the capture the whole cache)
    fast_drafter = build_any(name, fast, tmp_path) if name == "small-lm" else drafter
    prompts = random_prompts([5, 1, 12, 7, 3, 9], plain.vocab_size, seed=5)
    got = generate(fast, prompts, drafter=fast_drafter, draft_length=K, max_new_tokens=LIMITS, concurrency=2,
                   graphs=True)
    want = generate(plain, prompts, drafter=drafter, draft_length=K, max_new_tokens=LIMITS, engine="eager")
    assert got.token_ids == want.token_ids


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_compiled_step_writes_the_cache_as_the_eager_layers_on_cuda(kind):
    """The compiled step's KV write (an index_put_ inside the compiled pieces) and its packed attention output on
    CUDA (triton kernels, cuDNN's SDPA layouts): hidden states, taps and the whole cache as the eager layers'."""
    from tests.test_compiled import _ragged_steps

    torch.backends.cuda.matmul.allow_tf32 = False
    host = Host(tiny_model(kind).to("cuda"), name=kind, compile=False)
    for attend in (None, 16):
        ref = _ragged_steps(host, False, attend)
        got = _ragged_steps(host, True, attend)
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["dspark", "small-lm"])
def test_graph_mode_profiles_replayed_steps(cuda_host, name, tmp_path):
    """`profile` and `profile_draft` in their CUDA default time captured graphs, as the slot engine runs them:
    positive and recorded as mode "graph" (eager on request). No timing comparison: speed claims live in the
    benchmarks, and graph against eager timings are unreliable on a GPU shared with other work."""
    from verifiers.cost_model import profile, profile_draft

    drafter = build_any(name, cuda_host, tmp_path)
    if isinstance(drafter, torch.nn.Module):
        drafter = drafter.to("cuda")
    kw = dict(batch_sizes=[1, 4], repeats=5, warmup=2, context=32)
    graph, eager = (profile(cuda_host, tokens_per_request=[1, K + 1], mode=m, **kw) for m in ("auto", "eager"))
    assert graph.mode == "graph" and eager.mode == "eager"
    assert all(s > 0 for s in graph.sps + eager.sps) and len(graph.sps) == len(eager.sps)
    entries = [profile_draft(cuda_host, drafter, draft_length=K, mode=m, **kw) for m in ("auto", "eager")]
    assert entries[0]["mode"] == "graph" and entries[1]["mode"] == "eager"
    assert all(s > 0 for entry in entries for s in entry["seconds"])


def test_lookahead_on_a_smollm2_sized_host_keeps_the_packed_output(tmp_path, monkeypatch):
    """A SmolLM2-shaped host (random weights, its 49k vocabulary: graph temporaries of a real size) with n-gram
    drafts, the lookahead's propose replayed after accept: every round's packed output (what the CPU commits) says
    what the device committed, and every request gets its whole budget. Without a pool of its own for the
    propose graph, its replay can overwrite the packed output before the copy reads it (a device-side index error
    in a later request)."""
    from dspark.engine import graphs
    from dspark.engine.models import load_host
    from dspark.engine.round import N_ACCEPTED

    rounds, disagree = [0], [0]
    replay = graphs.GraphRound.__call__

    def checked(self, drafting=True, ahead=None):
        # a slot whose budget is spent commits nothing (round.accept) while the CPU, a round behind under overlap,
        # has not retired it yet: its output row is nobody's, as serve's commit treats it
        seq_len, live = self.slots.state.seq_len.clone(), self.slots.active & (self.slots.remaining > 0)
        out, draft, L = replay(self, drafting, ahead)
        grew = (self.slots.state.seq_len - seq_len)[live]
        rounds[0] += 1
        disagree[0] += int((grew != (out[:, self.K + 1 + N_ACCEPTED] + 1)[live]).sum())
        return out, draft, L

    monkeypatch.setattr(graphs.GraphRound, "__call__", checked)
    torch.backends.cuda.matmul.allow_tf32 = False
    host = load_host("random:smollm2", dtype="float32", device="cuda", compile=False)
    ngram = build_any("ngram", host, tmp_path)
    base = random_prompts([24, 40, 9, 31], host.vocab_size, seed=3)
    prompts = [p + p[: len(p) // 2] + p for p in base]  # repeats: the n-gram drafter finds matches
    for C in (1, 3):
        got = generate(host, prompts, drafter=ngram, draft_length=K, max_new_tokens=48, concurrency=C, graphs=True)
        assert got.engine["widths"] and max(got.engine["widths"]) > 1  # drafts were verified
        assert rounds[0] > 0 and disagree[0] == 0, f"C={C}: {disagree[0]} rows of {rounds[0]} rounds"
        assert [len(t) for t in got.token_ids] == [48] * len(prompts)
    # token equality with the eager loop is test_graph_rounds_equal_eager_solo's (a tiny host, whose logits have no
    # near-ties between the two paths' roundings; this random 30-layer host's nearly flat logits could have some)


@pytest.mark.parametrize("name", ["none", "dspark", "eagle3", "mtp", "ngram"])
def test_admission_and_retirement_wait_on_nothing_the_device_runs(cuda_host, name, tmp_path):
    """Admitting requests (their prefill, first tokens, the drafter's admission) and retiring them queue work
    behind whatever the stream is running without waiting for it (serve's overlap: a round launched before them
    keeps running), and the first tokens read afterwards are the prefill's."""
    from dspark.engine.slots import Request, Slots
    from verifiers import build_verifier

    drafter = build_any(name, cuda_host, tmp_path) if name != "none" else None
    if isinstance(drafter, torch.nn.Module):
        drafter = drafter.to("cuda")
    from dspark.engine.protocol import NoDrafter

    drafter = drafter or NoDrafter()
    verifier = build_verifier("full")
    verifier.bind(drafter=drafter, K=K)
    slots = Slots(cuda_host, drafter, verifier, capacity=4, max_len=64, sampling=SamplingConfig(), prefill="graph")
    prompts = random_prompts([5, 9, 3], cuda_host.vocab_size, seed=2)
    requests = [Request(index=i, prompt=p, limit=8, seed=i) for i, p in enumerate(prompts)]
    slots.admit([0, 1], requests[:2])  # the shapes' first use captures (a synchronising warm-up), outside the check
    slots.retire([0, 1])
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU work queued ahead of the admission
    first = slots.admit([2, 3], requests[:2])
    slots.retire([3])
    assert not torch.cuda.current_stream().query(), "admission or retirement waited for the device"
    alone = Slots(cuda_host, drafter, verifier, capacity=2, max_len=64, sampling=SamplingConfig())
    expected = alone.admit([0, 1], requests[:2])
    assert first.cpu().tolist() == expected.cpu().tolist()
    assert first[:, 1].all()  # finite prefill logits


@pytest.mark.parametrize("name", ["dspark", "eagle3", "mtp"])
def test_captured_drafter_admission_equals_as_called(cuda_host, name, tmp_path):
    """The drafter's admission replayed as a CUDA graph per arrival shape (dspark.engine.prefill.DrafterPrefill)
    leaves the state rows that begin + observe + prefill as called leave."""
    from tests.test_prefill import check_drafter_prefill

    check_drafter_prefill(cuda_host, build_any(name, cuda_host, tmp_path).to("cuda"), "graph")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_attention_runs_without_the_math_backend(dtype):
    """The fused host layers' masked grouped-query attention (dspark.engine.attention) runs in SDPA's fused
    kernels: with the math backend disallowed the step still runs (SDPA's own enable_gqa with a mask would not),
    and it equals the step through the host's modules."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from tests.conftest import tiny_model

    host = Host(tiny_model("llama").to(device="cuda", dtype=dtype), name="tiny-llama-cuda", compile=False)
    assert host.num_heads > host.num_kv_heads  # grouped
    tokens = torch.tensor(random_prompts([9, 9], host.vocab_size, seed=4), device="cuda")
    cache = host.new_cache(2, 64)
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION]):
        got = host.step(cache, tokens, torch.tensor([9, 6], device="cuda"), fused=True).hidden
    want = host.step(host.new_cache(2, 64), tokens, torch.tensor([9, 6], device="cuda"), fused=False).hidden
    tol = 1e-4 if dtype == torch.float32 else 0.05
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("widths", [1, 3], ids=["backlog-1-width", "backlog-3-widths"])
@pytest.mark.parametrize("name", ["dspark", "eagle3"])
def test_gated_backlog_in_captured_rounds_equals_an_observe_per_round(cuda_host, tmp_path, monkeypatch, name,
                                                                      widths):
    """The scheduler's draft gate with DSpark or EAGLE-3 in captured, overlapped rounds: plain rounds keep their
    features in the backlog (its width-0 accept graph and flush graphs, graphs.defers_observe; a flush observes
    its verify widths in one call), and every round drafts and accepts what it does when the drafter observes each
    round (fp32, greedy), with the same tokens."""
    import dspark.engine.graphs as runners
    from verifiers import build_verifier
    from verifiers.cost_model import CostModel

    monkeypatch.setattr(runners, "backlog_rounds", lambda K: widths * (K + 1))  # small, so that it fills
    drafter = build_any(name, cuda_host, tmp_path).to("cuda")
    prompts = random_prompts([5, 1, 12, 7, 3, 9], cuda_host.vocab_size, seed=5)
    cost = CostModel.from_points({1: 50.0, 4: 48.0, 64: 10.0})
    runs = []
    for defer in (True, False):
        with pytest.MonkeyPatch.context() as m:
            if not defer:
                m.setattr(runners, "defers_observe", lambda *a: False)
            runs.append(generate(cuda_host, prompts, drafter=drafter, draft_length=K, max_new_tokens=LIMITS,
                                 verifier=build_verifier("scheduler", cost_table=cost), concurrency=2, graphs=True))
    assert 0 < runs[0].engine["drafted_rounds"] < runs[0].rounds and runs[0].engine["overlapped"]
    assert runs[0].token_ids == runs[1].token_ids
    for column in ("accepted", "verified"):
        assert runs[0].log.column(column).tolist() == runs[1].log.column(column).tolist(), column


def test_captured_rounds_tell_the_gate_the_eager_loops_expectation(cuda_host, tmp_path):
    """The packed output's EXPECTED column from captured rounds (DSpark's confidence head, random weights) equals
    the eager loop's expectation every round: what the confidence-priced draft gate reads on CUDA
    (test_draft_gate has the CPU twin)."""
    from tests.test_draft_gate import heard_expectations

    drafter = build_any("dspark", cuda_host, tmp_path).to("cuda")
    eager_ids, eager = heard_expectations(cuda_host, drafter, "eager")
    fast_ids, fast = heard_expectations(cuda_host, drafter, "slots", graphs=True)
    assert eager_ids == fast_ids and len(eager) == len(fast) > 1
    assert all(e is not None for e in fast) and any(e > 0 for e in fast)
    assert fast == pytest.approx(eager, abs=1e-3)
