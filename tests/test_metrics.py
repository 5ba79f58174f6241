"""Tests for dspark.metrics: the §5 vocabulary on a hand-built rollout log, and tau's bootstrap intervals."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from dspark.cli import main
from dspark.engine.results import GenerationResult, RoundLog
from dspark.metrics import paired_tau_ratio, summarize, tau_interval


def _result(rows: list[tuple[int, int, int]], requests: int, K: int = 3) -> GenerationResult:
    """rows: (request, verified, accepted), one round each, in order; proposed = K, committed = accepted + 1."""
    log = RoundLog()
    for i, (request, verified, accepted) in enumerate(rows):
        log.request.append(torch.tensor([request]))
        log.round.append(torch.tensor([i]))
        log.proposed.append(torch.tensor([K]))
        log.verified.append(torch.tensor([verified]))
        log.accepted.append(torch.tensor([accepted]))
        log.committed.append(torch.tensor([accepted + 1]))
        log.confidence.append(None)
        log.batch.append(requests)
        log.time.append(float(i))
    tokens = [[0] * sum(a + 1 for r, _, a in rows if r == q) for q in range(requests)]
    return GenerationResult(token_ids=tokens, finish_reasons=["length"] * requests, log=log, seconds=1.0,
                            rounds=len(rows), latency=[1.0] * requests)


def test_summary_of_a_hand_built_log():
    m = summarize(_result([(0, 3, 2), (0, 3, 0), (1, 3, 1)], requests=2), draft_length=3)
    assert m["tau"] == pytest.approx(2.0) and m["accepted_per_round"] == pytest.approx(1.0)
    assert m["conditional_acceptance"] == pytest.approx([2 / 3, 1 / 2, 0.0])
    assert m["prefix_survival"] == pytest.approx([2 / 3, 1 / 3, 0.0])
    assert m["verify_rate"] == pytest.approx(3 / 9) and m["verified_token_savings"] == pytest.approx(0.0)
    assert m["per_request_tau_sum"] == [4, 2] and m["per_request_rounds"] == [2, 1]
    lo, hi = m["tau_ci95"]
    assert lo <= m["tau"] <= hi


def test_partial_verification_counts_only_rows_that_saw_position_k():
    m = summarize(_result([(0, 1, 1), (0, 3, 3), (0, 0, 0)], requests=1), draft_length=3)
    assert m["rows_verifying_k"] == [2, 1, 1]
    assert m["conditional_acceptance"] == pytest.approx([1.0, 1.0, 1.0])
    assert m["verified_token_savings"] == pytest.approx(1 - 4 / 9)


def test_tau_interval_is_deterministic_degenerate_when_requests_agree_and_checks_input():
    assert tau_interval([6, 6, 6], [3, 3, 3]) == pytest.approx([2.0, 2.0])
    spread = tau_interval([3, 9, 4, 7], [3, 3, 2, 4])
    assert spread == tau_interval([3, 9, 4, 7], [3, 3, 2, 4]) and spread[0] < 23 / 12 < spread[1]
    assert all(math.isnan(v) for v in tau_interval([0, 0], [0, 0]))
    with pytest.raises(ValueError, match="round counts"):
        tau_interval([1, 2], [1])
    with pytest.raises(ValueError, match="level"):
        tau_interval([1], [1], level=1.0)


def test_tau_interval_covers_the_true_tau_about_95_percent_of_the_time():
    # 200 simulated evaluations of 60 requests each: per-request acceptance rates differ (prompt difficulty) and
    # rounds within a request share it, the correlation a round-level bootstrap would miss
    g = torch.Generator().manual_seed(1)
    covered, trials = 0, 200
    for _ in range(trials):
        rate = torch.rand(60, generator=g) * 0.8
        rounds = torch.randint(5, 40, (60,), generator=g)
        accepted = [int(torch.binomial(n.double(), r.double(), generator=g)) for n, r in zip(rounds, rate)]
        tau_sum = [a + int(n) for a, n in zip(accepted, rounds)]
        true_tau = 1 + 0.4  # E[rate] = 0.4 accepted per round; rounds independent of the rate
        lo, hi = tau_interval(tau_sum, rounds.tolist(), resamples=400)
        covered += lo <= true_tau <= hi
    assert 0.88 <= covered / trials <= 0.99, covered


def test_paired_ratio_identical_dominating_and_mismatched_runs():
    a = summarize(_result([(0, 3, 2), (0, 3, 0), (1, 3, 1), (2, 3, 3)], requests=3), draft_length=3)
    same = paired_tau_ratio(a, a)
    assert same["ratio"] == pytest.approx(1.0) and same["ci"] == pytest.approx([1.0, 1.0])
    assert same["p_not_above"] == 1.0  # a tie is "not above"
    worse = summarize(_result([(0, 3, 1), (0, 3, 0), (1, 3, 0), (2, 3, 2)], requests=3), draft_length=3)
    better = paired_tau_ratio(a, worse)
    assert better["ratio"] == pytest.approx(2.5 / 1.75) and better["ci"][0] > 1.0 and better["p_not_above"] == 0.0
    fewer = summarize(_result([(0, 3, 2)], requests=1), draft_length=3)
    with pytest.raises(ValueError, match="not the same prompts"):
        paired_tau_ratio(a, fewer)
    with pytest.raises(ValueError, match="no per-request sums"):
        paired_tau_ratio(a, {"tau": 1.5})
    with pytest.raises(ValueError, match="level"):
        paired_tau_ratio(a, worse, level=0.0)
    empty = dict(a, per_request_tau_sum=[0, 0, 0], per_request_rounds=[0, 0, 0])
    with pytest.raises(ValueError, match="no request-rounds"):
        paired_tau_ratio(a, empty)


def _write(path, result, **fields):
    path.write_text(json.dumps({"host": "h", "data": "d", "split": "heldout", **fields,
                                **summarize(result, draft_length=3)}))
    return str(path)


def test_compare_command(tmp_path, capsys):
    a = _write(tmp_path / "a.json", _result([(0, 3, 2), (1, 3, 1), (1, 3, 3)], requests=2))
    b = _write(tmp_path / "b.json", _result([(0, 3, 1), (1, 3, 0), (1, 3, 2)], requests=2))
    assert main(["compare", "--run", a, "--against", b, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["run"] == a and out["against"] == b and out["ratio"] == pytest.approx(3.0 / 2.0)
    assert main(["compare", "--run", a, "--against", b]) == 0
    assert "paired bootstrap over 2 requests" in capsys.readouterr().out

    other = _write(tmp_path / "c.json", _result([(0, 3, 1), (1, 3, 0), (1, 3, 2)], requests=2), data="humaneval")
    assert main(["compare", "--run", a, "--against", other]) == 1
    assert "not over the same prompts: data" in capsys.readouterr().err
    assert main(["compare", "--run", a, "--against", str(tmp_path / "missing.json")]) == 1
    assert "no such eval result" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text("{cut")
    assert main(["compare", "--run", a, "--against", str(tmp_path / "bad.json")]) == 1
    assert "not an eval JSON" in capsys.readouterr().err


@pytest.mark.parametrize("key, a, b", [("offset", 0, 32), ("limit", 32, 64), ("max_prompt_length", 512, 256),
                                       ("heldout_fraction", 0.02, 0.01), ("max_new_tokens", 128, 64),
                                       ("temperature", 0.0, 1.0), ("top_p", 1.0, 0.9), ("top_k", 0, 50),
                                       ("seed", 0, 1), ("verifier", "full", "threshold"), ("threshold", None, 0.5)])
def test_compare_refuses_results_that_differ_in_a_setting(tmp_path, capsys, key, a, b):
    rows = [(0, 3, 2), (1, 3, 1), (1, 3, 3)]
    first = _write(tmp_path / "a.json", _result(rows, requests=2), **{key: a})
    second = _write(tmp_path / "b.json", _result(rows, requests=2), **{key: b})
    assert main(["compare", "--run", first, "--against", second]) == 1
    assert f"{key} {a!r} vs {b!r}" in capsys.readouterr().err
    with pytest.raises(ValueError, match=f"{key} "):  # the library call refuses them too
        paired_tau_ratio(json.loads(Path(first).read_text()), json.loads(Path(second).read_text()))
    older = _write(tmp_path / "c.json", _result(rows, requests=2))  # written before the setting was recorded
    assert main(["compare", "--run", first, "--against", older]) == 1
    assert f"{key} {a!r} vs (not recorded)" in capsys.readouterr().err
