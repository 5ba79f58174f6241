"""benchmarks/speed.py and benchmarks/gc_pause.py on the CPU: the scripts' smoke tests (GPU runs write their
results folders)."""
from __future__ import annotations

import json

import pytest

from conftest import load_script


def test_speed_writes_the_engine_rows_through_dspark_sweep_and_the_hf_comparison(tmp_path, capsys):
    """The engine rows are dspark.sweep's (one per setting and C, the speculative ones decoding plain decoding's
    tokens); speed.json holds what that tool lacks, its engine number the sweep's own plain row at C = 1."""
    script = load_script("benchmarks/speed.py")
    assert script.main(["--device", "cpu", "--host", "random:tiny-llama", "--concurrency", "1", "2",
                        "--drafters", "ngram", "ngram-full", "--skip-llama8b", "--max-new-tokens", "6",
                        "--num-prompts", "3", "--compile", "off", "--repeats", "2", "--out-dir", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "concurrency.json").read_text())
    assert doc["experiment"] == "concurrency" and doc["command"].startswith("python benchmarks/speed.py ")
    rows = doc["rows"]
    assert sorted((r["method"], r["concurrency"]) for r in rows) == [
        (m, C) for m in ("ngram", "ngram-full", "plain") for C in (1, 2)]
    for r in rows:
        assert r["policy"] == ("none" if r["method"] == "plain" else "full")
        assert r["draft_length"] == (0 if r["method"] == "plain" else 7)
        assert r["identical_to_plain"] == 1.0 and r["requests"] == 3
        assert len(r["tokens_per_s_repeats"]) == 2  # --repeats reaches the sweep
    result = json.loads((tmp_path / "speed.json").read_text())
    plain = next(r for r in rows if r["method"] == "plain" and r["concurrency"] == 1)
    assert result["engine_plain_tok_s"] == plain["tokens_per_s"]
    assert result["drafters"] == {"ngram": "model-free", "ngram-full": "model-free"}
    assert result["new_tokens"] == 6 and result["draft_length"] == 7
    assert "hf_custom_generate_error" not in result, result.get("hf_custom_generate_error")
    for key in ("hf_generate_tok_s", "hf_prompt_lookup_tok_s", "hf_custom_generate_tok_s"):
        assert result[key] > 0, key
    assert not any(k.startswith("llama8b") for k in result)  # --skip-llama8b
    out = capsys.readouterr().out
    assert f"| dspark slot engine, plain (concurrency.json) | {plain['tokens_per_s']:.1f} |" in out


def test_speed_refuses_zero_repeats(tmp_path):
    with pytest.raises(SystemExit):
        load_script("benchmarks/speed.py").main(["--device", "cpu", "--repeats", "0", "--out-dir", str(tmp_path)])


def test_gc_pause_script_runs_each_setting_in_its_own_process(tmp_path):
    """benchmarks/gc_pause.py on the CPU: one row per (repeat, setting, decode), each from a fresh process."""
    path = load_script("benchmarks/gc_pause.py").main(
        ["--out-dir", str(tmp_path), "--host", "random:tiny-llama", "--compile", "off", "--new-tokens", "3",
         "--repeats", "1"])
    doc = json.loads(path.read_text())
    assert sorted(r["freeze"] for r in doc["rows"]) == ["off", "on"]
    for row in doc["rows"]:
        assert row["new_tokens"] == 3 and {"gc_ms", "gen0", "gen1", "gen2", "full_collect_ms"} <= set(row)
    assert doc["command"].startswith("python benchmarks/gc_pause.py") and doc["environment"]["torch"]
    assert "| 0 | on | 3 |" in (tmp_path / "gc_pause.md").read_text()
