"""benchmarks/round_profile.py on the CPU: the script's smoke test (a GPU run: benchmarks/results/round-profile/)."""
from __future__ import annotations

import json

from conftest import load_script


def _script():
    return load_script("benchmarks/round_profile.py")


def test_round_profile_writes_a_census_and_engine_rows(tmp_path, capsys):
    script = _script()
    assert script.main(["--device", "cpu", "--host", "random:tiny-llama", "--methods", "plain", "ngram",
                        "--compile", "off", "--concurrency", "1", "--new", "4", "--prompt-length", "200",
                        "--out-dir", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "round_profile.json").read_text())
    assert result["prompt_length"] == 200
    rows = {r["method"]: r for r in result["rows"]}
    assert set(rows) == {"plain", "ngram"}
    assert "propose" not in rows["plain"]["census"] and rows["ngram"]["census"]["propose"]["kernels"] > 0
    for row in rows.values():
        census = row["census"]
        assert census["verify_w1"]["kernels"] > 0 and census["accept"]["kernels"] > 0
        assert sum(n for n, _ in census["verify_w1"]["by_name"].values()) == census["verify_w1"]["kernels"]
        assert row["engine"]["1"]["tok_s"] > 0
    assert "verify_w8" in rows["ngram"]["census"]  # the n-gram's full width, K + 1
    assert "| off | ngram | 1 |" in capsys.readouterr().out


def test_round_profile_sets_sdpa_and_inductor_and_names_its_file(tmp_path):
    import pytest
    import torch

    from dspark.engine.attention import SDPA_BACKENDS, restrict_sdpa

    switches = {name: getattr(torch.backends.cuda, f.replace("enable_", "") + "_enabled")()
                for name, f in SDPA_BACKENDS.items()}
    import torch._inductor.config as inductor

    try:
        with inductor.patch(combo_kernels=False):  # restored after: main sets it for the whole process
            assert _script().main(["--device", "cpu", "--host", "random:tiny-llama", "--methods", "plain",
                                   "--compile", "off", "--concurrency", "1", "--new", "2", "--sdpa", "efficient",
                                   "math", "--inductor", "combo_kernels=True", "--out-dir", str(tmp_path)]) == 0
            assert inductor.combo_kernels is True
        assert not torch.backends.cuda.cudnn_sdp_enabled() and not torch.backends.cuda.flash_sdp_enabled()
        assert torch.backends.cuda.mem_efficient_sdp_enabled() and torch.backends.cuda.math_sdp_enabled()
        result = json.loads((tmp_path / "round_profile_sdpa-efficient-math_combo_kernels-True.json").read_text())
        assert result["sdpa"] == ["efficient", "math"] and result["inductor"] == {"combo_kernels": True}
        assert result["rows"][0]["engine"]["1"]["tok_s"] > 0
        with pytest.raises(ValueError, match="no option"):
            _script().main(["--device", "cpu", "--inductor", "combo_kernel=True", "--out-dir", str(tmp_path)])
        with pytest.raises(ValueError, match="SDPA backends must be among"):
            restrict_sdpa(["fastest"])
    finally:
        restrict_sdpa([name for name, on in switches.items() if on])


def test_loop_profile_writes_the_loops_top_functions_for_plain_and_a_policy(tmp_path, capsys):
    """benchmarks/loop_profile.py on the CPU: plain decoding and a (drafter, policy) on the same prompts, each with
    its decode's seconds, rounds, engine stats and the functions with the most own time (no CUDA calls here)."""
    script = load_script("benchmarks/loop_profile.py")
    assert script.main(["--device", "cpu", "--host", "random:tiny-llama", "--drafter", "ngram", "--policy", "full",
                        "--concurrency", "2", "--num-prompts", "4", "--new", "4", "--top", "5",
                        "--out-dir", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "loop_profile.json").read_text())
    assert [r["method"] for r in result["rows"]] == ["plain", "ngram/full"]
    for row in result["rows"]:
        assert row["seconds"] > 0 and row["rounds"] >= 4 and row["engine_stats"]["rounds"] == row["rounds"]
        assert len(row["top"]) == 5 and row["top"][0]["own_s"] >= row["top"][-1]["own_s"]
        assert row["blocking"] == {}
    assert "== ngram/full:" in capsys.readouterr().out


def test_loop_profile_refuses_a_scheduler_without_a_cost_table(tmp_path):
    import pytest

    with pytest.raises(SystemExit):
        load_script("benchmarks/loop_profile.py").main(["--device", "cpu", "--host", "random:tiny-llama",
                                                        "--policy", "scheduler", "--out-dir", str(tmp_path)])


def test_argmax_split_script_writes_its_table(tmp_path):
    """benchmarks/argmax_split.py on the CPU (eager, float32): both argmaxes agree on every shape, and the results
    file has the machine, the command and a row per (variant, V, rows)."""
    path = load_script("benchmarks/argmax_split.py").main(
        ["--device", "cpu", "--vocab", "32000", "1000", "--rows", "1", "3", "--calls", "2", "--repeats", "2",
         "--out-dir", str(tmp_path)])
    doc = json.loads(path.read_text())
    assert len(doc["rows"]) == 2 * 2 * 2 and all(r["same"] and r["split_us"] > 0 for r in doc["rows"])
    assert doc["environment"]["torch"] and doc["command"].startswith("python benchmarks/argmax_split.py")
    assert "| add+argmax | 32000 | 3 |" in (tmp_path / "argmax_split.md").read_text()
