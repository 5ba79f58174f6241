"""benchmarks/round_profile.py on the CPU: the script's smoke test (the GPU run is recorded in RESULTS.md)."""
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
