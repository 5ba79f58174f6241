"""dspark.sweep, the one throughput-against-concurrency tool, and its front-ends `dspark bench` and `dspark sweep`
(`dspark experiment concurrency`: tests/test_experiments.py), on tiny random hosts on the CPU: the schema, one row
per setting and C, speculative tokens equal to plain decoding's, break-even read off the rows' speedups, skipped
settings, the warm-up before every timed decode, and errors before the first decode."""
from __future__ import annotations

import json
import types
import warnings

import pytest
import torch

import dspark.sweep as sweep_module
from conftest import random_prompts
from dspark.cli import main
from dspark.engine.decode import generate
from dspark.sweep import Drafted, Sweep, add_speedup, break_even, measure, setting_key

#: keys every row carries, whichever front-end wrote it (dspark.sweep's docstring)
ROW_KEYS = {"method", "policy", "draft_length", "concurrency", "engine", "tokens_per_s", "per_request_tokens_per_s",
            "tau", "tau_ci95", "verified_per_round", "accepted_per_round", "requests", "new_tokens", "seconds",
            "ttft_s_mean", "latency_s_mean", "identical_to_plain", "speedup", "pareto", "engine_stats",
            "conditional_acceptance", "prefix_survival"}
STATS_KEYS = {"rounds", "drafted_rounds", "mean_width", "wait_s", "admissions", "admit_s", "mean_in_flight",
              "in_flight_until_dry", "graphs", "warmup_s", "gc_s", "gc_collections", "stage_s"}


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def quiet(argv: list[str]) -> int:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # random-weight drafters warn by design
        return main(argv)


