"""benchmarks/train_speed.py on the CPU: the tiny shape, every drafter, fused and reference loss, one step each."""
from __future__ import annotations

import json

from conftest import load_script


def test_train_speed_cpu_smoke_writes_rows_baseline_and_table(tmp_path):
    bench = load_script("benchmarks/train_speed.py")
    result = bench.main(["--device", "cpu", "--out-dir", str(tmp_path), "--steps", "1", "--warmup", "0",
                         "--seq-len", "64"])
    saved = json.loads((tmp_path / "train_speed.json").read_text())
    assert saved["rows"] == result["rows"] and saved["gemm_tflops"] > 0
    for key, impl in (("rows", "fused"), ("baseline", "reference")):
        assert [r["drafter"] for r in saved[key]] == list(bench.DRAFTERS)
        for row in saved[key]:
            assert row["loss_impl"] == impl and "error" not in row
            assert row["tokens_per_s"] > 0 and row["tflops"] > 0 and 0 < row["fraction_of_peak"]
            assert row["flops_per_step"] == row["host_flops"] + row["drafter_flops"] > 0
            assert sum(row[f"{s}_ms"] for s in bench.STAGES) <= row["step_ms"] * 1.05
            assert row["peak_memory_gb"] is None and row["last_loss"] == row["last_loss"]  # no GPU; a finite loss
    # the same drafter and data under both losses: the same first-step loss
    for fused, reference in zip(saved["rows"], saved["baseline"]):
        assert abs(fused["last_loss"] - reference["last_loss"]) < 1e-4 * max(1.0, abs(reference["last_loss"]))
    table = (tmp_path / "train_speed.md").read_text()
    assert "## Fused against reference" in table and "| tiny | eagle3 |" in table
