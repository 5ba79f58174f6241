"""Acceptance and calibration: per-position conditional acceptance and prefix survival per drafter and domain (the
DSpark paper's Figure 2), and for drafters with a confidence head, reliability diagrams and ECE / AUROC / Brier
before and after STS (Figure 6).

    dspark experiment acceptance --host smollm2 --drafters dspark dflash eagle3 \\
        --drafter-paths dspark=ckpt/dspark dflash=ckpt/dflash eagle3=ckpt/eagle3 \\
        --domains chat=sharegpt code=humaneval math=champ --draft-length 7 --num-prompts 64 --out-dir results/acceptance

One verify-all decode per drafter and domain (every position up to the first rejection is reached, which both the
per-position estimates and STS need). Calibration splits the requests: STS is fitted on the first 1 - holdout of
them and the before / after metrics are measured on the rest (by request, not by round: one response's rounds are
correlated); holdout 0 fits and reports on all of them (optimistic, flagged). The conditional view scores c_k
against "x_k accepted given x_<k accepted", the survival view a_k = Π c_i against "x_1..x_k all accepted".
Writes OUT_DIR/acceptance.json (`rows`, `domains`), acceptance.md, acceptance.png (conditional acceptance and
survival per position), calibration.png (survival ECE per position before / after STS),
reliability_METHOD_DOMAIN.png, and trace_METHOD_DOMAIN.json per decode for `dspark experiment simulate`.
"""
from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dspark.documents import Section, envelope, figure, fmt_list, write_result
from dspark.engine.workload import backend
from dspark.sweep import result_row
from experiments.common import RunOptions, build_drafters, load_prompts, parse_domains, sampling_config


@dataclass
class AcceptanceOptions:
    drafters: list[str] = field(default_factory=lambda: ["dspark", "dflash", "ngram"], metadata={
        "help": "drafter names"})
    domains: dict[str, str] = field(default_factory=dict, metadata={
        "help": "NAME=SOURCE prompt sources per domain (default chat=sharegpt code=humaneval math=champ)"})
    draft_length: int = field(default=7, metadata={"help": "draft length γ: draft tokens proposed per round"})
    concurrency: int = field(default=8, metadata={"help": "requests in flight"})
    holdout: float = field(default=0.5, metadata={
        "help": "share of the requests kept out of the STS fit; the before / after metrics are measured on them"})
    engine: str = field(default="static-batch", metadata={
        "help": "decode backend: continuous or static-batch (dspark.engine.workload)"})


def calibration(result, K: int, holdout: float) -> dict | None:
    """STS fitted on the first requests, metrics on the held-out rest; None without confidences."""
    from verifiers.calibration import STSCalibrator, calibration_report, outcomes_from_counts

    conf = result.log.confidences()
    if conf is None:
        return None
    log = result.log
    accepted, reached = outcomes_from_counts(log.column("verified"), log.column("accepted"), K)
    request, n = log.column("request"), len(result.token_ids)
    n_test = int(round(holdout * n))
    test = request >= n - n_test if n_test else torch.ones_like(request, dtype=torch.bool)
    fit = ~test if n_test else test
    if not bool(fit.any()) or not bool(test.any()):
        raise ValueError(f"{n} requests are too few to hold out {holdout:.0%} for calibration: raise --num-prompts")
    sts = STSCalibrator.fit(conf[fit], accepted[fit], reached[fit])
    report = calibration_report(conf[test], accepted[test], reached[test], calibrator=sts)
    return {"temperatures": sts.temperatures, "fit_requests": n - n_test, "report_requests": n_test or n,
            "optimistic": n_test == 0, "before": report["before"], "after": report["after"],
            "tensors": (conf[test], accepted[test], reached[test], sts)}


def measure(host, run: RunOptions, opts: AcceptanceOptions, *, prompts: dict[str, list[list[int]]],
            out_dir: Path) -> list[dict]:
    from experiments.simulator import trace_from_result
    from verifiers.calibration import reliability_diagram

    if not 0.0 <= opts.holdout < 1.0:
        raise ValueError(f"--holdout must be in [0, 1), got {opts.holdout}")
    decode = backend(opts.engine)
    K = opts.draft_length
    drafters = build_drafters(host, opts.drafters, run.drafter_paths, [K])
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for (name, _), drafter in drafters.items():
        for domain, ids in prompts.items():
            result = decode(host, ids, drafter=drafter, verifier=None, draft_length=K, concurrency=opts.concurrency,
                            max_new_tokens=run.max_new_tokens, sampling=sampling_config(run.temperature),
                            seed=run.seed)
            row = result_row(result, draft_length=K, method=name, domain=domain, policy="full",
                             concurrency=opts.concurrency, engine=opts.engine)
            trace = out_dir / f"trace_{name}_{domain}.json"
            trace.write_text(json.dumps(trace_from_result(result, draft_length=K, method=name, domain=domain,
                                                          host=host.name)) + "\n")
            row["trace"] = trace.name
            cal = calibration(result, K, opts.holdout)
            row["calibration"] = None
            if cal is not None:
                conf, acc, reached, sts = cal.pop("tensors")
                png = out_dir / f"reliability_{name}_{domain}.png"
                reliability_diagram(png, conf, acc, reached, calibrator=sts)
                row["calibration"] = cal
                row["reliability_png"] = png.name
            rows.append(row)
            print(f"{name:8s} {domain:6s} tau {row['tau']:.3f}; conditional acceptance "
                  f"{fmt_list(row['conditional_acceptance'])}", flush=True)
    return rows