@pytest.fixture(scope="module")
def bench_doc(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("bench")
    assert quiet(["bench", "--host", "random:tiny-llama", "--drafter", "ngram", "--draft-length", "3",
                  "--concurrency", "1", "4", "--num-prompts", "6", "--max-new-tokens", "12", "--out-dir",
                  str(out)]) == 0
    return {"out": out, **json.loads((out / "concurrency.json").read_text())}


@pytest.fixture(scope="module")
def sweep_doc(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("sweep")
    assert quiet(["sweep", "--host", "random:tiny-llama", "--drafter", "dspark", "--draft-lengths", "2", "3",
                  "--batch-sizes", "1", "3", "--limit", "3", "--max-new-tokens", "6", "--out-dir", str(out)]) == 0
    return {"out": out, **json.loads((out / "concurrency.json").read_text())}


def assert_break_even_follows_the_speedups(doc: dict) -> None:
    """break_even[setting] = C*: slower or equal to plain at C* and every larger C, faster at the C just below (or
    C* the smallest); None: faster at the largest C."""
    by_setting: dict[str, dict[int, float]] = {}
    for r in doc["rows"]:
        if r["method"] != "plain":
            by_setting.setdefault(setting_key(r), {})[r["concurrency"]] = r["speedup"]
    assert set(doc["break_even"]) == set(by_setting)
    for key, speedups in by_setting.items():
        Cs = sorted(speedups)
        crossing = doc["break_even"][key]
        if crossing is None:
            assert speedups[Cs[-1]] > 1.0, key
            continue
        assert all(speedups[C] <= 1.0 for C in Cs if C >= crossing), key
        below = [C for C in Cs if C < crossing]
        assert not below or speedups[below[-1]] > 1.0, key


@pytest.mark.parametrize("front_end", ["bench", "sweep"])
def test_front_ends_write_one_row_per_setting_and_concurrency(front_end, bench_doc, sweep_doc):
    doc = {"bench": bench_doc, "sweep": sweep_doc}[front_end]
    want = {"bench": ({(1, "ngram", 3)}, [1, 4], "continuous", 6),
            "sweep": ({(1, "dspark", 2), (1, "dspark", 3)}, [1, 3], "static-batch", 3)}[front_end]
    drafted, Cs, engine, prompts = want
    assert doc["experiment"] == "concurrency" and doc["command"].startswith(f"dspark {front_end} ")
    assert doc["drafter_admission"] == "captured" and "partial" not in doc and doc["skipped"] == []
    rows = doc["rows"]
    settings = {("plain", "none", 0)} | {(name, "full", K) for _, name, K in drafted}
    assert len(rows) == len(settings) * len(Cs)
    assert {(r["method"], r["policy"], r["draft_length"], r["concurrency"]) for r in rows} == {
        (*s, C) for s in settings for C in Cs}
    for r in rows:
        assert ROW_KEYS <= set(r) and STATS_KEYS <= set(r["engine_stats"]), sorted(ROW_KEYS - set(r))
        assert r["engine"] == engine and r["requests"] == max(r["concurrency"], prompts)
        assert r["identical_to_plain"] == 1.0  # greedy in fp32: every request's tokens are plain decoding's
        assert r["ttft_s_mean"] <= r["latency_s_mean"]
    plain = {r["concurrency"]: r for r in rows if r["method"] == "plain"}
    for r in rows:
        assert r["speedup"] == pytest.approx(r["tokens_per_s"] / plain[r["concurrency"]]["tokens_per_s"])
        assert r["new_tokens"] == plain[r["concurrency"]]["new_tokens"]
    assert_break_even_follows_the_speedups(doc)
    names = {p.name for p in doc["out"].iterdir()}
    assert {"concurrency.md", "concurrency_throughput.png", "concurrency_pareto.png",
            "concurrency_budget.png"} <= names


def test_bench_keeps_every_slot_busy_until_the_queue_runs_dry(bench_doc):
    """C = 4 slots, 6 requests: the closed loop refills a slot as soon as a request leaves (and the n-gram drafter
    had drafts accepted, so the rows above compared tokens of rounds that accepted some)."""
    assert all(r["tau"] > 1 for r in bench_doc["rows"] if r["method"] == "ngram")
    for r in bench_doc["rows"]:
        stats = r["engine_stats"]
        assert stats["in_flight_until_dry"] == 1.0 and stats["admissions"] >= 1
        if r["concurrency"] == 4:
            assert stats["mean_in_flight"] > 1


def test_sweep_records_its_flags_and_the_trained_block(sweep_doc):
    assert sweep_doc["settings"]["batch_sizes"] == [1, 3] and sweep_doc["settings"]["draft_lengths"] == [2, 3]
    assert {r["trained_length"] for r in sweep_doc["rows"] if r["method"] == "dspark"} == {7}  # the default block


def test_identical_to_plain_counts_the_requests_whose_tokens_differ(tiny_host, monkeypatch):
    """A speculative decode that changed one request's tokens reads as (n - 1) / n; sampling reads as None."""
    from drafters import build_drafter

    real = sweep_module.backend("continuous")

    def one_request_off(host, prompts, *, drafter, **kw):
        result = real(host, prompts, drafter=drafter, **kw)
        if drafter is not None:
            result.token_ids[0] = [(result.token_ids[0][0] + 1) % host.vocab_size, *result.token_ids[0][1:]]
        return result
    monkeypatch.setattr(sweep_module, "backend", lambda name: one_request_off)
    prompts = random_prompts([6, 9, 12, 7], tiny_host.vocab_size)
    drafted = [Drafted("ngram", 3, build_drafter("ngram", tiny_host))]
    rows = measure(tiny_host, prompts, Sweep(drafted=drafted, policies=["full"], concurrency=[2], max_new_tokens=5),
                   out_dir=None)["rows"]
    assert [(r["method"], r["identical_to_plain"]) for r in rows] == [("plain", 1.0), ("ngram", 0.75)]
    from dspark.engine.sampling import SamplingConfig

    sampled = Sweep(drafted=drafted, policies=["full"], concurrency=[2], max_new_tokens=5,
                    sampling=SamplingConfig(temperature=1.0))
    assert {r["identical_to_plain"] for r in measure(tiny_host, prompts, sampled, out_dir=None)["rows"]} == {None}


def test_a_draft_length_past_the_trained_block_is_skipped_at_every_c(tiny_host):
    from drafters import build_drafter

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dspark2 = build_drafter("dspark", tiny_host, block_size=2, num_layers=1, rank=8,
                                feature_layers=(0, 1, 2))
    drafted = [Drafted("dspark", K, dspark2) for K in (2, 3)]
    out = measure(tiny_host, random_prompts([5, 8], tiny_host.vocab_size),
                  Sweep(drafted=drafted, policies=["full"], concurrency=[1, 2], max_new_tokens=4), out_dir=None)
    assert [(r["method"], r["draft_length"], r["concurrency"]) for r in out["rows"]] == [
        ("plain", 0, 1), ("dspark", 2, 1), ("plain", 0, 2), ("dspark", 2, 2)]
    assert all(r["trained_length"] == 2 for r in out["rows"] if r["method"] == "dspark")
    assert out["skipped"] == [{"method": "dspark", "draft_length": 3, "concurrency": C,
                               "reason": "draft length 3 > the block of 2 it was trained with"} for C in (1, 2)]


def test_a_verifier_that_cannot_be_built_fails_before_any_decode(tiny_host, monkeypatch):
    from drafters import build_drafter

    def never(*args, **kwargs):
        raise AssertionError("decoded before the settings were checked")
    monkeypatch.setattr(sweep_module, "backend", lambda name: never)
    drafted = [Drafted("ngram", 3, build_drafter("ngram", tiny_host))]
    with pytest.raises(ValueError, match="needs threshold="):  # the threshold policy without --threshold
        measure(tiny_host, [[1, 2, 3]], Sweep(drafted=drafted, policies=["full", "threshold"], concurrency=[1]),
                out_dir=None)
    with pytest.raises(ValueError, match="--concurrency needs values >= 1, got \\[0\\]"):
        measure(tiny_host, [[1, 2, 3]], Sweep(drafted=[], policies=[], concurrency=[0]), out_dir=None)
    with pytest.raises(ValueError, match="--repeats must be an integer >= 1, got 0"):
        measure(tiny_host, [[1, 2, 3]], Sweep(drafted=[], policies=[], concurrency=[1], repeats=0), out_dir=None)


def test_every_timed_decode_follows_a_warm_up_of_its_cache_on_cuda_only(tiny_host, monkeypatch):
    """On CUDA every row's timed decode comes after an untimed one of C requests, the longest prompt first, with the
    same budget (the cache the timed decode allocates); on the CPU there is none."""
    result = generate(tiny_host, [[1, 2, 3]], max_new_tokens=2, concurrency=1)
    calls = []

    def fake(host, prompts, *, concurrency, max_new_tokens, **kw):
        calls.append(([len(p) for p in prompts], concurrency, max_new_tokens))
        return result
    monkeypatch.setattr(sweep_module, "backend", lambda name: fake)
    prompts = [[1] * n for n in (3, 2, 9, 4)]
    timed = [3, 2, 9, 4]
    for device, warm in (("cpu", False), ("cuda", True)):
        calls.clear()
        host = types.SimpleNamespace(device=torch.device(device), name="fake")
        measure(host, prompts, Sweep(drafted=[], policies=[], concurrency=[1, 2], max_new_tokens=16), out_dir=None)
        want = [([9], 1, 16), (timed, 1, 16), ([9, 3], 2, 16), (timed, 2, 16)]
        assert calls == (want if warm else [want[1], want[3]])


def _row(method, policy, C, tps, **extra):
    return {"method": method, "policy": policy, "draft_length": 0 if method == "plain" else 3, "concurrency": C,
            "engine": "static-batch", "tokens_per_s": tps, "per_request_tokens_per_s": tps / C, **extra}


def test_break_even_is_where_a_setting_stays_at_or_below_plain():
    rows = [_row("plain", "none", C, 100.0 * C) for C in (1, 2, 4, 8)]
    rows += [_row("a", "full", C, t) for C, t in zip((1, 2, 4, 8), (150, 250, 390, 700))]  # below from 4 on
    rows += [_row("b", "full", C, t) for C, t in zip((1, 2, 4, 8), (150, 190, 450, 900))]  # dips at 2, recovers
    rows += [_row("c", "full", C, t) for C, t in zip((1, 2, 4, 8), (50, 100, 300, 700))]  # never faster
    add_speedup(rows)
    assert break_even(rows) == {"a/full/γ3": 4, "b/full/γ3": None, "c/full/γ3": 1}
    assert [r["speedup"] for r in rows if r["method"] == "a"] == [1.5, 1.25, 0.975, 0.875]
    # the Pareto front: nothing beats it on both axes
    front = [r for r in rows if r["pareto"]]
    assert front and all(not (o["tokens_per_s"] > r["tokens_per_s"] and o["per_request_tokens_per_s"] >
                              r["per_request_tokens_per_s"]) for r in front for o in rows)


def test_bench_takes_the_prompts_of_an_eval_source(tmp_path, monkeypatch, capsys):
    """--data SOURCE: the prompts `dspark eval --data SOURCE` decodes (its held-out split; all of an evaluation
    set), recorded in the settings; a host without a tokenizer is told to use the built-in prompts."""
    import dspark.cli as cli

    seen = []

    def fake_eval_prompts(host, opts):
        seen.append((opts.data, opts.split, opts.limit, opts.max_prompt_length))
        return [[1, 2, 3], [4, 5, 6, 7]]

    def host_with_a_tokenizer(opts, load=cli._host):  # the random host has none; the prompts are faked above
        host = load(opts)
        host.tokenizer = types.SimpleNamespace(eos_token_id=None, pad_token_id=None)
        return host

    monkeypatch.setattr(cli, "eval_prompts", fake_eval_prompts)
    monkeypatch.setattr(cli, "_host", host_with_a_tokenizer)
    assert quiet(["bench", "--host", "random:tiny-llama", "--drafter", "ngram", "--concurrency", "2", "--data",
                  "humaneval", "--num-prompts", "2", "--max-prompt-length", "300", "--max-new-tokens", "4",
                  "--out-dir", str(tmp_path)]) == 0
    assert seen == [("humaneval", "all", 2, 300)]
    out = json.loads((tmp_path / "concurrency.json").read_text())
    assert out["settings"]["data"] == "humaneval" and all(r["requests"] == 2 for r in out["rows"])
    monkeypatch.undo()
    assert main(["bench", "--host", "random:tiny-llama", "--data", "sharegpt", "--out-dir", str(tmp_path)]) != 0
    assert "--data sharegpt needs a host with a tokenizer" in capsys.readouterr().err


def test_sweep_needs_a_drafter(capsys):
    assert main(["sweep", "--host", "random:tiny-llama"]) == 1
    assert "dspark sweep compares a drafter with plain decoding" in capsys.readouterr().err
