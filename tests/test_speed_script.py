"""benchmarks/speed.py on the CPU: the script's smoke test (the GPU runs are recorded in benchmarks/RESULTS.md)."""
from __future__ import annotations

import json

import pytest

from conftest import load_script


def _script():
    return load_script("benchmarks/speed.py")


def test_speed_writes_the_issue_keys_and_the_cpu_split(tmp_path, capsys):
    script = _script()
    assert script.main(["--device", "cpu", "--host", "random:tiny-llama", "--concurrency", "1", "2",
                        "--spec-concurrency", "1", "2", "--drafters", "ngram", "--skip-llama8b",
                        "--max-new-tokens", "6", "--max-prompts", "4", "--compile", "off", "--overlap", "on",
                        "--repeats", "3", "--out-dir", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "speed.json").read_text())
    assert result["hf_generate_tok_s"] > 0
    assert set(result["plain_tok_s"]) == {"1", "2"} and all(v > 0 for v in result["plain_tok_s"].values())
    ngram = result["speculative"]["ngram"]
    assert set(ngram["tok_s"]) == set(ngram["tau"]) == {"1", "2"} and all(t >= 1 for t in ngram["tau"].values())
    for runs in result["runs"].values():
        for run in runs.values():
            # the CPU's own time a round: on the CPU nothing is waited for, so it is the whole round
            assert run["cpu_ms_per_round"] > 0 and run["wait_ms_per_round"] >= 0
            assert 0 <= run["admit_ms_per_round"] <= run["cpu_ms_per_round"] and run["admissions"] >= 1
            each = run["admit_ms_per_round"] * run["rounds"] / run["admissions"]  # CPU time an admission took
            assert run["admit_ms_each"] == pytest.approx(each)
            expected = run["seconds"] * 1000 / run["rounds"] - run["wait_ms_per_round"]
            assert run["cpu_ms_per_round"] == pytest.approx(expected)
    out = capsys.readouterr().out
    assert "| plain | 2 |" in out and "| ngram (model-free) | 1 |" in out
    # the garbage collections inside each timed loop, counted per generation (dspark.engine.serve.quiet_gc)
    assert result["environment"]["gc_freeze"] == "on"
    assert result["environment"]["drafter_admission"] == "captured"
    for runs in result["runs"].values():
        for run in runs.values():
            assert run["gc_ms"] >= 0 and len(run["gc_collections"]) == 3
            # three timed decodes, the row the median one by tokens/s
            assert len(run["tok_s_repeats"]) == 3 and run["tok_s"] == sorted(run["tok_s_repeats"])[1]


def test_gc_pause_script_runs_each_setting_in_its_own_process(tmp_path):
    """benchmarks/gc_pause.py on the CPU: one row per (repeat, setting, decode), each from a fresh process."""
    path = load_script("benchmarks/gc_pause.py").main(
        ["--out-dir", str(tmp_path), "--host", "random:tiny-llama", "--compile", "off", "--new-tokens", "3",
         "--repeats", "1"])
    doc = json.loads(path.read_text())
    assert sorted(r["freeze"] for r in doc["rows"]) == ["off", "on"]
    for row in doc["rows"]:
        assert row["gc_ms"] >= 0 and row["gen2"] >= 0 and row["objects"] > 0 and row["full_collect_ms"] > 0
    assert doc["command"].startswith("python benchmarks/gc_pause.py") and doc["environment"]["torch"]
    assert "| 0 | on | 3 |" in (tmp_path / "gc_pause.md").read_text()
