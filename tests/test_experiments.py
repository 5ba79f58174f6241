"""CPU smoke tests of the experiment runners (`dspark experiment NAME`, `dspark report`) on a tiny random host, and
unit tests of the numbers they derive (savings, the replay simulator). dspark.sweep itself, the tool behind
`dspark experiment concurrency`, and its other front-ends: tests/test_sweep.py."""
from __future__ import annotations

import json
import sys
import warnings

import pytest

import dspark
from dspark.cli import main as cli
from dspark.sweep import add_speedup, break_even, merge, workload_context
from experiments.common import load_prompts
from experiments.savings import savings
from experiments.simulator import Pricing, simulate
from verifiers import build_verifier
from verifiers.cost_model import CostModel

HOST = "random:tiny-llama"
SMALL = ["--host", HOST, "--num-prompts", "4", "--max-new-tokens", "8"]


def run(*argv) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # random-weight drafters warn by design
        assert cli(list(argv)) == 0


def load(path) -> dict:
    return json.loads(path.read_text())


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def cost_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("cost") / "cost.json"
    # a concave made-up SPS(B) table for random:tiny-llama on the CPU: the schedulers need one, profiling is slow
    CostModel.from_points({1: 100.0, 4: 90.0, 16: 60.0, 64: 20.0}, host=HOST, device="cpu").save(path)
    return path


@pytest.fixture(scope="module")
def concurrency_dir(tmp_path_factory, cost_path):
    out = tmp_path_factory.mktemp("concurrency")
    run("experiment", "concurrency", *SMALL, "--drafters", "ngram", "dspark", "--policies", "full", "scheduler",
        "--draft-lengths", "3", "--concurrency", "1", "2", "--cost-table", str(cost_path), "--out-dir", str(out))
    return out


@pytest.fixture(scope="module")
def acceptance_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("acceptance")
    run("experiment", "acceptance", *SMALL, "--drafters", "ngram", "dspark", "--draft-length", "3",
        "--concurrency", "4", "--out-dir", str(out))
    return out


def test_concurrency_writes_rows_break_even_and_plots(concurrency_dir):
    from test_sweep import ROW_KEYS, assert_break_even_follows_the_speedups

    doc = load(concurrency_dir / "concurrency.json")
    rows = doc["rows"]
    # plain + 2 drafters x 2 policies, at each of 2 concurrencies
    assert {(r["method"], r["policy"], r["draft_length"], r["concurrency"]) for r in rows} == {
        ("plain", "none", 0, C) for C in (1, 2)} | {(m, p, 3, C) for m in ("ngram", "dspark")
                                                    for p in ("full", "scheduler") for C in (1, 2)}
    assert len(rows) == 2 * (1 + 2 * 2)
    for row in rows:
        assert ROW_KEYS <= set(row) and row["engine"] == "continuous"
        assert row["identical_to_plain"] == 1.0  # greedy in fp32: every policy decodes plain decoding's tokens
        stats = row["engine_stats"]  # where the seconds went: rounds, drafted rounds, the CPU's waits
        assert 0 <= stats["drafted_rounds"] <= stats["rounds"]
        assert stats["rounds"] == pytest.approx(row["request_rounds"] / row["mean_batch"])  # every round logged
        assert stats["drafted_rounds"] == 0 if row["method"] == "plain" else stats["mean_width"] >= 1
        assert stats["stage_s"] is None  # no CUDA events on the CPU
    assert all(r["tau"] == 1 for r in rows if r["method"] == "plain")
    assert_break_even_follows_the_speedups(doc)
    names = {p.name for p in concurrency_dir.iterdir()}
    assert {"concurrency.md", "concurrency_throughput.png", "concurrency_pareto.png", "concurrency_budget.png"} <= names
    assert "Engine: continuous (C requests in flight" in (concurrency_dir / "concurrency.md").read_text()


