"""Threshold sweep (the DSpark paper's Figure 5 shape): as the confidence threshold rises, accepted and rejected
verified drafts per step and the acceptance rate of verified drafts, per domain.

    dspark experiment threshold --host smollm2 --drafter dspark --drafter-paths dspark=ckpt/dspark \\
        --domains chat=sharegpt code=humaneval math=champ --thresholds 0 0.2 0.4 0.6 0.8 --out-dir results/thr

Policy: the 'threshold' verifier on cumulative survival a_k = Π c_i (with the checkpoint's STS calibration when it
has one): verify the drafts before the first a_k below the threshold; threshold 0 is verify-all. Per step means
per request-round: accepted = accepted drafts, rejected = verified - accepted (the first rejected draft and the
verified ones after it). Acceptance rate = accepted / verified. Domains map a name to a prompt source; default
chat=sharegpt, code=humaneval, math=champ (CHAMP's competition problems: pip install champ-dataset).
Writes OUT_DIR/threshold.json (`rows`, `domains`), threshold.md and threshold.png (one panel per domain).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

from dspark.documents import Section, envelope, figure, write_result
from dspark.engine.workload import backend
from dspark.sweep import build_policy, result_row
from experiments.common import (RunOptions, build_drafters, drafter_path, load_prompts, parse_domains,
                                sampling_config)


@dataclass
class ThresholdOptions:
    drafter: str = field(default="dspark", metadata={"help": "a drafter with a confidence head (dspark)"})
    thresholds: list[float] = field(default_factory=lambda: [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8],
                                    metadata={"help": "survival thresholds in [0, 1]"})
    domains: dict[str, str] = field(default_factory=dict, metadata={
        "help": "NAME=SOURCE prompt sources per domain (default chat=sharegpt code=humaneval math=champ)"})
    draft_length: int = field(default=7, metadata={"help": "draft length γ: draft tokens proposed per round"})
    concurrency: int = field(default=8, metadata={"help": "requests in flight"})
    engine: str = field(default="static-batch", metadata={
        "help": "decode backend: continuous or static-batch (dspark.engine.workload)"})


def measure(host, run: RunOptions, opts: ThresholdOptions, *, prompts: dict[str, list[list[int]]]) -> list[dict]:
    """One row per domain and threshold."""
    bad = [t for t in opts.thresholds if not 0.0 <= t <= 1.0]
    if bad or not opts.thresholds:
        raise ValueError(f"--thresholds must be values in [0, 1], got {opts.thresholds}")
    decode = backend(opts.engine)
    drafter = build_drafters(host, [opts.drafter], run.drafter_paths, [opts.draft_length])[opts.drafter,
                                                                                            opts.draft_length]
    path = drafter_path(run.drafter_paths, opts.drafter, opts.draft_length)
    rows = []
    for domain, ids in prompts.items():
        for t in opts.thresholds:
            verifier = build_policy(host, "threshold", draft_length=opts.draft_length, path=path, threshold=t)
            result = decode(host, ids, drafter=drafter, verifier=verifier, draft_length=opts.draft_length,
                            concurrency=opts.concurrency, max_new_tokens=run.max_new_tokens,
                            sampling=sampling_config(run.temperature), seed=run.seed)
            if result.log.confidences() is None:
                raise ValueError(f"drafter {opts.drafter!r} gives no confidences: a threshold has nothing to cut")
            row = result_row(result, draft_length=opts.draft_length, domain=domain, threshold=t, method=opts.drafter,
                             policy="threshold", concurrency=opts.concurrency, engine=opts.engine)
            row["rejected_per_round"] = row["verified_per_round"] - row["accepted_per_round"]
            rows.append(row)
            print(f"{domain:6s} threshold {t:.2f}: accepted {row['accepted_per_round']:.2f} rejected "
                  f"{row['rejected_per_round']:.2f} per step, acceptance rate {row['verify_rate']:.3f}", flush=True)
    return rows


def render(doc: dict, out: Path) -> Section:
    from dspark.metrics import markdown_table

    rows = doc["rows"]
    text = markdown_table(rows, [("domain", "domain"), ("threshold", "threshold"),
                                 ("verified_per_round", "verified/step"), ("accepted_per_round", "accepted/step"),
                                 ("rejected_per_round", "rejected/step"), ("verify_rate", "acceptance rate"),
                                 ("tau", "τ"), ("tokens_per_s", "tokens/s")])
    domains = list(dict.fromkeys(r["domain"] for r in rows))
    fig, axes = figure(4.2 * len(domains), 3.8, ncols=len(domains))
    for ax, domain in zip(axes[0], domains):
        points = sorted((r for r in rows if r["domain"] == domain), key=lambda r: r["threshold"])
        x = list(range(len(points)))
        acc = [r["accepted_per_round"] for r in points]
        ax.bar(x, acc, color="tab:green", label="accepted")
        ax.bar(x, [r["rejected_per_round"] for r in points], bottom=acc, color="tab:red", label="rejected")
        ax.set_xticks(x, [f"{r['threshold']:g}" for r in points])
        ax.set(xlabel="confidence threshold", ylabel="verified drafts per step", title=domain)
        rate = ax.twinx()
        rate.plot(x, [100 * r["verify_rate"] for r in points], color="k", marker="o", ms=3)
        rate.set(ylabel="acceptance rate of verified drafts (%)", ylim=(0, 100))
        ax.legend(fontsize=7, loc="upper right")
    path = out / f"{doc['experiment']}.png"
    fig.savefig(path, dpi=110)
    return Section(title="threshold: accepted and rejected verified drafts as the threshold rises", markdown=text,
                   images=[path])


def main(argv: list[str] | None = None) -> int:
    from dspark.cli import HostOptions, _host
    from dspark.config import parse

    argv = list(sys.argv[1:] if argv is None else argv)
    h, run, opts = parse([HostOptions, RunOptions, ThresholdOptions], argv, prog="dspark experiment threshold")
    host = _host(h)
    domains = parse_domains(opts.domains)
    prompts = {d: load_prompts(host, source, run.num_prompts, seed=run.seed, max_prompt_length=run.max_prompt_length)
               for d, source in domains.items()}
    doc = envelope("threshold", argv=argv, host=host, options=[h, run, opts])
    doc["domains"] = domains  # the prompt source of each domain, defaults included
    doc["rows"] = measure(host, run, opts, prompts=prompts)
    path = write_result(doc, run.out_dir, render)
    print(f"wrote {path}")
    return 0
