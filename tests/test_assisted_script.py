"""benchmarks/assisted.py on the CPU: every row present, every greedy output equal to its own plain decoding, and
the predicted draft length drawn from the measured rows (the GPU run is recorded in benchmarks/results/small-lm/)."""
from __future__ import annotations

import json

from tests.conftest import load_script


def test_assisted_benchmark_rows_on_a_random_host(tmp_path):
    script = load_script("benchmarks/assisted.py")
    assert script.main(["--host", "random:tiny-qwen2", "--assistant", "random:tiny-qwen2", "--device", "cpu",
                        "--sets", "mtbench", "--num-prompts", "2", "--max-new-tokens", "6", "--draft-lengths", "1",
                        "3", "--concurrency", "1", "2", "--num-assistant-tokens", "2", "--out-dir",
                        str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "assisted.json").read_text())
    rows = doc["sets"]["mtbench"]["rows"]
    methods = [r["method"] for r in rows]
    assert methods[:3] == ["transformers plain", "transformers assisted (default)",
                           "transformers assisted (num_assistant_tokens=2)"]
    engine = [r for r in rows if r["method"].startswith("dspark")]
    assert sorted((r["method"], r["draft_length"], r["concurrency"]) for r in engine) == sorted(
        [("dspark plain", 0, c) for c in (1, 2)] + [("dspark small-lm", k, c) for k in (1, 3) for c in (1, 2)])
    assert all(r["identical_to_plain"] == 1.0 for r in rows)  # fp32 greedy: every method is lossless
    assert sum(bool(r.get("best")) for r in rows) == 1
    part = doc["sets"]["mtbench"]
    assert part["fastest_gamma"] in (1, 3) and part["predicted"]["draft_length"] in (0, 1, 3)
    assert part["predicted"]["reason"].startswith("γ = ")
    assert (tmp_path / "assisted.md").read_text().count("| dspark small-lm |") == 4