def _mean(values: list[float]) -> float:
    kept = [v for v in values if not math.isnan(v)]
    return sum(kept) / len(kept) if kept else float("nan")


def calibration_rows(rows: list[dict]) -> list[dict]:
    """Mean over positions of the survival-view ECE / AUROC / Brier before and after STS, per drafter and domain."""
    out = []
    for r in rows:
        cal = r.get("calibration")
        if not cal:
            continue
        entry = {"method": r["method"], "domain": r["domain"], "report_requests": cal["report_requests"]}
        for when in ("before", "after"):
            for metric in ("ece", "auroc", "brier"):
                entry[f"{metric}_{when}"] = _mean(cal[when]["survival"][metric])
        out.append(entry)
    return out


def render(doc: dict, out: Path) -> Section:
    from dspark.metrics import markdown_table

    rows = doc["rows"]
    for r in rows:
        r["conditional_text"] = fmt_list(r["conditional_acceptance"])
        r["survival_text"] = fmt_list(r["prefix_survival"])
    text = markdown_table(rows, [("method", "method"), ("domain", "domain"), ("tau", "τ"),
                                 ("conditional_text", "conditional acceptance k = 1..γ"),
                                 ("survival_text", "prefix survival k = 1..γ")])
    for r in rows:
        del r["conditional_text"], r["survival_text"]
    cal = calibration_rows(rows)
    if cal:
        text += ("\n\n**Calibration of a_k (survival view), mean over positions, held-out requests**\n\n"
                 + markdown_table(cal, [("method", "method"), ("domain", "domain"),
                                        ("report_requests", "requests"), ("ece_before", "ECE raw"),
                                        ("ece_after", "ECE STS"), ("auroc_before", "AUROC raw"),
                                        ("auroc_after", "AUROC STS"), ("brier_before", "Brier raw"),
                                        ("brier_after", "Brier STS")]))
        if any(r["calibration"]["optimistic"] for r in rows if r.get("calibration")):
            text += "\n\nholdout 0: STS was fitted and reported on the same requests (optimistic)."
    images = []
    domains = list(dict.fromkeys(r["domain"] for r in rows))
    fig, axes = figure(4 * len(domains), 6.5, ncols=len(domains), nrows=2)
    for col, domain in enumerate(domains):
        for r in (r for r in rows if r["domain"] == domain):
            k = list(range(1, len(r["conditional_acceptance"]) + 1))
            axes[0, col].plot(k, r["conditional_acceptance"], marker="o", ms=3, label=r["method"])
            axes[1, col].plot(k, r["prefix_survival"], marker="o", ms=3, label=r["method"])
        for ax in axes[:, col]:
            ax.set_xticks(range(1, doc["settings"]["draft_length"] + 1))
        axes[0, col].set(title=domain, ylabel="P(x_k accepted | x_<k accepted)", ylim=(0, 1.02))
        axes[1, col].set(xlabel="draft position k", ylabel="P(x_1..x_k accepted)", ylim=(0, 1.02))
        axes[0, col].legend(fontsize=7)
    images.append(out / f"{doc['experiment']}.png")
    fig.savefig(images[-1], dpi=110)
    if cal:
        fig, axes = figure(6, 4)
        for r in rows:
            if r.get("calibration"):
                c = r["calibration"]
                k = list(range(1, len(c["before"]["survival"]["ece"]) + 1))
                line, = axes[0, 0].plot(k, [100 * v for v in c["before"]["survival"]["ece"]], ls="--", marker="o",
                                        ms=3, label=f"{r['method']}/{r['domain']} raw")
                axes[0, 0].plot(k, [100 * v for v in c["after"]["survival"]["ece"]], marker="o", ms=3,
                                color=line.get_color(), label=f"{r['method']}/{r['domain']} STS")
        axes[0, 0].set(xlabel="draft position k", ylabel="ECE of a_k (%)", title="calibration before / after STS")
        axes[0, 0].legend(fontsize=6)
        images.append(out / "calibration.png")
        fig.savefig(images[-1], dpi=110)
    images += [out / r["reliability_png"] for r in rows if r.get("reliability_png")
               and (out / r["reliability_png"]).is_file()]
    return Section(title="acceptance: per-position acceptance and calibration", markdown=text + "\n", images=images)


def main(argv: list[str] | None = None) -> int:
    from dspark.cli import HostOptions, _host
    from dspark.config import parse

    argv = list(sys.argv[1:] if argv is None else argv)
    h, run, opts = parse([HostOptions, RunOptions, AcceptanceOptions], argv, prog="dspark experiment acceptance")
    host = _host(h)
    domains = parse_domains(opts.domains)
    prompts = {d: load_prompts(host, source, run.num_prompts, seed=run.seed, max_prompt_length=run.max_prompt_length)
               for d, source in domains.items()}
    doc = envelope("acceptance", argv=argv, host=host, options=[h, run, opts])
    doc["domains"] = domains  # the prompt source of each domain, defaults included
    doc["rows"] = measure(host, run, opts, prompts=prompts, out_dir=Path(run.out_dir))
    path = write_result(doc, run.out_dir, render)
    print(f"wrote {path}")
    return 0
