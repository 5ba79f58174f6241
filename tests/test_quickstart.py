"""`dspark quickstart --size ci` end to end on the CPU: train, profile, evaluate, report (slow: ~3-4 minutes)."""
from __future__ import annotations

import json

import pytest

from dspark.cli import main


@pytest.mark.slow
def test_quickstart_ci_size_writes_its_report(tmp_path, capsys):
    out = tmp_path / "qs"
    assert main(["quickstart", "--size", "ci", "--output", str(out), "--device", "cpu"]) == 0
    printed = capsys.readouterr().out
    assert "[quickstart 1/" in printed and "lossless=True" in printed  # it says where it is, step by step
    report = json.loads((out / "report.json").read_text())
    rows = {r["method"]: r for r in report["results"]}
    assert list(rows) == ["plain", "ngram", "dspark", "dspark+scheduler"]
    assert all(r["lossless"] for r in rows.values())  # greedy: every method's tokens equal plain decoding's
    assert rows["plain"]["tau"] == 1.0 and rows["ngram"]["tau"] >= 1.0 and rows["dspark"]["tau"] >= 1.0
    for key in ("tau", "verified_token_savings", "tokens_per_s", "speedup"):
        assert key in rows["dspark+scheduler"]
    text = (out / "report.md").read_text()
    assert "τ" in text and "dspark+scheduler" in text and "report.png" in text
    for png in (out / "report.png", out / "drafter" / "training_curve.png"):
        assert png.read_bytes()[:4] == b"\x89PNG"
    assert (out / "cost.json").exists()
    cost = json.loads((out / "cost.json").read_text())
    assert len(cost["draft"]) == 1 and next(iter(cost["draft"])).startswith("dspark/K7/")  # the gate's price
    drafted, rounds = map(int, rows["dspark+scheduler"]["drafted_rounds"].split("/"))
    assert 0 < drafted <= rounds and rows["dspark"]["drafted_rounds"].split("/")[0] == str(rows["dspark"]["rounds"])

    again = tmp_path / "again"  # steps 3 and 4 only, with the drafter just trained
    assert main(["quickstart", "--size", "ci", "--output", str(again), "--device", "cpu",
                 "--drafter-path", str(out / "drafter")]) == 0
    assert "reusing the trained drafter" in capsys.readouterr().out and not (again / "drafter").exists()
    reused = {r["method"]: r for r in json.loads((again / "report.json").read_text())["results"]}
    assert reused["dspark"]["tau"] == rows["dspark"]["tau"]  # the same drafter, the same greedy rounds
