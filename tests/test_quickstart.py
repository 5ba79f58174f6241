"""`dspark quickstart`: where its files go, the break-even concurrency, the report as a reader sees it, and the
`--size ci` run end to end on the CPU (slow: about a minute and a half)."""
from __future__ import annotations

import json
import math
import shutil
import subprocess
from pathlib import Path

import pytest

from dspark.cli import main
from dspark.config import to_dict
from dspark.metrics import break_even
from dspark.quickstart import METHODS, SIZES, QuickstartConfig, Size, Stages, write_report

ROOT = Path(__file__).resolve().parents[1]


def strict_json(text: str):
    """json.loads that refuses NaN / Infinity, as strict parsers (and the JSON standard) do."""
    def refuse(token):
        raise ValueError(f"not JSON: {token}")
    return json.loads(text, parse_constant=refuse)


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs the git checkout")
def test_the_default_output_is_ignored_by_git():
    """A quickstart run from the repository root leaves `git status` clean: its default output is git-ignored."""
    output = QuickstartConfig().output
    probe = subprocess.run(["git", "check-ignore", "-q", f"{output}/report.md"], cwd=ROOT)
    assert probe.returncode == 0, f"{output}/ is not ignored by .gitignore"


def test_break_even_is_the_first_concurrency_not_faster_than_plain():
    rows = [{"method": "a", "concurrency": C, "speedup": s} for C, s in ((1, 1.3), (4, 1.01), (16, 1.0), (64, 0.7))]
    rows += [{"method": "b", "concurrency": C, "speedup": s} for C, s in ((1, 0.9), (4, 1.2))]
    rows += [{"method": "c", "concurrency": C, "speedup": 1.1} for C in (1, 4)]
    assert break_even(rows) == {"a": 16, "b": 1, "c": None}  # equal to plain counts as not faster


def row(C: int, method: str, speedup: float, tau: float) -> dict:
    plain = method == "plain"
    return {"concurrency": C, "method": method, "requests": max(2, C), "tau": tau,
            "verified_per_round": 0.0 if plain else 7.0,
            "verify_rate": math.nan if plain else 0.1, "tokens_per_s": 100.0 * C * speedup, "speedup": speedup,
            "drafted_rounds": None if plain else 10, "rounds": 40, "same_as_plain": 1.0}


