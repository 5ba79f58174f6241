"""CPU training step with and without `dspark.tune_cpu_allocator` (glibc mallopt: no mmap for large blocks).

    python benchmarks/cpu_allocator.py [--repeats 2] [--steps 12] [--out benchmarks/results/cpu]

Runs the quickstart's `small` training recipe on SmolLM2 for a few steps in fresh processes, alternating
DSPARK_MALLOC_TUNING=0 / 1 so both see the same machine state, and writes OUT/allocator.json (every run, machine,
versions, command, date) and OUT/allocator.md. Step speed is the median tokens/s of each run's steps after the
first (the training's own metrics.jsonl); the final losses must be equal: the tuning moves allocations only.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import torch

from _training import train_in_subprocess  # benchmarks/_training.py
from dspark.config import to_dict
from dspark.metrics import markdown_table
from dspark.quickstart import SIZES, environment, training_config

ROOT = Path(__file__).resolve().parents[1]
SIZE = SIZES["small"]  # the quickstart's default recipe (dspark.quickstart.training_config), fewer steps


def run(recipe, tuning: int, workdir: Path) -> dict:
    out = workdir / f"run-{tuning}-{len(list(workdir.iterdir()))}"
    records = train_in_subprocess(replace(recipe, output=str(out)), DSPARK_MALLOC_TUNING=str(tuning))
    train = [r for r in records if r.get("kind") == "train"]
    return {"tuning": bool(tuning), "steps": len(train), "final_loss": train[-1]["loss"],
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in train[1:]),
            "peak_mem_gb": max(r["peak_mem_gb"] for r in train)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "cpu"))
    args = parser.parse_args()
    recipe = training_config(SIZE, output="<run dir>", max_steps=args.steps, save_every=100000)
    with tempfile.TemporaryDirectory() as tmp:
        runs = [run(recipe, tuning, Path(tmp)) for _ in range(args.repeats) for tuning in (0, 1)]
    rows = []
    for tuning in (False, True):
        mine = [r for r in runs if r["tuning"] == tuning]
        speed = statistics.median(r["tokens_per_s"] for r in mine)
        rows.append({"allocator": "tuned (mallopt)" if tuning else "glibc default", "tokens_per_s": speed,
                     "s_per_step": SIZE.batch_size * SIZE.seq_len / speed,
                     "peak_mem_gb": max(r["peak_mem_gb"] for r in mine), "final_loss": mine[0]["final_loss"]})
    speedup = rows[1]["tokens_per_s"] / rows[0]["tokens_per_s"]
    same = len({r["final_loss"] for r in runs}) == 1
    result = {"environment": environment(torch.device("cpu")), "command": " ".join(["python", *sys.argv]),
              "train_config": to_dict(recipe), "runs": runs, "summary": rows, "speedup": speedup, "same_losses": same}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "allocator.json").write_text(json.dumps(result, indent=1) + "\n")
    env = result["environment"]
    table = markdown_table(rows, [("allocator", "allocator"), ("tokens_per_s", "tokens/s"), ("s_per_step", "s/step"),
                                  ("peak_mem_gb", "peak RSS GiB"), ("final_loss", "final loss")])
    (out / "allocator.md").write_text(
        f"`{result['command']}` — {env['date']}, {env['processor']} ({env['cpu_threads']} threads), torch "
        f"{env['torch']}\n\n{table}\n\nspeedup {speedup:.2f}x; final losses identical: {same}\n")
    print((out / "allocator.md").read_text())


if __name__ == "__main__":
    main()
