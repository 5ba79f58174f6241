"""Sweep draft length (gamma) and concurrency (batch size): tau, throughput and the break-even concurrency.

`dspark sweep --host smollm2 --drafter-path DIR --draft-lengths 1 3 5 7 --batch-sizes 1 4 16 64 --out-dir sweep`

For every batch size B the prompts are decoded with plain decoding and, for every gamma, speculatively, all in
this one process, so speedups are ratios of numbers measured side by side. Output: OUT_DIR/sweep.json (results +
machine, versions, command, date), sweep.md (table) and sweep.png (speedup over plain against B per gamma; the
break-even concurrency is where a curve crosses 1).
"""
from __future__ import annotations

import json
from pathlib import Path

from dspark.api import resolve_verifier
from dspark.engine.decode import generate
from dspark.engine.sampling import SamplingConfig
from dspark.metrics import markdown_table, summarize
from dspark.quickstart import environment


def fill_prompts(prompts: list[list[int]], n: int) -> list[list[int]]:
    """At least n prompts, cycling the given ones (each copy gets its own seed from the decode loop)."""
    return [prompts[i % len(prompts)] for i in range(max(n, len(prompts)))]


def break_even(rows: list[dict]) -> dict[int, int | None]:
    """Per gamma, the smallest batch size at which speculation is no faster than plain decoding (None: never)."""
    out: dict[int, int | None] = {}
    for gamma in sorted({r["draft_length"] for r in rows if r["draft_length"]}):
        slower = [r["batch_size"] for r in rows if r["draft_length"] == gamma and r["speedup"] <= 1.0]
        out[gamma] = min(slower) if slower else None
    return out


def run_sweep(host, drafter, base: list[list[int]], *, decode_opts, eval_opts, sweep_opts, host_name: str,
              label: str, argv=None) -> Path:
    """Decode `base` (cycled to each batch size) plainly and with `drafter` at every gamma; write the report."""
    from matplotlib.figure import Figure  # why here: matplotlib is slow to import and only the report needs it

    sampling = SamplingConfig(temperature=decode_opts.temperature, top_k=decode_opts.top_k, top_p=decode_opts.top_p)
    def verifier_for(gamma: int):
        return resolve_verifier(host, decode_opts.verifier, draft_length=gamma, drafter_path=decode_opts.drafter_path,
                                threshold=decode_opts.threshold, cost_table=decode_opts.cost_table,
                                calibration=decode_opts.calibration, draft_gate=decode_opts.draft_gate)

    for gamma in sweep_opts.draft_lengths:  # a calibration too short for a gamma fails here, before any decoding
        verifier_for(gamma)
    rows = []
    for B in sweep_opts.batch_sizes:
        prompts = fill_prompts(base, B)
        common = dict(max_new_tokens=decode_opts.max_new_tokens, sampling=sampling, seed=decode_opts.seed,
                      batch_size=B, progress=True)
        plain = summarize(generate(host, prompts, **common), draft_length=0)
        rows.append({"batch_size": B, "method": "plain", **plain, "speedup": 1.0})
        for gamma in sweep_opts.draft_lengths:
            result = generate(host, prompts, drafter=drafter, verifier=verifier_for(gamma), draft_length=gamma,
                              **common)
            m = summarize(result, draft_length=gamma)
            rows.append({"batch_size": B, "method": f"{label}/{decode_opts.verifier}", **m,
                         "speedup": m["tokens_per_s"] / plain["tokens_per_s"]})
            print(f"B={B:4d} gamma={gamma:2d} tau {m['tau']:.2f} speedup {rows[-1]['speedup']:.2f}", flush=True)

    out = Path(sweep_opts.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    env = environment(host.device)
    doc = {"command": "dspark sweep " + " ".join(argv or []), "environment": env, "host": host_name,
           "drafter": label, "drafter_path": decode_opts.drafter_path, "verifier": decode_opts.verifier,
           "data": eval_opts.data, "split": eval_opts.split, "heldout_fraction": eval_opts.heldout_fraction,
           "temperature": decode_opts.temperature, "break_even_batch_size": break_even(rows), "results": rows}
    (out / "sweep.json").write_text(json.dumps(doc, indent=1) + "\n")
    table = markdown_table(rows, [("batch_size", "B"), ("method", "method"), ("draft_length", "γ"), ("tau", "τ"),
                                  ("verified_per_round", "verified/round"), ("tokens_per_s", "tokens/s"),
                                  ("speedup", "× plain")])
    (out / "sweep.md").write_text(f"# sweep\n\n`{doc['command']}` — {env['date']}, {env['gpu'] or env['processor']}, "
                                  f"torch {env['torch']}\n\n{table}\n\nbreak-even batch size per γ: "
                                  f"{doc['break_even_batch_size']}\n")
    fig = Figure(figsize=(6, 4), layout="constrained")
    ax = fig.subplots()
    for gamma in sweep_opts.draft_lengths:
        pts = [(r["batch_size"], r["speedup"]) for r in rows if r["draft_length"] == gamma and r["method"] != "plain"]
        ax.plot(*zip(*pts), marker="o", label=f"γ = {gamma}")
    ax.axhline(1.0, color="0.5", ls="--", lw=1)
    ax.set(xscale="log", xlabel="concurrency (batch size)", ylabel="tokens/s ÷ plain decoding",
           title=f"{label} on {host_name} ({env['gpu'] or 'CPU'})")
    ax.legend()
    fig.savefig(out / "sweep.png", dpi=110)
    print(table)
    return out