def test_the_report_explains_its_columns_and_says_when_a_drafter_does_not_pay(tmp_path):
    """Rendering only (synthetic rows): strict JSON, undefined values as dashes, the column legend, durations, and a
    plain sentence for a drafter that never pays next to the methods that do."""
    size = Size(train_conversations=8, max_steps=2, seq_len=64, batch_size=1, num_layers=1, max_anchors=4, lr=1e-3,
                warmup_ratio=0.0, eval_prompts=2, waves=1, max_new_tokens=4, max_prompt_length=32, concurrency=(1, 4),
                profile_repeats=1)
    speedups = {"plain": (1.0, 1.0), "ngram": (1.2, 0.9), "dspark": (0.6, 0.5), "dspark+scheduler": (1.01, 0.98)}
    rows = [row(C, m, speedups[m][i], 1.0 if m == "plain" else 1.3) for i, C in enumerate((1, 4)) for m in METHODS]
    doc = {"command": "dspark quickstart --size ci", "config": to_dict(QuickstartConfig(size="ci")),
           "size": {**size.__dict__, "concurrency": [1, 4]}, "data": "data.jsonl", "checkpoint": str(tmp_path),
           "prompts": 2, "draft_length": 7, "host_dtype": "torch.float32", "training": None, "results": rows,
           "break_even": break_even([r for r in rows if r["method"] != "plain"]),
           "costs": [{"concurrency": 1, "step_s": 0.05, "verify_step_s": 0.06, "draft_s": 0.04},
                     {"concurrency": 4, "step_s": 0.08, "verify_step_s": 0.3, "draft_s": 0.05}],
           "environment": {"date": "d", "gpu": None, "processor": "x86_64", "cpu_threads": 2, "torch": "t",
                           "transformers": "t"}}
    stages = Stages(total=1)
    with stages.stage("decode", "decoding"):
        pass
    report = write_report(tmp_path, doc, stages)
    text = report.read_text()
    assert "nan" not in text.lower() and "| 1 | plain | 1.000 | 0.000 | 100.000 | 1.000 | – | 1.000 |" in text
    assert "**τ**:" in text and "**rounds drafted**:" in text and "**× plain**:" in text  # every column explained
    assert "a 1-layer DSpark drafter" in text and "1 layers" not in text
    assert "**dspark does not pay on this machine at any C measured**" in text
    assert "ngram (1.200× plain at C = 1)" in text and "dspark+scheduler (1.010×" not in text  # 1 %: within noise
    assert "costs about 2.00 host steps" in text  # a DSpark round: the verify (1.20×) plus the drafter's step (0.80×)
    assert "towards 8× it is compute-bound" in text  # at C = 4 verifying 8 tokens cost 3.75× a one-token step
    assert "ngram C = 4, dspark C = 1, dspark+scheduler C = 4" in text  # break-even per method
    assert "| decode |" in text and "| total |" in text  # the durations, per stage and in all
    saved = strict_json((tmp_path / "report.json").read_text())
    assert saved["results"][0]["verify_rate"] is None and set(saved["durations"]) == {"wall_s", "cpu_s"}
    assert (tmp_path / "report.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_quickstart_ci_size_writes_its_report(tmp_path, capsys):
    out = tmp_path / "qs"
    assert main(["quickstart", "--size", "ci", "--output", str(out), "--device", "cpu"]) == 0
    printed = capsys.readouterr().out
    assert "[quickstart 1/5]" in printed and "[quickstart 5/5]" in printed  # it says where it is, stage by stage
    report = strict_json((out / "report.json").read_text())
    concurrency = list(SIZES["ci"].concurrency)
    cells = {(r["method"], r["concurrency"]): r for r in report["results"]}
    assert set(cells) == {(m, C) for m in METHODS for C in concurrency}  # every method at every concurrency
    assert set(report["break_even"]) == set(METHODS[1:])  # one per speculative method (plain is the reference)
    assert all(v is None or v in concurrency for v in report["break_even"].values())
    assert all(r["lossless"] for r in cells.values())  # float32 greedy: every method's tokens equal plain's
    for C in concurrency:
        assert cells["plain", C]["tau"] == 1.0 and cells["plain", C]["speedup"] == 1.0
        assert cells["plain", C]["verify_rate"] is None  # undefined for plain decoding: null, not NaN
        assert cells["ngram", C]["tau"] >= 1.0 and cells["dspark", C]["tau"] >= 1.0
        assert cells["dspark", C]["drafted_rounds"] == cells["dspark", C]["rounds"]  # verify-all drafts every round
        assert 0 < cells["dspark+scheduler", C]["drafted_rounds"] <= cells["dspark+scheduler", C]["rounds"]
    durations = report["durations"]["wall_s"]
    assert set(durations) == {"load", "train", "profile", "decode", "total"}  # total: until the report is written
    text = (out / "report.md").read_text()
    assert "Break-even concurrency" in text and "report.png" in text and "training_curve.png" in text
    for png in (out / "report.png", out / "training_curve.png"):
        assert png.read_bytes()[:4] == b"\x89PNG"
    cost = strict_json((out / "cost.json").read_text())
    assert len(cost["draft"]) == 1 and next(iter(cost["draft"])).startswith("dspark/K7/")  # the gate's price
    assert cost["batch_sizes"] == concurrency

    again = tmp_path / "again"  # no training, with the drafter just trained
    assert main(["quickstart", "--size", "ci", "--output", str(again), "--device", "cpu",
                 "--drafter-path", str(out / "drafter")]) == 0
    assert "reusing the trained drafter" in capsys.readouterr().out and not (again / "drafter").exists()
    reused = {(r["method"], r["concurrency"]): r for r in strict_json((again / "report.json").read_text())["results"]}
    assert reused["dspark", 1]["tau"] == cells["dspark", 1]["tau"]  # the same drafter, the same greedy rounds
