"""SPS(M) tables (M tokens a forward): interpolation, persistence, validation, and the profiler against a fake host."""
from __future__ import annotations

import csv
import json
import time
from dataclasses import dataclass

import pytest
import torch

from dspark.engine.host import StepOutput
from verifiers.cost_model import CostModel, device_description, export_engine_json, profile


def test_interpolation_clamp_and_extrapolation():
    cost = CostModel.from_points({2: 100.0, 10: 20.0})
    assert cost(6) == pytest.approx(60.0)
    assert cost(2) == pytest.approx(100.0) and cost(10) == pytest.approx(20.0)
    assert cost(1) == pytest.approx(100.0)  # clamped below the first point
    assert cost(20) == pytest.approx(10.0)  # step time proportional to M past the last point
    M = torch.arange(1, 25)
    assert torch.allclose(cost(M), torch.tensor([cost(int(m)) for m in M], dtype=torch.float64))
    assert cost(M).dtype == torch.float64 and cost(M).shape == M.shape
    single = CostModel.from_points({4: 50.0})
    assert single(1) == 50.0 and single(8) == pytest.approx(25.0)
    flat = CostModel.flat(7.0)
    assert flat(1) == flat(5000) == 7.0


def test_validation():
    with pytest.raises(ValueError, match="strictly increasing"):
        CostModel(tokens=[4, 2], sps=[1.0, 2.0])
    with pytest.raises(ValueError, match="as many SPS"):
        CostModel(tokens=[1, 2], sps=[1.0])
    with pytest.raises(ValueError, match="> 0"):
        CostModel(tokens=[1, 2], sps=[1.0, 0.0])
    with pytest.raises(ValueError, match="mode"):
        CostModel(tokens=[1], sps=[1.0], mode="compiled")


def test_save_load_roundtrip_and_csv(tmp_path):
    cost = CostModel.from_points({1: 90.0, 8: 80.0, 64: 30.0}, host="tiny", device="cpu", dtype="torch.float32",
                                 mode="graph", date="2026-01-01T00:00:00+00:00", torch_version="2.13.0",
                                 batch_sizes=[1, 8, 64], tokens_per_request=[1],
                                 points=[{"batch_size": 1, "tokens_per_request": 1, "tokens": 1,
                                          "step_seconds": 1 / 90}])
    path = tmp_path / "cost.json"
    cost.save(path)
    doc = json.loads(path.read_text())
    assert doc["format"] == "dspark.cost_model" and doc["version"] == 1 and "_grids" not in doc
    back = CostModel.load(path, expect_host="tiny", expect_device=torch.device("cpu"))
    assert back == cost and back(30) == cost(30)
    cost.to_csv(tmp_path / "cost.csv")
    rows = list(csv.reader(open(tmp_path / "cost.csv")))
    assert rows[0] == ["tokens", "sps", "step_ms"] and len(rows) == 4 and float(rows[3][2]) == pytest.approx(1000 / 30)


def test_load_mismatch_errors(tmp_path):
    path = tmp_path / "cost.json"
    CostModel.from_points({1: 10.0}, host="qwen3-4b", device="cuda (NVIDIA H200)").save(path)
    with pytest.raises(ValueError, match="'qwen3-4b'.*'smollm2'"):
        CostModel.load(path, expect_host="smollm2")
    with pytest.raises(ValueError, match=r"'cuda \(NVIDIA H200\)'.*'cpu'"):
        CostModel.load(path, expect_device=torch.device("cpu"))
    assert CostModel.load(path, expect_device="cuda (NVIDIA H200)").host == "qwen3-4b"
    doc = json.loads(path.read_text())
    path.write_text(json.dumps({**doc, "gpu_clock": 1}))
    with pytest.raises(ValueError, match="unknown cost-table keys"):
        CostModel.load(path)
    path.write_text(json.dumps({**doc, "version": 2}))
    with pytest.raises(ValueError, match="version 1"):
        CostModel.load(path)


@dataclass
class FakeCache:
    lengths: torch.Tensor
    max_len: int

    def advance(self, n: torch.Tensor) -> None:
        self.lengths += n


class FakeHost:
    """The Host API the profiler times; a step sleeps 1 ms per token, plus 3 ms when T > 1."""

    name = "fake"
    device = torch.device("cpu")
    dtype = torch.float32
    vocab_size = 32

    def __init__(self):
        self.calls, self.attends = [], []

    def new_cache(self, batch_size: int, max_len: int) -> FakeCache:
        return FakeCache(lengths=torch.zeros(batch_size, dtype=torch.long), max_len=max_len)

    def step(self, cache: FakeCache, tokens: torch.Tensor, n_valid: torch.Tensor, *, attend: int | None = None):
        B, T = tokens.shape
        assert cache.lengths.shape == (B,) and n_valid.tolist() == [T] * B
        assert int(tokens.max()) < self.vocab_size
        self.calls.append((B, T))
        self.attends.append((cache.lengths.tolist(), attend))
        time.sleep(0.001 * B * T + (0.003 if T > 1 else 0.0))
        return StepOutput(hidden=torch.zeros(B, T, self.vocab_size), features=None)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        self.calls[-1] += ("logits",)  # the profiled step includes the LM head, as the engine's verify stage does
        return hidden


