"""Which sequential head? DSpark's Markov / gated Markov / RNN heads against DFlash (no head), same everything else.

    python benchmarks/head_ablation.py [--steps 120] [--heads markov gated rnn none] [--out benchmarks/results/cpu]
    python benchmarks/head_ablation.py --heads markov --max-anchors 40 160 --name anchor_ablation

Trains one drafter per head for SmolLM2 on the recorded self-distilled ShareGPT data
(experiments/data/sharegpt_smollm2_regen.jsonl.gz, the SmolLM2 recipes' training data) with the quickstart's `small`
CPU recipe (dspark/quickstart.py SIZES['small']), each in a fresh process with the same seed, data order and
budget, and compares their teacher-forced held-out acceptance (per position and expected tau, the training's own
evaluation on the held-out split). `none` is DFlash: the same backbone, heads off, L = L_ce. `--max-anchors`
runs every head at each anchors-per-sequence cap (default: the recipe's). Writes OUT/NAME.json (every run,
machine, versions, command, date) and OUT/NAME.md, NAME = head_ablation unless --name says otherwise.

A small-budget CPU comparison: it ranks the heads early in training, it does not predict converged tau on a GPU
run (benchmarks/results/smollm2-drafters/ has those).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from _training import train_in_subprocess  # benchmarks/_training.py
from dspark.config import to_dict
from dspark.metrics import markdown_table
from dspark.quickstart import SIZES, environment, training_config

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "experiments" / "data" / "sharegpt_smollm2_regen.jsonl.gz"
SIZE = SIZES["small"]
HEADS = {  # head -> (drafter, drafter args beyond the shared backbone)
    "markov": ("dspark", {"head": "markov", "confidence": True}),
    "gated": ("dspark", {"head": "gated", "confidence": True}),
    "rnn": ("dspark", {"head": "rnn", "confidence": True}),
    "none": ("dflash", {}),
}


def run(head: str, max_anchors: int, recipe, workdir: Path) -> dict:
    drafter, extra = HEADS[head]
    cfg = replace(recipe, output=str(workdir / f"{head}_{max_anchors}"), drafter=drafter,
                  drafter_args={**recipe.drafter_args, **extra, "max_anchors": max_anchors})
    started = time.perf_counter()
    records = train_in_subprocess(cfg)
    train = [r for r in records if r.get("kind") == "train"]
    final = [r for r in records if r.get("kind") == "eval"][-1]
    return {"head": head, "max_anchors": max_anchors, "drafter": drafter, "drafter_args": cfg.drafter_args,
            "steps": len(train),
            "heldout_tau": final["tau"], "heldout_acceptance": final["acceptance"], "heldout_loss": final["loss"],
            "final_train_loss": train[-1]["loss"],
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in train[1:]),
            "wall_s": time.perf_counter() - started}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--heads", nargs="+", default=list(HEADS), choices=list(HEADS))
    parser.add_argument("--data", default=str(DATA), help="chat JSONL[.gz]; default: the recorded SmolLM2 regeneration")
    parser.add_argument("--data-limit", type=int, default=1000, help="training conversations read")
    parser.add_argument("--max-anchors", type=int, nargs="+", default=[SIZE.max_anchors],
                        help="anchors-per-sequence caps to run each head at (default: the recipe's)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "cpu"))
    parser.add_argument("--name", default="head_ablation", help="stem of the written .json / .md")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be at least 2 (the first step is not timed)")
    if min(args.max_anchors) < 1:
        parser.error("--max-anchors must be at least 1")
    # the quickstart's recipe (dspark.quickstart.training_config) on this data, evaluated once at the end
    recipe = training_config(SIZE, output="<run dir>", data=args.data, data_limit=args.data_limit,
                             max_steps=args.steps, save_every=100000, eval_every=args.steps, eval_batches=16)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for head in args.heads:
            for max_anchors in args.max_anchors:
                runs.append(run(head, max_anchors, recipe, Path(tmp)))
                print(f"{head}, {max_anchors} anchors: held-out tau {runs[-1]['heldout_tau']:.3f} "
                      f"({runs[-1]['wall_s']:.0f} s)", flush=True)
    # each run against DFlash at the same anchors cap, where that ran
    base = {r["max_anchors"]: r["heldout_tau"] for r in runs if r["head"] == "none"}
    rows = [{"head": r["head"] if r["head"] != "none" else "none (DFlash)", "anchors": r["max_anchors"],
             "tau": r["heldout_tau"],
             "vs": f"{r['heldout_tau'] / base[r['max_anchors']]:.3f}" if r["max_anchors"] in base else "-",
             "acc": " ".join(f"{a:.2f}" for a in r["heldout_acceptance"]), "loss": r["final_train_loss"],
             "speed": r["tokens_per_s"]} for r in runs]
    columns = [("head", "head"), ("anchors", "max anchors / sequence"), ("tau", "held-out tau"),
               ("vs", "tau / DFlash's (same cap)"), ("acc", "acceptance at 1..7"),
               ("loss", "final train loss"), ("speed", "tokens/s")]
    command = "python benchmarks/head_ablation.py " + " ".join(sys.argv[1:])
    data = Path(args.data).resolve()
    result = {"environment": environment(torch.device("cpu")), "command": command,
              "recipe": dict(to_dict(recipe), size="small",
                             data=str(data.relative_to(ROOT)) if data.is_relative_to(ROOT) else str(data)),
              "runs": runs}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(result, indent=1) + "\n")
    env = result["environment"]
    (out / f"{args.name}.md").write_text(
        f"# Sequential head / anchors ablation (CPU, {args.steps} steps)\n\n`{command}` on {env['processor']}, "
        f"{env['cpu_threads']} threads, torch {env['torch']}, transformers {env['transformers']}, {env['date']}.\n"
        "Teacher-forced acceptance on the held-out split of the same data; same seed, data order and budget.\n\n"
        + markdown_table(rows, columns) + "\n")
    print((out / f"{args.name}.md").read_text())


if __name__ == "__main__":
    main()
