"""Is scheduled speculation ever much slower than plain decoding? Plain against DSpark + scheduler, with and without
the draft gate, in alternating repeats on the same prompts.

    python benchmarks/draft_gate.py --drafter-path quickstart/drafter [--repeats 4] [--out benchmarks/results/cpu]

The setting is the quickstart's (dspark/quickstart.py: host, `small` size on a CPU, 16 held-out ShareGPT prompts,
96 new tokens, static batches of 8, greedy, gamma 7) with the drafter it trained; the cost table (verify SPS and
the drafter's own step) is profiled here as the quickstart profiles it. Each repeat decodes the prompts with every
method, in a rotated order, so slow phases of the machine fall on every method alike; the result is each method's
median tokens/s and its ratio to plain decoding within each repeat (median and range), the only comparison this
noisy machine supports. Writes OUT/draft_gate.json (every run, machine, versions, command, date) and
OUT/draft_gate.md.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from dspark.api import checkpoint_dir, encode_prompts, load_host, resolve_device
from dspark.engine.decode import generate
from dspark.metrics import markdown_table
from dspark.quickstart import DRAFT_LENGTH, SIZES, environment
from dspark.training.data import load_conversations, prompts
from drafters import load_drafter
from verifiers import build_verifier
from verifiers.cost_model import draft_key, profile, profile_draft

METHODS = ("plain", "dspark+scheduler", "dspark+scheduler (no gate)")


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--drafter-path", required=True, help="a trained DSpark drafter (e.g. quickstart/drafter)")
    parser.add_argument("--host", default="smollm2")
    parser.add_argument("--size", default="small", choices=sorted(SIZES))
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "cpu"))
    args = parser.parse_args(argv)
    size, device = SIZES[args.size], resolve_device("cpu")
    host = load_host(args.host, device=device, dtype=torch.float32)
    checkpoint = checkpoint_dir(args.drafter_path)
    drafter = load_drafter(checkpoint, host)
    context = size.max_prompt_length + size.max_new_tokens // 2  # the quickstart's profiling context
    cost = profile(host, batch_sizes=[1, size.eval_batch], tokens_per_request=[1, 2, 4, DRAFT_LENGTH + 1],
                   repeats=3, warmup=1, context=context)
    cost.draft[draft_key(drafter, DRAFT_LENGTH)] = profile_draft(
        host, drafter, batch_sizes=[1, size.eval_batch], draft_length=DRAFT_LENGTH, repeats=3, warmup=1,
        context=context)
    conversations = load_conversations("sharegpt", split="heldout", limit=8 * size.eval_prompts)
    ids = [p for p in encode_prompts(host, prompts(conversations)) if len(p) <= size.max_prompt_length]
    ids = ids[: size.eval_prompts]
    parts = {"plain": dict(drafter=None, verifier=None),
             "dspark+scheduler": dict(drafter=drafter, verifier=lambda: build_verifier("scheduler", cost_table=cost)),
             "dspark+scheduler (no gate)": dict(drafter=drafter, verifier=lambda: build_verifier(
                 "scheduler", cost_table=cost, draft_gate=False))}
    runs, reference = [], None
    for repeat in range(args.repeats):
        order = METHODS[repeat % len(METHODS):] + METHODS[: repeat % len(METHODS)]
        for name in order:
            verifier = parts[name]["verifier"]
            result = generate(host, ids, drafter=parts[name]["drafter"], verifier=verifier() if verifier else None,
                              draft_length=DRAFT_LENGTH, max_new_tokens=size.max_new_tokens, seed=0,
                              batch_size=size.eval_batch)
            reference = reference or result.token_ids
            stats = result.stats
            runs.append({"repeat": repeat, "method": name, "tokens_per_s": stats["tokens_per_s"], "tau": stats["tau"],
                         "rounds": result.rounds, "drafted_rounds": result.engine.get("drafted_rounds"),
                         "lossless": result.token_ids == reference})
            print(f"repeat {repeat} {name:28s} {stats['tokens_per_s']:.1f} tok/s tau {stats['tau']:.2f} drafted "
                  f"{result.engine.get('drafted_rounds')}/{result.rounds}", flush=True)
    rows = []
    for name in METHODS:
        mine = [r for r in runs if r["method"] == name]
        ratios = [r["tokens_per_s"] / next(p["tokens_per_s"] for p in runs
                                           if p["method"] == "plain" and p["repeat"] == r["repeat"]) for r in mine]
        rows.append({"method": name, "tokens_per_s": statistics.median(r["tokens_per_s"] for r in mine),
                     "ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
                     "tau": mine[0]["tau"], "drafted_rounds": f"{mine[0]['drafted_rounds']}/{mine[0]['rounds']}",
                     "lossless": all(r["lossless"] for r in mine)})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = "python benchmarks/draft_gate.py " + " ".join(argv if argv is not None else sys.argv[1:])
    doc = {"command": command, "environment": environment(device), "checkpoint": str(checkpoint),
           "settings": {"size": args.size, **size.__dict__, "draft_length": DRAFT_LENGTH, "repeats": args.repeats},
           "cost": cost.to_dict(), "rows": rows, "runs": runs}
    (out / "draft_gate.json").write_text(json.dumps(doc, indent=1))
    table = markdown_table(rows, [("method", "method"), ("tokens_per_s", "tokens/s (median)"),
                                  ("ratio", "× plain (median of repeats)"), ("ratio_min", "min"),
                                  ("ratio_max", "max"), ("tau", "τ"), ("drafted_rounds", "rounds drafted"),
                                  ("lossless", "= plain")])
    env = doc["environment"]
    (out / "draft_gate.md").write_text(
        f"# The draft gate against plain decoding\n\n`{command}` — {env['date']}, {env['processor']} "
        f"({env['cpu_threads']} threads), torch {env['torch']}.\n\n{table}\n")
    print(table)
    return out / "draft_gate.md"


if __name__ == "__main__":
    started = time.perf_counter()
    main()
    print(f"{time.perf_counter() - started:.0f} s")