def test_concurrency_merges_a_sweep_run_in_parts(concurrency_dir, tmp_path):
    whole = load(concurrency_dir / "concurrency.json")
    parts = []
    for C in (1, 2):  # the sweep as if run in two calls, one C each
        part = {**whole, "rows": [r for r in whole["rows"] if r["concurrency"] == C],
                "settings": {**whole["settings"], "concurrency": [C]}}
        parts.append(tmp_path / f"part{C}.json")
        parts[-1].write_text(json.dumps(part))
    run("experiment", "concurrency", "--merge", *map(str, parts), "--out-dir", str(tmp_path / "joined"))
    joined = load(tmp_path / "joined" / "concurrency.json")
    assert joined["break_even"] == whole["break_even"]
    key = lambda r: (r["method"], r["policy"], r["draft_length"], r["concurrency"])  # noqa: E731
    assert sorted(joined["rows"], key=key) == sorted(whole["rows"], key=key)
    assert [s["path"] for s in joined["sources"]] == [str(p) for p in parts]
    assert "Joined from" in (tmp_path / "joined" / "concurrency.md").read_text()
    with pytest.raises(ValueError, match="at C = 1 again"):
        merge([str(parts[0]), str(parts[0])])
    older = json.loads(parts[1].read_text())  # written before --stage-timing and --repeats: read as defaults
    del older["settings"]["stage_timing"], older["settings"]["repeats"]
    parts[1].write_text(json.dumps(older))
    assert len(merge([str(p) for p in parts])["rows"]) == len(whole["rows"])
    timed = {**older, "settings": {**older["settings"], "stage_timing": True}}
    parts[1].write_text(json.dumps(timed))
    with pytest.raises(ValueError, match=r"other settings .*\(stage_timing\)"):
        merge([str(p) for p in parts])
    other = json.loads(parts[1].read_text())
    other["settings"]["stage_timing"] = False
    other["settings"]["max_new_tokens"] = 99
    parts[1].write_text(json.dumps(other))
    with pytest.raises(ValueError, match=r"other settings .*\(max_new_tokens\)"):
        merge([str(p) for p in parts])


def test_concurrency_repeats_give_paired_ratios_and_their_range(cost_path, tmp_path, capsys):
    """--repeats 2: every row decoded twice per C (the settings' order rotated), tokens/s the median of its two
    decodes, speedup the median of the paired ratios to plain decoding's decode of the same repeat, with their
    range; the same τ as one decode (same prompts, seeds, gate decisions). --repeats 0 is refused."""
    run("experiment", "concurrency", *SMALL, "--drafters", "ngram", "--policies", "full", "scheduler",
        "--draft-lengths", "3", "--concurrency", "2", "--repeats", "2", "--cost-table", str(cost_path),
        "--out-dir", str(tmp_path))
    doc = load(tmp_path / "concurrency.json")
    assert len(doc["rows"]) == 3 and doc["settings"]["repeats"] == 2
    plain = next(r for r in doc["rows"] if r["method"] == "plain")
    for row in doc["rows"]:
        times = row["tokens_per_s_repeats"]
        assert len(times) == 2 and row["tokens_per_s"] == pytest.approx(sum(times) / 2)
        ratios = [a / b for a, b in zip(times, plain["tokens_per_s_repeats"])]
        assert row["speedup"] == pytest.approx(sum(ratios) / 2)
        assert row["speedup_range"] == pytest.approx([min(ratios), max(ratios)])
    assert plain["speedup"] == 1.0 and plain["speedup_range"] == [1.0, 1.0]
    assert "range of repeats" in (tmp_path / "concurrency.md").read_text()
    assert cli(["experiment", "concurrency", *SMALL, "--repeats", "0", "--out-dir", str(tmp_path / "none")]) == 1
    assert "--repeats must be an integer >= 1, got 0" in capsys.readouterr().err


def test_concurrency_keeps_the_finished_c_when_a_run_is_cut_short(cost_path, tmp_path, monkeypatch):
    import dspark.sweep as runner

    decode = runner.backend("continuous")

    def cut_at_two(host, prompts, *, concurrency, **kw):
        if concurrency == 2:
            raise KeyboardInterrupt  # what a device call's time limit does to the run
        return decode(host, prompts, concurrency=concurrency, **kw)
    monkeypatch.setattr(runner, "backend", lambda name: cut_at_two)
    with pytest.raises(KeyboardInterrupt), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cli(["experiment", "concurrency", *SMALL, "--drafters", "ngram", "--policies", "full", "--draft-lengths", "3",
             "--concurrency", "1", "2", "--cost-table", str(cost_path), "--out-dir", str(tmp_path)])
    doc = load(tmp_path / "concurrency.json")
    assert doc["partial"] and {r["concurrency"] for r in doc["rows"]} == {1}
    assert {r["method"] for r in doc["rows"]} == {"plain", "ngram"}
    assert "Partial result" in (tmp_path / "concurrency.md").read_text()


def test_concurrency_profiles_a_cost_table_when_none_is_given(tmp_path):
    run("experiment", "concurrency", "--host", HOST, "--num-prompts", "2", "--max-new-tokens", "4", "--drafters",
        "ngram", "--policies", "scheduler", "--draft-lengths", "2", "--concurrency", "2", "--out-dir", str(tmp_path))
    cost = CostModel.load(tmp_path / "cost.json", expect_host=HOST, expect_device="cpu")
    assert cost.tokens[0] >= 1 and len(load(tmp_path / "concurrency.json")["rows"]) == 2
    # timed at the cache these prompts decode in (the longest prompt + the new tokens), not a fixed short context
    prompts = load_prompts(dspark.load_host(HOST), "sharegpt", 2, seed=0)
    assert cost.context == workload_context(prompts, 4) == max(map(len, prompts)) + 4