def test_profile_with_fake_host():
    host = FakeHost()
    cost = profile(host, batch_sizes=[1, 2], tokens_per_request=[1, 2], repeats=2, warmup=1, context=8)
    assert len(host.calls) == 4 * 3 and all(call[-1] == "logits" for call in host.calls)
    assert cost.tokens == [1, 2, 4]
    assert cost.host == "fake" and cost.device == device_description("cpu") == "cpu"
    assert cost.dtype == "torch.float32" and cost.mode == "eager" and cost.torch_version == torch.__version__
    assert cost.batch_sizes == [1, 2] and cost.tokens_per_request == [1, 2] and len(cost.points) == 4
    point = {(p["batch_size"], p["tokens_per_request"]): p for p in cost.points}
    # M = 2 arises from (R=1, T=2) and (R=2, T=1): the slower one (T=2 pays 3 ms more) enters the table
    assert cost(2) == pytest.approx(1.0 / point[1, 2]["step_seconds"])
    assert point[1, 2]["step_seconds"] > point[2, 1]["step_seconds"]
    assert cost.sps[0] > cost.sps[-1]
    assert cost.context == 8
    # every step sees `context` cached positions and attends them plus its own tokens, as decoding does
    assert {(tuple(lengths), attend) for lengths, attend in host.attends} == {
        ((8,), 9), ((8,), 10), ((8, 8), 9), ((8, 8), 10)}
    with pytest.raises(ValueError, match="context must be an integer"):
        profile(host, batch_sizes=[1], tokens_per_request=[1], context=-1)


def shaped_table(points: dict[tuple[int, int], float]) -> CostModel:
    """A table as `profile` builds it from {(R, T): step ms}: SPS(M) keeps the slowest shape of each M."""
    slowest: dict[int, float] = {}
    for (R, T), ms in points.items():
        slowest[R * T] = max(slowest.get(R * T, 0.0), ms / 1000)
    return CostModel.from_points({M: 1 / s for M, s in slowest.items()},
                                 points=[{"batch_size": R, "tokens_per_request": T, "tokens": R * T,
                                          "step_seconds": ms / 1000} for (R, T), ms in points.items()])


def test_step_seconds_prices_a_forward_by_its_shape(tmp_path):
    """Four rows of one token are not one row of four (here 1.2 against 2.0 ms): inside the profiled grid a
    forward is priced at its own (R, T), linear between grid points, and outside it (or without a full grid) at
    1 / SPS(R·T)."""
    cost = shaped_table({(1, 1): 1.0, (1, 4): 2.0, (4, 1): 1.2, (4, 4): 2.4})
    ms = lambda R, *T: (1000 * cost.step_seconds(R, torch.tensor(T))).tolist()  # noqa: E731
    assert 1000 / cost(4) == pytest.approx(2.0)  # SPS(4) is the slower shape, one row of four
    assert ms(4, 1, 4) == pytest.approx([1.2, 2.4]) and ms(1, 1, 4) == pytest.approx([1.0, 2.0])
    assert ms(2, 1) == pytest.approx([1.0 + 0.2 / 3]) and ms(4, 2) == pytest.approx([1.2 + 1.2 / 3])
    assert ms(1, 0) == pytest.approx([1.0])  # below the grid: clamped to its first T
    assert ms(8, 1) == pytest.approx([1000 / cost(8)]) and ms(1, 8) == pytest.approx([1000 / cost(8)])
    assert cost.step_seconds(4, torch.tensor([[1, 4]])).shape == (1, 2)
    cost.save(tmp_path / "c.json")  # the grid is the saved points: a loaded table prices the same
    assert (1000 * CostModel.load(tmp_path / "c.json").step_seconds(4, torch.tensor([1]))).item() == pytest.approx(1.2)
    partial = shaped_table({(1, 1): 1.0, (1, 4): 2.0, (4, 1): 1.2})  # (4, 4) missing: no grid
    assert (1000 * partial.step_seconds(4, torch.tensor([1]))).item() == pytest.approx(2.0)
    hand = CostModel.from_points({1: 1000.0, 4: 500.0})
    assert (1000 * hand.step_seconds(4, torch.tensor([1]))).item() == pytest.approx(2.0)


def test_graph_mode_needs_cuda_and_auto_is_eager_on_the_cpu(tiny_host):
    """On CUDA the default times replayed graphs (tests/test_engine_cuda.py); elsewhere steps run as called."""
    from drafters.ngram import NgramDrafter
    from verifiers.cost_model import profile_draft

    assert profile(FakeHost(), batch_sizes=[1], tokens_per_request=[1], repeats=1, warmup=0).mode == "eager"
    assert profile_draft(tiny_host, NgramDrafter(), batch_sizes=[1], draft_length=2, repeats=1, warmup=0,
                         context=8)["mode"] == "eager"
    for mode, message in (("graph", "needs a CUDA host"), ("fast", "must be auto, eager or graph")):
        with pytest.raises(ValueError, match=message):
            profile(FakeHost(), batch_sizes=[1], tokens_per_request=[1], mode=mode)


