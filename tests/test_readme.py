"""The README's usage commands and snippet run as written (real SmolLM2, CPU), in their order, in one directory."""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def blocks(language: str) -> list[str]:
    usage = README.split("## The three uses", 1)[1].split("\n## ", 1)[0]
    return re.findall(rf"```{language}\n(.*?)```", usage, flags=re.S)


def test_readme_starts_with_the_two_commands():
    first = re.search(r"```bash\n(.*?)```", README, flags=re.S).group(1).strip().splitlines()
    assert len(first) == 2
    assert "quickstart" in first[0] and "pytest" in first[1]
    ci = (ROOT / ".ci" / "run").read_text()
    assert first[1].split("#")[0].strip() in ci  # CI runs the README's test command


@pytest.mark.slow
def test_readme_usage_runs(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"}
    commands = [line for block in blocks("bash") for line in block.strip().splitlines()]
    assert len(commands) >= 6 and all(c.startswith("dspark ") for c in commands)
    outputs = {}
    for command in commands:
        argv = shlex.split(command)
        done = subprocess.run([sys.executable, "-m", "dspark", *argv[1:]], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, f"{command}\n{done.stderr[-3000:]}"
        outputs[argv[1]] = outputs.get(argv[1], []) + [done.stdout]
    metrics = json.loads(outputs["eval"][0])
    assert metrics["drafter"] == "dspark" and len(metrics["conditional_acceptance"]) == 7
    # tau is one bonus token plus the accepted drafts of a round, and its interval brackets it
    assert metrics["tau"] == pytest.approx(1.0 + metrics["accepted_per_round"], abs=1e-6)
    lo, hi = metrics["tau_ci95"]
    assert lo <= metrics["tau"] <= hi
    assert metrics["tau"] == pytest.approx(sum(metrics["per_request_tau_sum"]) / sum(metrics["per_request_rounds"]))
    generated = json.loads(outputs["generate"][0])
    assert generated["outputs"][0]["token_ids"] and {"tau", "rounds", "tokens_per_s"} <= set(generated["stats"])
    for name in ("sweep", "sweep-scheduler"):
        written = {p.name for p in (tmp_path / "runs" / name).iterdir()}  # dspark.sweep's files
        assert {"concurrency.json", "concurrency.md", "concurrency_throughput.png"} <= written

    (snippet,) = blocks("python")
    done = subprocess.run([sys.executable, "-c", snippet], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip()