def test_concurrency_runs_every_drafter_family_side_by_side(tmp_path, cost_path):
    run("experiment", "concurrency", "--host", HOST, "--num-prompts", "2", "--max-new-tokens", "4", "--drafters",
        "dflash", "eagle3", "mtp", "--policies", "threshold", "lagged", "--draft-lengths", "2", "--concurrency", "2",
        "--cost-table", str(cost_path), "--out-dir", str(tmp_path))
    rows = load(tmp_path / "concurrency.json")["rows"]
    assert {(r["method"], r["policy"]) for r in rows} == {("plain", "none")} | {
        (m, p) for m in ("dflash", "eagle3", "mtp") for p in ("threshold", "lagged")}
    # the same prompts and seeds everywhere: every setting decoded the same number of new tokens
    assert len({r["new_tokens"] for r in rows}) == 1


def test_bad_policy_and_unknown_experiment_are_clear_errors(tmp_path, capsys):
    assert cli(["experiment", "concurrency", "--host", HOST, "--policies", "fastest", "--out-dir",
                str(tmp_path)]) == 1
    assert "unknown policies ['fastest']" in capsys.readouterr().err
    assert cli(["experiment", "simulator_validation", "--host", HOST, "--draft-length", "0", "--out-dir",
                str(tmp_path)]) == 1
    assert "--draft-length needs values >= 1, got [0]" in capsys.readouterr().err
    assert cli(["experiment", "concurrency", "--host", HOST, "--concurrency", "0", "4", "--out-dir",
                str(tmp_path)]) == 1
    assert "--concurrency needs values >= 1, got [0, 4]" in capsys.readouterr().err
    assert cli(["experiment", "nope"]) == 1
    assert "unknown experiment 'nope'" in capsys.readouterr().err


def _row(method, policy, C, tps, **extra):
    return {"method": method, "policy": policy, "draft_length": 0 if method == "plain" else 3, "concurrency": C,
            "engine": "static-batch", "tokens_per_s": tps, "per_request_tokens_per_s": tps / C, **extra}


def test_savings_against_verify_all_twin():
    full = _row("d", "full", 4, 400.0, verified_per_round=6.0, accepted_per_round=3.0, tau=4.0)
    sched = _row("d", "scheduler", 4, 440.0, verified_per_round=4.2, accepted_per_round=2.8, tau=3.8)
    (row,) = savings([_row("plain", "none", 4, 300.0), full, sched])
    assert row["savings_vs_full"] == pytest.approx(0.3)
    assert row["tau_given_up"] == pytest.approx(0.2)
    assert row["throughput_change"] == pytest.approx(0.1)
    with pytest.raises(ValueError, match="no verify-all"):
        savings([sched])


def test_savings_from_a_concurrency_json(concurrency_dir, tmp_path):
    run("experiment", "savings", "--from-json", str(concurrency_dir / "concurrency.json"), "--out-dir", str(tmp_path))
    doc = load(tmp_path / "savings.json")
    assert {(r["method"], r["policy"], r["concurrency"]) for r in doc["rows"]} == {
        (m, "scheduler", C) for m in ("ngram", "dspark") for C in (1, 2)}
    assert (tmp_path / "savings.png").is_file() and (tmp_path / "savings.md").is_file()


def test_threshold_zero_verifies_all_and_one_verifies_nothing(tmp_path):
    run("experiment", "threshold", *SMALL, "--drafter", "dspark", "--thresholds", "0", "1", "--draft-length", "3",
        "--concurrency", "4", "--domains", "chat=sharegpt", "code=humaneval", "--out-dir", str(tmp_path))
    rows = load(tmp_path / "threshold.json")["rows"]
    assert [(r["domain"], r["threshold"]) for r in rows] == [("chat", 0.0), ("chat", 1.0), ("code", 0.0),
                                                              ("code", 1.0)]
    for r in rows:
        assert r["rejected_per_round"] == pytest.approx(r["verified_per_round"] - r["accepted_per_round"])
        if r["threshold"] == 0.0:
            # every draft: 3 per round, but the last rounds of a request verify fewer (never past max_new_tokens)
            assert r["verified_per_round"] > 2.0
        else:
            assert r["verified_per_round"] == 0.0  # random confidences are never exactly 1
    assert (tmp_path / "threshold.png").is_file() and "| chat | 1.000 |" in (tmp_path / "threshold.md").read_text()