def test_profiler_times_the_attention_width_decoding_uses(tiny_host, monkeypatch):
    """The keys a profiled step attends are the keys a decode round attends at the same cache length and width
    (the loop attends a bucketed prefix of its cache, never the whole preallocated cache)."""
    from dspark.engine.decode import generate
    from drafters.ngram import NgramDrafter

    seen = []  # (cache length, tokens per row, attended keys) of every host step
    run = tiny_host._run

    def spy(tokens, positions, key_pos, *args, **kwargs):
        seen.append((int(positions[0, 0]), tokens.shape[1], key_pos.shape[1]))
        return run(tokens, positions, key_pos, *args, **kwargs)

    monkeypatch.setattr(tiny_host, "_run", spy)
    prompt = [5, 6, 7, 8] * 8  # 32 tokens, and repeats for the n-gram drafter
    generate(tiny_host, [prompt], drafter=NgramDrafter(), draft_length=4, max_new_tokens=100)
    # the loop's cache holds 32 + 100 + 4 + 2 = 138 positions; rounds that fit its first two 64-position buckets
    # (the last rounds are cut at the cache's end, which a table for every request length cannot know)
    rounds = [r for r in seen[1:] if r[0] + r[1] <= 128]
    assert {width for *_, width in rounds} == {64, 128}
    for context, T, width in rounds:
        seen.clear()
        cost = profile(tiny_host, batch_sizes=[1], tokens_per_request=[T], context=context, repeats=1, warmup=0)
        assert seen == [(context, T, width)] and cost.context == context
    with pytest.raises(ValueError, match="do not fit the host's context of 512"):
        profile(tiny_host, batch_sizes=[1], tokens_per_request=[16], context=500)


def test_export_engine_json(tmp_path):
    cost = CostModel.from_points({1: 100.0, 8: 50.0}, host="h", device="cpu")
    export_engine_json(tmp_path / "e.json", cost=cost, sts_temperatures=[1.5, 2.0])
    doc = json.loads((tmp_path / "e.json").read_text())
    assert doc["format"] == "dspark.engine" and doc["version"] == 1 and doc["host"] == "h"
    assert doc["cost"]["tokens"] == [1, 8] and doc["cost"]["step_ms"] == pytest.approx([10.0, 20.0])
    assert doc["sts"]["positions"] == 2 and doc["sts"]["temperatures"] == [1.5, 2.0]
    export_engine_json(tmp_path / "n.json", cost=cost, sts_temperatures=None)
    assert json.loads((tmp_path / "n.json").read_text())["sts"] is None
    with pytest.raises(ValueError, match="> 0"):
        export_engine_json(tmp_path / "x.json", cost=cost, sts_temperatures=[0.0])


def test_profiles_time_the_slot_engines_cache(tiny_host, tmp_path, monkeypatch):
    """The host's and the drafter's caches that the profilers allocate for a workload's context (longest prompt
    plus budget) are the ones the slot engine decodes that workload with: a captured round attends over its whole
    cache, so a profile over another length times another forward."""
    from dspark.engine.decode import generate
    from tests.conftest import random_prompts
    from tests.test_decode import K, build_any
    from verifiers.cost_model import profile_draft

    drafter = build_any("dspark", tiny_host, tmp_path)
    lengths = {"host": set(), "drafter": set()}
    new_cache, begin = tiny_host.new_cache, drafter.begin

    def spy_cache(batch_size, max_len):
        lengths["host"].add(max_len)
        return new_cache(batch_size, max_len)

    def spy_begin(*, host, batch_size, max_len):
        lengths["drafter"].add(max_len)
        return begin(host=host, batch_size=batch_size, max_len=max_len)
    monkeypatch.setattr(tiny_host, "new_cache", spy_cache)
    monkeypatch.setattr(drafter, "begin", spy_begin)
    prompts = random_prompts([5, 23, 9], tiny_host.vocab_size, seed=3)
    generate(tiny_host, prompts, drafter=drafter, draft_length=K, max_new_tokens=40, concurrency=2)
    engine = {k: set(v) for k, v in lengths.items()}
    assert engine["host"] == engine["drafter"] and len(engine["host"]) == 1
    for v in lengths.values():
        v.clear()
    context = 23 + 40
    cost = profile(tiny_host, batch_sizes=[1, 2], tokens_per_request=[1, 2, K + 1], context=context, repeats=1,
                   warmup=0)
    assert lengths["host"] == engine["host"] == {cost.cache_length}  # and the table says so
    lengths["host"].clear()
    entry = profile_draft(tiny_host, drafter, batch_sizes=[1, 2], draft_length=K, context=context, repeats=1,
                          warmup=0)
    assert lengths["host"] == lengths["drafter"] == engine["host"] == {entry["cache_length"]}
