"""Verified-token savings: what a policy that verifies fewer drafts than verify-all saves, what it gives up, and
the throughput change the savings buy, per (drafter, policy, draft length) and concurrency.

    dspark experiment savings --host smollm2 --drafters dspark --drafter-paths dspark=ckpt/dspark \\
        --policies full threshold scheduler --draft-lengths 5 7 --concurrency 1 8 32 --out-dir results/savings
    dspark experiment savings --from-json results/concurrency/concurrency.json --out-dir results/savings

It decodes the concurrency runner's grid (dspark.sweep through experiments.concurrency, "full" added when missing,
so every policy has its verify-all twin on the same prompts, seeds and C) or reads a concurrency.json (from
`dspark experiment concurrency`, `dspark bench` or `dspark sweep`) that holds both. Per row
(every policy except full): verified and accepted drafts per request-round, savings_vs_full = 1 - verified /
verified under verify-all, tau_given_up = tau(full) - tau, throughput_change = tokens/s / tokens/s(full) - 1.
Writes OUT_DIR/savings.json (`rows`, `source_rows`), savings.md and savings.png.
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from dspark.documents import Section, envelope, figure, plot_log_x, write_result
from dspark.sweep import measure
from experiments.common import RunOptions, load_prompts
from experiments.concurrency import ConcurrencyOptions, sweep_of


@dataclass
class SavingsOptions:
    from_json: Optional[str] = field(default=None, metadata={
        "help": "a concurrency.json to derive the savings from instead of decoding"})


def savings(rows: list[dict]) -> list[dict]:
    """One row per non-full speculative setting and C that has a verify-all twin (same method, draft length, C,
    engine)."""
    full = {(r["method"], r["draft_length"], r["concurrency"], r["engine"]): r for r in rows if r["policy"] == "full"}
    out = []
    for r in rows:
        if r["method"] == "plain" or r["policy"] == "full":
            continue
        twin = full.get((r["method"], r["draft_length"], r["concurrency"], r["engine"]))
        if twin is None:
            raise ValueError(f"{r['method']}/{r['policy']}/γ{r['draft_length']} at C={r['concurrency']} has no "
                             "verify-all (policy full) row to compare with: include 'full' in --policies")
        out.append({key: r[key] for key in ("method", "policy", "draft_length", "concurrency", "engine")} | {
            "verified_per_round": r["verified_per_round"], "accepted_per_round": r["accepted_per_round"],
            "full_verified_per_round": twin["verified_per_round"],
            "full_accepted_per_round": twin["accepted_per_round"],
            "savings_vs_full": 1.0 - r["verified_per_round"] / twin["verified_per_round"]
            if twin["verified_per_round"] else float("nan"),
            "tau": r["tau"], "full_tau": twin["tau"], "tau_given_up": twin["tau"] - r["tau"],
            "tokens_per_s": r["tokens_per_s"], "full_tokens_per_s": twin["tokens_per_s"],
            "throughput_change": r["tokens_per_s"] / twin["tokens_per_s"] - 1.0,
        })
    return out


def render(doc: dict, out: Path) -> Section:
    from dspark.metrics import markdown_table

    rows = doc["rows"]
    text = markdown_table(rows, [("concurrency", "C"), ("method", "method"), ("policy", "policy"),
                                 ("draft_length", "γ"), ("verified_per_round", "verified/round"),
                                 ("full_verified_per_round", "verify-all verified/round"),
                                 ("accepted_per_round", "accepted/round"), ("savings_vs_full", "savings"),
                                 ("tau_given_up", "τ given up"), ("throughput_change", "tokens/s change")])
    text += ("\n\nsavings = 1 − verified / verified under verify-all (per request-round); τ given up = τ(verify-all)"
             " − τ; tokens/s change = tokens/s ÷ verify-all's − 1, same prompts, seeds and C.\n")
    fig, axes = figure(11, 4, ncols=2)
    series: dict[str, list[dict]] = {}
    for r in rows:
        series.setdefault(f"{r['method']}/{r['policy']}/γ{r['draft_length']}", []).append(r)
    Cs = sorted({r["concurrency"] for r in rows}) or [1]
    for key, points in series.items():
        points = sorted(points, key=lambda r: r["concurrency"])
        x = [r["concurrency"] for r in points]
        axes[0, 0].plot(x, [100 * r["savings_vs_full"] for r in points], marker="o", ms=3, label=key)
        axes[0, 1].plot(x, [100 * r["throughput_change"] for r in points], marker="o", ms=3, label=key)
    for ax, ylabel in zip(axes[0], ("verified-token savings vs verify-all (%)", "tokens/s change vs verify-all (%)")):
        plot_log_x(ax, Cs)
        ax.axhline(0, color="0.6", lw=1)
        ax.set(xlabel="concurrency C", ylabel=ylabel)
        ax.legend(fontsize=6)
    path = out / f"{doc['experiment']}.png"
    fig.savefig(path, dpi=110)
    return Section(title="savings: verified tokens saved against verify-all, and what they buy", markdown=text,
                   images=[path])


def main(argv: list[str] | None = None) -> int:
    from dspark.cli import HostOptions, _host
    from dspark.config import parse

    argv = list(sys.argv[1:] if argv is None else argv)
    h, run, cc, opts = parse([HostOptions, RunOptions, ConcurrencyOptions, SavingsOptions], argv,
                             prog="dspark experiment savings")
    if opts.from_json:
        source = json.loads(Path(opts.from_json).read_text())
        if source.get("experiment") != "concurrency":
            raise ValueError(f"{opts.from_json} is not a concurrency.json (experiment {source.get('experiment')!r})")
        doc = {key: source[key] for key in ("environment", "host", "settings")}
        doc.update(experiment="savings", command="dspark experiment savings " + " ".join(argv),
                   source=opts.from_json, source_rows=source["rows"])
    else:
        if "full" not in cc.policies:
            cc.policies = ["full", *cc.policies]
        host = _host(h)
        prompts = load_prompts(host, cc.data, run.num_prompts, seed=run.seed, max_prompt_length=run.max_prompt_length)
        doc = envelope("savings", argv=argv, host=host, options=[h, run, cc, opts])
        doc["source_rows"] = measure(host, prompts, sweep_of(host, run, cc), out_dir=Path(run.out_dir))["rows"]
    doc["rows"] = savings(doc["source_rows"])
    path = write_result(doc, run.out_dir, render)
    print(f"wrote {path}")
    return 0