def test_threshold_default_domains_include_math_from_champ(tmp_path):
    run("experiment", "threshold", *SMALL, "--drafter", "dspark", "--thresholds", "0", "--draft-length", "3",
        "--concurrency", "4", "--out-dir", str(tmp_path))
    doc = load(tmp_path / "threshold.json")
    assert doc["domains"] == {"chat": "sharegpt", "code": "humaneval", "math": "champ"}
    assert [r["domain"] for r in doc["rows"]] == ["chat", "code", "math"]


class ByteTokenizer:
    """Test double: UTF-8 bytes as token ids (all < 256, inside random:tiny-llama's 512-token vocabulary), so a
    random host decodes real text prompts without a tokenizer download."""

    chat_template = None
    eos_token_id = None

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": list(text.encode())}


@pytest.fixture
def byte_host(monkeypatch):
    """random:tiny-llama with the byte tokenizer, served to the experiment runners in place of --host."""
    from dspark.api import load_host

    host = load_host(HOST)
    host.tokenizer = ByteTokenizer()
    monkeypatch.setattr("dspark.cli._host", lambda opts: host)
    return host


def test_math_domain_decodes_champ_problems(byte_host, tmp_path):
    import champ_dataset

    from experiments.common import load_prompts

    texts = {p.text for p in champ_dataset.load("v0").problems.values()}
    ids = load_prompts(byte_host, "champ", 4, max_prompt_length=300)
    for prompt in ids:
        text = bytes(prompt).decode()
        assert text.startswith("Solve the following problem.") and text.split("\n\n", 1)[1] in texts
    run("experiment", "threshold", *SMALL, "--max-prompt-length", "300", "--drafter", "dspark", "--thresholds", "0",
        "--draft-length", "3", "--concurrency", "4", "--domains", "math=champ", "--out-dir", str(tmp_path))
    (row,) = load(tmp_path / "threshold.json")["rows"]
    assert row["domain"] == "math" and row["requests"] == 4 and row["verified_per_round"] > 0


def test_math_domain_without_champ_names_the_package(byte_host, monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "champ_dataset", None)  # as if champ-dataset were not installed
    monkeypatch.setitem(sys.modules, "champ_dataset.prompt", None)
    assert cli(["experiment", "threshold", *SMALL, "--drafter", "dspark", "--thresholds", "0", "--out-dir",
                str(tmp_path)]) == 1
    assert "pip install champ-dataset" in capsys.readouterr().err
    assert not (tmp_path / "threshold.json").exists()


def test_threshold_needs_confidences(tmp_path, capsys):
    assert cli(["experiment", "threshold", *SMALL, "--drafter", "ngram", "--thresholds", "0.5", "--domains",
                "chat=sharegpt", "--out-dir", str(tmp_path)]) == 1
    assert "gives no confidences" in capsys.readouterr().err


def test_length_skips_draft_lengths_past_the_trained_block_and_reports_the_margin(tmp_path):
    from dspark.api import load_host, resolve_drafter

    host = load_host(HOST)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        resolve_drafter(host, "dspark", block_size=2).save_pretrained(tmp_path / "dspark2")
    run("experiment", "length", *SMALL, "--drafters", "dspark", "dflash", "--draft-lengths", "2", "3",
        "--drafter-paths", f"dspark={tmp_path / 'dspark2'}", "--concurrency", "4", "--out-dir", str(tmp_path / "out"))
    doc = load(tmp_path / "out" / "length.json")
    assert {(r["method"], r["draft_length"], r["trained_length"]) for r in doc["rows"]} == {
        ("dspark", 2, 2), ("dflash", 2, 3), ("dflash", 3, 3)}
    assert doc["skipped"] == [{"method": "dspark", "draft_length": 3,
                               "reason": "draft length 3 > the block of 2 it was trained with"}]
    assert (tmp_path / "out" / "length.png").is_file() and "DSpark over DFlash" in (
        tmp_path / "out" / "length.md").read_text()
    (m,) = doc["margin"]
    assert m["draft_length"] == 2 and m["matched"] is False
    assert m["margin"] == pytest.approx(m["dspark_tau"] / m["dflash_tau"] - 1)


def test_acceptance_per_position_calibration_and_traces(acceptance_dir):
    doc = load(acceptance_dir / "acceptance.json")
    rows = doc["rows"]
    assert doc["domains"] == {"chat": "sharegpt", "code": "humaneval", "math": "champ"}  # the defaults
    assert {(r["method"], r["domain"]) for r in rows} == {(m, d) for m in ("ngram", "dspark")
                                                          for d in ("chat", "code", "math")}
    for r in rows:
        assert len(r["conditional_acceptance"]) == len(r["prefix_survival"]) == 3
        trace = load(acceptance_dir / r["trace"])
        assert trace["format"] == "dspark.trace" and len(trace["requests"]) == 4
        assert sum(len(q["accepted"]) for q in trace["requests"]) == r["request_rounds"]
        if r["method"] == "ngram":
            assert r["calibration"] is None  # no confidence head
        else:
            cal = r["calibration"]
            assert len(cal["temperatures"]) == 3 and cal["report_requests"] == 2
            assert len(cal["before"]["survival"]["ece"]) == len(cal["after"]["survival"]["ece"]) == 3
            assert (acceptance_dir / r["reliability_png"]).is_file()
    assert (acceptance_dir / "acceptance.png").is_file() and (acceptance_dir / "calibration.png").is_file()
    assert "ECE STS" in (acceptance_dir / "acceptance.md").read_text()


