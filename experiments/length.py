"""Draft length: tau and speed against the draft length γ for drafters trained at one length and evaluated at others,
and the DSpark / DFlash tau margin against γ (matched where each draft length has its own checkpoint).

    dspark experiment length --host smollm2 --drafters dspark dflash eagle3 ngram \\
        --drafter-paths dspark=ckpt/dspark dflash=ckpt/dflash eagle3=ckpt/eagle3 \\
        dspark@15=ckpt/dspark15 dflash@15=ckpt/dflash15 --draft-lengths 2 3 5 7 10 13 15 --out-dir results/length

A NAME@N=DIR checkpoint is used at draft length N, NAME=DIR at the others. DSpark / DFlash draft at most the block
they were trained with (K <= block_size, drafters/dspark.py), so longer drafts are listed under `skipped`; without a
checkpoint they get random weights with a block of max(--draft-lengths). Verify-all policy, so tau measures the
drafter alone. Rows: method, draft_length, trained_length, matched (trained at this draft length), tau, accepted
per round, tokens/s, conditional acceptance per position. `margin`: per draft length where both ran, tau(dspark) /
tau(dflash) - 1. Writes OUT_DIR/length.json, length.md and length.png.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

from dspark.documents import Section, envelope, figure, write_result
from dspark.engine.workload import backend
from dspark.sweep import block_limit, result_row, trained_length
from experiments.common import RunOptions, build_drafters, load_prompts, sampling_config


@dataclass
class LengthOptions:
    drafters: list[str] = field(default_factory=lambda: ["dspark", "dflash", "ngram"], metadata={
        "help": "drafter names"})
    draft_lengths: list[int] = field(default_factory=lambda: [2, 3, 4, 5, 7, 10, 13, 16], metadata={
        "help": "draft lengths γ evaluated"})
    concurrency: int = field(default=8, metadata={"help": "requests in flight"})
    engine: str = field(default="static-batch", metadata={
        "help": "decode backend: continuous or static-batch (dspark.engine.workload)"})
    data: str = field(default="sharegpt", metadata={"help": "prompt source for hosts with a tokenizer"})


def measure(host, run: RunOptions, opts: LengthOptions, *, prompts: list[list[int]]) -> dict:
    if not opts.draft_lengths or min(opts.draft_lengths) < 1:
        raise ValueError(f"--draft-lengths needs values >= 1, got {opts.draft_lengths}")
    decode = backend(opts.engine)
    drafters = build_drafters(host, opts.drafters, run.drafter_paths, opts.draft_lengths)
    rows, skipped = [], []
    for (name, K), drafter in drafters.items():
        trained, limit = trained_length(drafter), block_limit(drafter)
        if limit is not None and K > limit:
            skipped.append({"method": name, "draft_length": K,
                            "reason": f"draft length {K} > the block of {limit} it was trained with"})
            continue
        result = decode(host, prompts, drafter=drafter, verifier=None, draft_length=K,
                        concurrency=opts.concurrency, max_new_tokens=run.max_new_tokens,
                        sampling=sampling_config(run.temperature), seed=run.seed)
        row = result_row(result, draft_length=K, method=name, policy="full", concurrency=opts.concurrency,
                         engine=opts.engine, trained_length=trained, matched=trained == K)
        rows.append(row)
        print(f"{name:8s} draft length {K:2d} (trained {trained}) tau {row['tau']:.3f}", flush=True)
    return {"rows": rows, "skipped": skipped, "margin": margin(rows)}


def margin(rows: list[dict]) -> list[dict]:
    """Per draft length with both a dspark and a dflash row: tau(dspark) / tau(dflash) - 1 and whether both were
    trained at that length."""
    by = {(r["method"], r["draft_length"]): r for r in rows}
    out = []
    for K in sorted({r["draft_length"] for r in rows}):
        a, b = by.get(("dspark", K)), by.get(("dflash", K))
        if a and b:
            out.append({"draft_length": K, "dspark_tau": a["tau"], "dflash_tau": b["tau"],
                        "margin": a["tau"] / b["tau"] - 1.0, "matched": bool(a["matched"] and b["matched"])})
    return out


def render(doc: dict, out: Path) -> Section:
    from dspark.metrics import markdown_table

    rows = doc["rows"]
    text = markdown_table(rows, [("method", "method"), ("draft_length", "γ"), ("trained_length", "trained γ"),
                                 ("tau", "τ"), ("accepted_per_round", "accepted/round"),
                                 ("tokens_per_s", "tokens/s")])
    if doc["margin"]:
        text += "\n\n**DSpark over DFlash** (τ ratio − 1):\n\n" + markdown_table(
            doc["margin"], [("draft_length", "γ"), ("dspark_tau", "τ DSpark"), ("dflash_tau", "τ DFlash"),
                            ("margin", "margin"), ("matched", "both trained at γ")])
    if doc["skipped"]:
        text += "\n\nSkipped: " + "; ".join(f"{s['method']} γ{s['draft_length']} ({s['reason']})"
                                            for s in doc["skipped"])
    fig, axes = figure(11, 4, ncols=2)
    for name in dict.fromkeys(r["method"] for r in rows):
        points = sorted((r for r in rows if r["method"] == name), key=lambda r: r["draft_length"])
        axes[0, 0].plot([r["draft_length"] for r in points], [r["tau"] for r in points], marker="o", ms=3, label=name)
    axes[0, 0].set(xlabel="γ (draft length at inference)", ylabel="τ (with bonus)", title="τ against γ")
    axes[0, 0].legend(fontsize=7)
    if doc["margin"]:
        m = doc["margin"]
        axes[0, 1].plot([r["draft_length"] for r in m], [100 * r["margin"] for r in m], marker="o", color="k")
        axes[0, 1].axhline(0, color="0.6", lw=1)
    axes[0, 1].set(xlabel="γ", ylabel="τ DSpark / τ DFlash − 1 (%)", title="DSpark margin over DFlash")
    path = out / f"{doc['experiment']}.png"
    fig.savefig(path, dpi=110)
    return Section(title="length: τ against draft length γ", markdown=text + "\n", images=[path])


def main(argv: list[str] | None = None) -> int:
    from dspark.cli import HostOptions, _host
    from dspark.config import parse

    argv = list(sys.argv[1:] if argv is None else argv)
    h, run, opts = parse([HostOptions, RunOptions, LengthOptions], argv, prog="dspark experiment length")
    host = _host(h)
    prompts = load_prompts(host, opts.data, run.num_prompts, seed=run.seed, max_prompt_length=run.max_prompt_length)
    doc = envelope("length", argv=argv, host=host, options=[h, run, opts])
    doc.update(measure(host, run, opts, prompts=prompts))
    path = write_result(doc, run.out_dir, render)
    print(f"wrote {path}")
    return 0
