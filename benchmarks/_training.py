"""What the CPU benchmarks share: one `dspark.training.train` run of a TrainConfig in a fresh process, its
metrics back."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from dspark.config import to_dict

ROOT = Path(__file__).resolve().parents[1]


def train_in_subprocess(cfg, **env: str) -> list[dict]:
    """Train `cfg` (a dspark.training.train.TrainConfig) with `python -m dspark.training.train --config` on the
    CPU, offline, in a fresh interpreter (so allocator settings and caches start clean); `env` adds environment
    variables.
    Returns the run's metrics.jsonl records; a failed run stops the benchmark with the end of its stderr."""
    out = Path(cfg.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    config = out.parent / f"{out.name}.yaml"
    config.write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    full_env = dict(os.environ, CUDA_VISIBLE_DEVICES="", HF_HUB_OFFLINE="1", **env,
                    PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, "-m", "dspark.training.train", "--config", str(config)], env=full_env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode:
        raise SystemExit(f"training {out.name} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return [json.loads(line) for line in open(out / "metrics.jsonl")]