def _trace(accepted, confidence, *, K=3, new_tokens=8, n=1):
    rounds = len(accepted)
    return {"format": "dspark.trace", "version": 1, "draft_length": K, "method": "hand",
            "requests": [{"new_tokens": new_tokens, "proposed": [K] * rounds, "verified": [K] * rounds,
                          "accepted": accepted, "confidence": confidence} for _ in range(n)]}


def test_a_replayed_request_meets_the_drafter_where_the_log_stood_at_its_position():
    """The replay takes the logged round that covers a request's position: its rest after a plain step or a partial
    verify (accepted and proposed less the offset, confidences shifted), the next round at the bonus position of a
    round that accepted all it proposed (censored), and a round's own data at its start."""
    from experiments.simulator import _Live, logged_round, round_starts

    conf = [[0.9, 0.8, 0.7], [0.6, 0.5, 0.4], [0.3, 0.2, 0.1]]
    request = {"new_tokens": 9, "proposed": [3, 3, 3], "accepted": [2, 0, 3], "confidence": conf}
    starts = round_starts(request, first=1)  # the prefill's token first, then rounds of a + 1 tokens
    assert starts == [1, 4, 5]
    offered = {}
    for p in range(1, 9):
        offered[p] = logged_round(_Live(serial=0, trace=request, starts=starts, start=0.0, tokens=p), K=3)
    assert offered[1] == (2, 3, [0.9, 0.8, 0.7])
    assert offered[2] == (1, 2, [0.8, 0.7, 0.0])  # one token into round 0
    assert offered[3] == (0, 1, [0.7, 0.0, 0.0])  # at the draft round 0 got rejected on: none accepted from here
    assert offered[4] == (0, 3, [0.6, 0.5, 0.4]) and offered[5] == (3, 3, [0.3, 0.2, 0.1])
    assert offered[8] == (0, 0, [0.0, 0.0, 0.0])  # past the last round's drafts
    censored = {"new_tokens": 9, "proposed": [3, 3], "accepted": [3, 1], "confidence": None}
    live = _Live(serial=0, trace=censored, starts=round_starts(censored, first=0), start=0.0, tokens=3)
    assert logged_round(live, K=3) == (1, 3, None)  # round 0 accepted all 3: at its bonus position, round 1


def test_simulator_matches_hand_computation():
    flat = CostModel.flat(50.0)
    trace = _trace([3, 3], None, new_tokens=8, n=4)  # every draft accepted: 4 tokens per round, 2 rounds
    full = simulate(trace, policy=build_verifier("full"), concurrency=4, cost=flat, requests=4)
    assert full["tokens_per_s"] == pytest.approx(4 * 4 * 50.0) and full["tau"] == 4.0
    plain = simulate(trace, policy=None, concurrency=4, cost=flat, requests=4)
    assert plain["tokens_per_s"] == pytest.approx(4 * 50.0) and plain["steps"] == 8
    # cumulative a = 0.9, 0.45, 0.045: threshold 0.4 verifies 2, and the logged 3 accepted are cut to 2
    conf = [[0.9, 0.5, 0.1]] * 2
    thr = simulate(_trace([3, 3], conf, new_tokens=6), policy=build_verifier("threshold", threshold=0.4),
                   concurrency=1, cost=flat, requests=1)
    assert thr["verified_per_round"] == 2.0 and thr["tau"] == 3.0 and thr["steps"] == 2
    # a step's time follows SPS(B): with drafts at half speed of plain, verify-all of 1 + 3 tokens halves the rate
    slow = CostModel.from_points({1: 100.0, 4: 50.0})
    one = simulate(trace, policy=build_verifier("full"), concurrency=1, cost=slow, requests=1)
    assert one["tokens_per_s"] == pytest.approx(4 * 50.0)
    assert one["per_request_tokens_per_s"] == pytest.approx(4 * 50.0)


