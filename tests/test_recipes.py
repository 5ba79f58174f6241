"""experiments/recipes/: every recipe's sections are valid settings of the commands that read them, and the CPU recipe
trains with the public command as written."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dspark.config import RECIPE_SECTIONS, parse

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted((ROOT / "experiments" / "recipes").glob("*.yaml"))


def command_types(section: str) -> list[type]:
    """The dataclasses the `dspark <section>` command parses."""
    from dspark import cli
    from dspark.training.train import TrainConfig

    return {"train": [TrainConfig],
            "eval": [cli.HostOptions, cli.DecodeOptions, cli.EvalOptions, cli.ServeOptions],
            "bench": [cli.HostOptions, cli.DecodeOptions, cli.BenchOptions]}[section]


def test_the_recorded_hosts_have_recipes():
    names = {p.stem for p in RECIPES}
    for host in ("smollm2", "qwen2.5-coder-1.5b"):
        assert {f"{host}-{d}" for d in ("dspark", "dflash", "eagle3")} <= names


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_every_section_parses_for_its_command(recipe):
    data = yaml.safe_load(recipe.read_text())
    sections = [k for k in data if k in RECIPE_SECTIONS]
    assert "train" in sections and set(sections) <= {"train", "eval", "bench"}
    for section in sections:
        parsed = parse(command_types(section), ["--config", str(recipe)], prog=f"dspark {section}")
        if section == "train":
            (cfg,) = parsed
            assert cfg.host == data["host"] and cfg.drafter == data["train"]["drafter"]
            assert (ROOT / cfg.data).exists(), f"{recipe.name}: training data {cfg.data} is not in the repository"
            assert cfg.output == f"runs/{recipe.stem.replace('qwen2.5-coder-1.5b', 'qwen1.5b')}"


@pytest.mark.slow
def test_the_cpu_recipe_trains_with_the_public_command(tmp_path):
    recipe = ROOT / "experiments" / "recipes" / "smollm2-dspark-cpu.yaml"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "dspark", "train", "--config", str(recipe), "--max-steps", "2",
                           "--output", str(tmp_path / "out")], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    trained = yaml.safe_load((tmp_path / "out" / "config.yaml").read_text())
    wanted = yaml.safe_load(recipe.read_text())["train"]
    assert trained["max_steps"] == 2 and trained["drafter_args"] == wanted["drafter_args"]
    assert {k: trained[k] for k in ("data", "seq_len", "batch_size", "lr")} == \
        {k: wanted[k] for k in ("data", "seq_len", "batch_size", "lr")}
    assert (tmp_path / "out" / "checkpoint-00000002" / "config.json").exists()