def test_simulator_replays_the_draft_gate():
    """Drafts never accepted at a 10 ms draft step on a 20 ms verify: the gated scheduler stops drafting and comes
    close to plain decoding; without the gate every step pays the draft."""
    flat = CostModel.flat(50.0)
    trace = _trace([0] * 8, [[0.99, 0.99, 0.99]] * 8, new_tokens=64, n=2)
    plain = simulate(trace, policy=None, concurrency=2, cost=flat, requests=2)
    gated = simulate(trace, policy=build_verifier("scheduler", cost_table=flat), concurrency=2, cost=flat,
                     requests=2, pricing=Pricing(draft_ms=10.0))
    always = simulate(trace, policy=build_verifier("scheduler", cost_table=flat, draft_gate=False), concurrency=2,
                      cost=flat, requests=2, pricing=Pricing(draft_ms=10.0))
    assert always["tokens_per_s"] == pytest.approx(plain["tokens_per_s"] * 20 / 30)
    assert gated["tokens_per_s"] > 0.95 * plain["tokens_per_s"]


def test_simulator_prices_a_deferred_observe_once_per_flush():
    """The engine's backlog (Pricing.deferred_observe): a gated decode's plain steps pay one observe per flush (up
    to 4 verify widths of K + 1 of them) instead of one each; with a 5 ms observe on a 20 ms step the gate then
    comes near plain decoding."""
    flat = CostModel.flat(50.0)
    trace = _trace([0] * 8, [[0.99, 0.99, 0.99]] * 8, new_tokens=64, n=2)  # K = 3: a width is 4 positions
    plain = simulate(trace, policy=None, concurrency=2, cost=flat, requests=2)
    rate = {}
    for deferred in (False, True):
        pricing = Pricing(draft_ms=10.0, observe_seconds=lambda rows: 0.005, deferred_observe=deferred)
        rate[deferred] = simulate(trace, policy=build_verifier("scheduler", cost_table=flat), concurrency=2,
                                  cost=flat, requests=2, pricing=pricing)["tokens_per_s"] / plain["tokens_per_s"]
    assert rate[False] < 0.82 and rate[True] > 0.9


def test_simulator_prices_plain_decoding_on_each_traces_own_requests(tmp_path):
    """With several traces, each speed-up is over plain decoding of the same requests: a trace of short requests
    and one of long ones drain a closed loop differently, so one shared plain row would mis-state both."""
    from experiments.simulator import SimulateOptions, name_by_trace, run

    paths = []
    for name, lengths in (("short", (2, 30)), ("long", (40, 40))):  # the first drains at 1 in flight, not the second
        trace = _trace([0] * 40, None, new_tokens=lengths[0], n=1)  # nothing accepted: full loses to plain
        trace["requests"].append(dict(trace["requests"][0], new_tokens=lengths[1]))
        paths.append(tmp_path / f"trace_{name}.json")
        paths[-1].write_text(json.dumps(trace))
    cost = CostModel.from_points({1: 100.0, 4: 90.0, 16: 50.0, 64: 20.0})
    rows = run(SimulateOptions(traces=[str(p) for p in paths], policies=["full"], concurrency=[1, 4]), cost)
    name_by_trace(rows)  # as main does with several traces
    add_speedup(rows)
    plain = {(r["trace"], r["concurrency"]): r for r in rows if r["method"].startswith("plain@")}
    assert len(plain) == 4  # one plain row per trace and C
    assert plain[(str(paths[0]), 4)]["tokens_per_s"] != pytest.approx(plain[(str(paths[1]), 4)]["tokens_per_s"])
    for r in rows:
        assert r["speedup"] == pytest.approx(r["tokens_per_s"] / plain[(r["trace"], r["concurrency"])]["tokens_per_s"])
    assert set(break_even(rows)) == {"hand@trace_short/full/γ3", "hand@trace_long/full/γ3"}


def test_simulator_slot_pricing_and_machine_constants():
    """Slot pricing: every one of the C slots carries the bucketed longest width, idle or not; the step overhead
    adds to every step and the admission time to every step that admits."""
    flat = CostModel.from_points({1: 100.0, 8: 50.0, 16: 25.0})
    trace = _trace([3, 3], None, new_tokens=8, n=2)  # 4 tokens a round, 2 rounds
    full = simulate(trace, policy=build_verifier("full"), concurrency=2, cost=flat, requests=2,
                    pricing=Pricing("slots"))
    assert full["seconds"] == pytest.approx(2 / 50.0)  # B = 2 slots x (3 + 1) = 8 tokens a step
    timed = simulate(trace, policy=build_verifier("full"), concurrency=2, cost=flat, requests=2, pricing=Pricing(
                     "slots", step_overhead_ms=1.0, admission_ms=5.0, draft_seconds=lambda R: 0.002 * R))
    assert timed["seconds"] == pytest.approx(2 / 50.0 + 2 * 0.001 + 0.005 + 2 * 0.004)  # one admission of both
    one_slot_idle = simulate(_trace([3], None, new_tokens=4, n=1), policy=build_verifier("full"), concurrency=4,
                             cost=flat, requests=1, pricing=Pricing("slots"))
    assert one_slot_idle["seconds"] == pytest.approx(1 / 25.0)  # C = 4: the idle slots pay too (B = 16)
    with pytest.raises(ValueError, match="pricing mode"):
        Pricing("exact")


def test_simulator_prices_a_slot_step_by_its_shape():
    """With a profiled (R, T) grid a slot step is priced as the scheduler and the draft gate price it, by the
    forward's own shape: 4 plain slots at their (4, 1) time, not at SPS(4), which is the slower one-row shape."""
    cost = CostModel.from_points({1: 1000.0, 4: 250.0, 16: 100.0}, points=[
        {"batch_size": R, "tokens_per_request": T, "tokens": R * T, "step_seconds": ms / 1000}
        for (R, T), ms in {(1, 1): 1.0, (1, 4): 4.0, (4, 1): 2.0, (4, 4): 5.0}.items()])
    trace = _trace([3], None, new_tokens=4, n=4)  # one round of 3 + 1 tokens
    plain = simulate(trace, policy=None, concurrency=4, cost=cost, requests=4, pricing=Pricing("slots"))
    assert plain["steps"] == 3 and plain["seconds"] == pytest.approx(3 * 0.002)  # not 3 / SPS(4) = 12 ms
    full = simulate(trace, policy=build_verifier("full"), concurrency=4, cost=cost, requests=4,
                    pricing=Pricing("slots"))
    assert full["steps"] == 1 and full["seconds"] == pytest.approx(0.005)  # (4, 4), not 1 / SPS(16) = 10 ms
    ragged = simulate(trace, policy=None, concurrency=4, cost=cost, requests=4)
    assert ragged["seconds"] == pytest.approx(4 / 250.0)  # ragged steps keep SPS(B): B = 4 tokens, 4 steps


def test_simulator_validation_writes_measured_and_predicted(tmp_path):
    out = tmp_path / "val"
    run("experiment", "simulator_validation", "--host", "random:tiny-llama", "--drafters", "ngram", "--policies",
        "full", "--concurrency", "1", "2", "--num-prompts", "3", "--max-new-tokens", "6", "--out-dir", str(out))
    doc = load(out / "simulator_validation.json")
    settings = {(r["method"], r["concurrency"]) for r in doc["rows"]}
    assert settings == {(m, C) for m in ("plain", "ngram") for C in (1, 2)}
    for r in doc["rows"]:
        assert r["measured_tokens_per_s"] > 0 and r["predicted_tokens_per_s"] > 0
        assert r["relative_error"] == pytest.approx(r["predicted_tokens_per_s"] / r["measured_tokens_per_s"] - 1)
        if r["fitted"]:  # the plain rows fit the step overhead: their prediction is their measurement
            assert abs(r["relative_error"]) < 0.02
    assert doc["max_relative_error"] == max(abs(r["relative_error"]) for r in doc["rows"] if not r["fitted"])
    assert set(doc["constants"]) == {"1", "2"} and (out / "simulator_validation.png").is_file()


def test_simulator_validation_keeps_the_finished_c_when_a_run_is_cut_short(tmp_path, monkeypatch):
    import experiments.validate as runner

    decode = runner.continuous_decode

    def cut_at_two(host, prompts, *, concurrency, **kw):
        if concurrency == 2:
            raise KeyboardInterrupt  # what a device call's time limit does to the run
        return decode(host, prompts, concurrency=concurrency, **kw)
    monkeypatch.setattr(runner, "continuous_decode", cut_at_two)
    with pytest.raises(KeyboardInterrupt), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cli(["experiment", "simulator_validation", "--host", HOST, "--drafters", "ngram", "--policies", "full",
             "--concurrency", "1", "2", "--num-prompts", "3", "--max-new-tokens", "6", "--out-dir", str(tmp_path)])
    doc = load(tmp_path / "simulator_validation.json")
    assert doc["partial"] and {(r["method"], r["concurrency"]) for r in doc["rows"]} == {("plain", 1), ("ngram", 1)}
    assert "Partial result" in (tmp_path / "simulator_validation.md").read_text()


@pytest.mark.parametrize("overlap", [False, True], ids=["in-order", "overlapped"])
def test_simulator_validation_replays_the_engines_steps(tmp_path, monkeypatch, capsys, overlap):
    """The replay takes as many steps as the engine ran rounds for plain decoding, with the rounds in order and
    overlapped (forced here on the CPU: a finished request's slot is held one more round, and a round of only such
    rows still runs), and rows say how their rounds ran."""
    from dspark.engine import serve

    monkeypatch.setattr(serve, "OVERLAP_DEVICES", ("cuda", "cpu") if overlap else ())
    out = tmp_path / "val"
    run("experiment", "simulator_validation", "--host", "random:tiny-llama", "--drafters", "ngram", "dspark",
        "--policies", "full", "scheduler", "--concurrency", "1", "2", "--num-prompts", "3", "--max-new-tokens", "6",
        "--out-dir", str(out))
    doc = load(out / "simulator_validation.json")
    assert all(r["overlapped"] == overlap for r in doc["rows"])
    assert all(c["overlap"] == overlap for c in doc["constants"].values())
    for r in doc["rows"]:
        if r["method"] == "plain":
            assert r["predicted_steps"] == r["rounds"], r
    # --replay re-predicts the folder's measured rows from its traces, cost table and plain timings alone: with the
    # simulator unchanged, every prediction comes back as made (policies, draft costs, constants rebuilt faithfully)
    run("experiment", "simulator_validation", "--replay", str(out), "--out-dir", str(tmp_path / "again"))
    again = load(tmp_path / "again" / "simulator_validation.json")
    key = lambda r: (r["method"], r["policy"], r["concurrency"])  # noqa: E731
    assert sorted(map(key, again["rows"])) == sorted(map(key, doc["rows"])) and again["replayed"]["from"] == str(out)
    made = {key(r): r for r in doc["rows"]}
    for r in again["rows"]:
        assert r["predicted_tokens_per_s"] == pytest.approx(made[key(r)]["predicted_tokens_per_s"], rel=1e-9), r
        assert r["measured_tokens_per_s"] == made[key(r)]["measured_tokens_per_s"]
    assert again["max_relative_error"] == pytest.approx(doc["max_relative_error"])
    assert "Replayed" in (tmp_path / "again" / "simulator_validation.md").read_text()
    capsys.readouterr()
    assert cli(["experiment", "simulator_validation", "--replay", str(out), "--out-dir", str(out)]) == 1
    assert "the measured record stays as it was" in capsys.readouterr().err
    (out / "trace_dspark.json").unlink()
    assert cli(["experiment", "simulator_validation", "--replay", str(out), "--out-dir", str(tmp_path / "x")]) == 1
    assert "lacks trace_dspark.json" in capsys.readouterr().err


def test_simulate_cli_and_report(acceptance_dir, concurrency_dir, cost_path, tmp_path):
    out = tmp_path / "results"
    run("experiment", "simulate", "--traces", str(acceptance_dir / "trace_dspark_chat.json"), "--cost-table",
        str(cost_path), "--policies", "full", "threshold", "scheduler", "--concurrency", "1", "8", "64",
        "--out-dir", str(out / "sim"))
    doc = load(out / "sim" / "simulate.json")
    assert {(r["policy"], r["concurrency"]) for r in doc["rows"]} == {
        (p, C) for p in ("none", "full", "threshold", "scheduler") for C in (1, 8, 64)}
    assert all(r["engine"] == "replay" for r in doc["rows"])
    assert set(doc["break_even"]) == {"dspark/full/γ3", "dspark/threshold/γ3", "dspark/scheduler/γ3"}
    import shutil

    shutil.copytree(concurrency_dir, out / "cc")
    run("report", str(out))
    page = (out / "report.md").read_text()
    assert "## simulate:" in page and "## concurrency:" in page
    for link in ("sim/simulate_throughput.png", "cc/concurrency_pareto.png"):
        assert f"]({link})" in page and (out / link).is_file()


def test_report_on_an_empty_folder_is_a_clear_error(tmp_path, capsys):
    assert cli(["report", str(tmp_path)]) == 1
    assert "holds no experiment results" in capsys.readouterr().err


@pytest.mark.slow  # about 10 s: wandb starts its service process
def test_report_to_wandb_offline(concurrency_dir, tmp_path, monkeypatch):
    import shutil

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    shutil.copytree(concurrency_dir, tmp_path / "cc")
    run("report", str(tmp_path), "--report-to", "wandb")
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))


def test_the_package_imports_experiments_only_when_a_command_needs_them():
    import subprocess
    import sys
    from pathlib import Path

    code = ("import sys, dspark, dspark.cli, dspark.api, dspark.metrics; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'experiments'))")
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"


def test_commands_without_an_install(tmp_path):
    """Where dspark is not pip-installed (no `dspark.commands` entry points, e.g. a tree copied to a GPU machine),
    `python -m experiments` runs the same commands, and `dspark experiment` says how to get them."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-m", "experiments", "report", str(tmp_path)], cwd=root,
                          capture_output=True, text=True)
    assert done.returncode == 1 and "holds no experiment results" in done.stderr + done.stdout
    from unittest import mock

    with mock.patch("dspark.cli.plugin_commands", return_value={}):
        assert cli(["experiment", "concurrency"]) == 2
