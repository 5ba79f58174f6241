"""Concurrency and break-even: throughput and per-request speed against concurrency C, for plain decoding and every
(drafter, policy, gamma) setting, all decoded in this one process on the same prompts and seeds.

    dspark experiment concurrency --host smollm2 --drafters ngram dspark dflash eagle3 mtp \\
        --drafter-paths dspark=ckpt/dspark dflash=ckpt/dflash eagle3=ckpt/eagle3 mtp=ckpt/mtp \\
        --policies full threshold scheduler --draft-lengths 3 5 7 --concurrency 1 2 4 8 16 32 64 \\
        --num-prompts 64 --max-new-tokens 128 --out-dir results/concurrency
    dspark experiment concurrency --host random:tiny-llama --drafters ngram dspark --policies full scheduler \\
        --draft-lengths 3 7 --concurrency 1 2 4 --num-prompts 8 --max-new-tokens 16 --out-dir /tmp/cc   # CPU smoke

Writes OUT_DIR/concurrency.json: `rows` (one per setting and C: method, policy, draft_length, concurrency, engine,
tokens_per_s, per_request_tokens_per_s, tau, speedup over plain at the same C, verified_per_round = the policy's
verify budget per request, pareto, engine_stats: rounds, drafted rounds, CPU wait, per-stage device seconds with
--stage-timing), `break_even` (setting -> C or null), and concurrency.md / PNGs: tokens/s
against C, the throughput / per-request speed curve (Pareto front marked) and the verify budget against load.

Engine: rows say which decode backend measured them (experiments.common.DECODE_BACKENDS). "continuous" (default)
keeps C requests in flight on the slot engine, a queued request entering as soon as one stops; "static-batch" runs
the prompts in successive static batches of C (requests that finish early are not replaced). max(num_prompts, C)
requests are decoded at each C.
Scheduler policies need an SPS(B) table: --cost-table, or one is profiled on this host first (OUT_DIR/cost.json).

--repeats N decodes every row N times per C, rotating the settings' order each time (so that no setting is always
first at a C); a row then holds the median tokens/s and its speedup is the median of the paired ratios to plain
decoding's decode of the same repeat, with their range (`speedup_range`): the noise between single decodes (up to
about 9 % on the H100, RESULTS) is then visible beside each ratio.
The JSON is rewritten after every C (`"partial": true` until the last), so a run cut short keeps what it measured.
A sweep too long for one sitting runs as several (e.g. --concurrency 1 4 16 64, then 256 512, each profiling the
SPS(B) table at its own C) and `--merge A/concurrency.json B/concurrency.json --out-dir DIR` joins them
into one document (break-even over every C; each source's command and environment kept under `sources`).
"""
from __future__ import annotations

import json
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from dspark.engine.workload import warmed
from experiments.common import (RunOptions, Section, backend, build_drafters, build_policy, check_settings, cost_table,
                                drafter_path, envelope, figure, is_plain, load_prompts, plot_log_x, result_row,
                                sampling_config, setting_key, trained_length, workload_context,
                                write_result)


@dataclass
class ConcurrencyOptions:
    drafters: list[str] = field(default_factory=lambda: ["ngram", "dspark"], metadata={
        "help": "drafter names (ngram, dspark, dflash, eagle3, mtp, small-lm); plain decoding is always measured"})
    policies: list[str] = field(default_factory=lambda: ["full", "scheduler"], metadata={
        "help": "verification policies: full (fixed gamma), threshold, scheduler, lagged"})
    draft_lengths: list[int] = field(default_factory=lambda: [3, 7], metadata={"help": "gamma values"})
    concurrency: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64, 128, 256, 512], metadata={
        "help": "requests in flight"})
    threshold: float = field(default=0.5, metadata={"help": "survival threshold of the 'threshold' policy"})
    cost_table: Optional[str] = field(default=None, metadata={
        "help": "SPS(B) JSON from `dspark profile` for scheduler / lagged (default: profile this host now)"})
    engine: str = field(default="continuous", metadata={
        "help": "continuous (closed loop, C in flight) or static-batch (batches of C, no refill)"})
    data: str = field(default="sharegpt", metadata={"help": "prompt source for hosts with a tokenizer"})
    repeats: int = field(default=1, metadata={
        "help": "timed decodes of every row per C, the settings' order rotated each time; a row's tokens/s is the "
                "median, its speedup the median of the ratios to plain decoding's decode of the same repeat (with "
                "their range)"})
    stage_timing: bool = field(default=False, metadata={
        "help": "CUDA events split every round's device time by stage (each row's engine_stats.stage_s): a "
                "diagnostic, the events themselves cost a little"})
    merge: list[str] = field(default_factory=list, metadata={
        "help": "concurrency.json files of one sweep run in parts: join their rows into OUT_DIR (nothing decoded)"})


def check(opts: ConcurrencyOptions) -> None:
    check_settings(opts.policies, concurrency=opts.concurrency, draft_lengths=opts.draft_lengths)
    backend(opts.engine)
    if isinstance(opts.repeats, bool) or not isinstance(opts.repeats, int) or opts.repeats < 1:
        raise ValueError(f"--repeats must be an integer >= 1, got {opts.repeats!r}")


def measure(host, run: RunOptions, opts: ConcurrencyOptions, *, prompts: list[list[int]], out_dir: Path,
            progress: Optional[Callable[[dict], None]] = None) -> dict:
    """Decode every setting at every C; returns {"rows", "skipped"} (rows already carry speedup over plain).
    `progress`, when given, receives the same kind of dict after every C but the last."""
    check(opts)
    decode = warmed(backend(opts.engine))
    costed = any(p in ("scheduler", "lagged") for p in opts.policies)
    drafters = build_drafters(host, opts.drafters, run.drafter_paths, opts.draft_lengths)
    cost = cost_table(host, opts.cost_table, concurrency=opts.concurrency, draft_lengths=opts.draft_lengths,
                      out_dir=out_dir, drafters=drafters,
                      context=workload_context(prompts, run.max_new_tokens)) if costed else None
    common = dict(max_new_tokens=run.max_new_tokens, sampling=sampling_config(run.temperature), seed=run.seed,
                  timing=opts.stage_timing)
    rows, skipped = [], []
    for C in opts.concurrency:
        batch = [prompts[i % len(prompts)] for i in range(max(C, len(prompts)))]
        settings = [("plain", "none", 0, None, None)]  # (method, policy, gamma, drafter, its trained length)
        for (name, gamma), drafter in drafters.items():
            trained = trained_length(drafter)
            if name in ("dspark", "dflash") and trained is not None and gamma > trained:
                skipped.append({"method": name, "draft_length": gamma, "concurrency": C,
                                "reason": f"gamma {gamma} > the block of {trained} it was trained with"})
                continue
            settings += [(name, policy, gamma, drafter, trained) for policy in opts.policies]
        timed: dict[int, list[dict]] = {}
        for repeat in range(opts.repeats):
            # why rotated: plain decoding first at every C made its row the one that met each C's first-use costs
            shift = repeat % len(settings)
            for i in list(range(shift, len(settings))) + list(range(shift)):
                name, policy, gamma, drafter, trained = settings[i]
                verifier = None if drafter is None else build_policy(
                    host, policy, draft_length=gamma, path=drafter_path(run.drafter_paths, name, gamma),
                    threshold=opts.threshold, cost=cost)
                result = decode(host, batch, drafter=drafter, verifier=verifier, draft_length=gamma, concurrency=C,
                                **common)
                labels = dict(method=name, policy=policy, concurrency=C, engine=opts.engine)
                if drafter is not None:
                    labels["trained_length"] = trained
                row = result_row(result, draft_length=gamma, **labels)
                timed.setdefault(i, []).append(row)
                print(f"C={C:4d} {setting_key(row):24s} tau {row['tau']:.2f} {row['tokens_per_s']:.1f} tok/s"
                      + (f" (repeat {repeat + 1}/{opts.repeats})" if opts.repeats > 1 else ""), flush=True)
        rows += [_repeated(timed[i]) for i in range(len(settings))]
        if progress is not None and C != opts.concurrency[-1]:
            so_far = [dict(r) for r in rows]
            add_speedup(so_far)
            progress({"rows": so_far, "skipped": list(skipped)})
    add_speedup(rows)
    return {"rows": rows, "skipped": skipped}


def _repeated(runs: list[dict]) -> dict:
    """One row from a setting's timed decodes of one C: the first decode's row (τ and the counts are the same in
    every repeat: same prompts, seeds and gate decisions), tokens/s and per-request tokens/s their medians, each
    decode's tokens/s kept (`tokens_per_s_repeats`) for add_speedup's paired ratios."""
    row = dict(runs[0])
    if len(runs) > 1:
        row["tokens_per_s_repeats"] = [r["tokens_per_s"] for r in runs]
        row["tokens_per_s"] = statistics.median(row["tokens_per_s_repeats"])
        row["per_request_tokens_per_s"] = statistics.median(r["per_request_tokens_per_s"] for r in runs)
        row["seconds"] = statistics.median(r["seconds"] for r in runs)
    return row


def merge(paths: list[str]) -> dict:
    """One concurrency document from several runs of one sweep split over C: rows and skipped joined, speedup and
    Pareto recomputed. A partial source (a run cut short) adds the C it finished. Refuses a (setting, C) measured
    twice and sources whose settings differ in anything but the concurrency list (host, prompts, tokens, seeds,
    drafters, policies, draft lengths)."""
    docs = []
    for path in paths:
        doc = json.loads(Path(path).read_text())
        if doc.get("experiment") != "concurrency":
            raise ValueError(f"{path} is not a concurrency.json (experiment {doc.get('experiment')!r})")
        docs.append(doc)
    if not docs:
        raise ValueError("--merge needs at least one concurrency.json")

    def comparable(doc: dict) -> dict:  # settings added since a source was written read as their defaults
        settings = {"stage_timing": False, "repeats": 1, **doc["settings"]}
        return {"host": doc["host"], **{k: v for k, v in settings.items()
                                        if k not in ("concurrency", "out_dir", "cost_table", "merge")}}
    for path, doc in zip(paths[1:], docs[1:]):
        if comparable(doc) != comparable(docs[0]):
            diff = sorted(k for k in comparable(doc) if comparable(doc)[k] != comparable(docs[0]).get(k))
            raise ValueError(f"{path} was run with other settings than {paths[0]} ({', '.join(diff)})")
    rows, seen = [], set()
    for path, doc in zip(paths, docs):
        for r in doc["rows"]:
            key = (setting_key(r), r["concurrency"])
            if key in seen:
                raise ValueError(f"{path} measures {key[0]} at C = {key[1]} again")
            seen.add(key)
            rows.append({k: v for k, v in r.items() if k not in ("speedup", "pareto")})
    rows.sort(key=lambda r: r["concurrency"])
    add_speedup(rows)
    merged = dict(docs[0])
    merged["settings"] = {**docs[0]["settings"], "concurrency": sorted({r["concurrency"] for r in rows})}
    merged.pop("partial", None)
    merged.update(rows=rows, skipped=[s for doc in docs for s in doc.get("skipped", [])],
                  sources=[{"path": str(p), "command": d["command"], "environment": d["environment"],
                            "partial": bool(d.get("partial"))}
                           for p, d in zip(paths, docs)])
    return merged


def add_speedup(rows: list[dict]) -> None:
    """rows[i]["speedup"] = tokens/s over plain decoding's at the same concurrency (and, for replayed rows, on the
    same trace: the same requests); with repeats (`tokens_per_s_repeats` on both rows) the median of the paired
    ratios, repeat by repeat, and their range in `speedup_range`. rows[i]["pareto"] marks the rows no other row
    beats on both tokens/s and per-request tokens/s."""
    plain = {(r.get("trace"), r["concurrency"]): r for r in rows if is_plain(r)}
    for r in rows:
        base = plain.get((r.get("trace"), r["concurrency"]))
        mine, theirs = r.get("tokens_per_s_repeats"), None if base is None else base.get("tokens_per_s_repeats")
        if mine and theirs and len(mine) == len(theirs):
            ratios = [a / b for a, b in zip(mine, theirs)]
            r["speedup"], r["speedup_range"] = statistics.median(ratios), [min(ratios), max(ratios)]
        else:
            r["speedup"] = r["tokens_per_s"] / base["tokens_per_s"] if base and base["tokens_per_s"] else float("nan")
    for r in rows:
        r["pareto"] = not any(o["tokens_per_s"] >= r["tokens_per_s"]
                              and o["per_request_tokens_per_s"] >= r["per_request_tokens_per_s"]
                              and (o["tokens_per_s"], o["per_request_tokens_per_s"])
                              != (r["tokens_per_s"], r["per_request_tokens_per_s"]) for o in rows)


def break_even(rows: list[dict]) -> dict[str, int | None]:
    """Per setting, the smallest measured C from which on it is never faster than plain decoding (speedup <= 1 at
    that C and every larger measured C); None when it is still faster at the largest C. A dip below plain that
    recovers at a larger C is read as noise, not as the crossing."""
    out: dict[str, int | None] = {}
    settings: dict[str, list[dict]] = {}
    for r in rows:
        if not is_plain(r):
            settings.setdefault(setting_key(r), []).append(r)
    for key, points in settings.items():
        crossing = None
        for r in sorted(points, key=lambda r: r["concurrency"], reverse=True):
            if not r["speedup"] <= 1.0:
                break
            crossing = r["concurrency"]
        out[key] = crossing
    return out


def render(doc: dict, out: Path) -> Section:
    """concurrency.md's body and three PNGs from a concurrency.json document."""
    from dspark.metrics import markdown_table

    rows = doc["rows"]
    columns = [("concurrency", "C"), ("method", "method"), ("policy", "policy"), ("draft_length", "γ"), ("tau", "τ"),
               ("verified_per_round", "verified/req/round"), ("tokens_per_s", "tokens/s"),
               ("per_request_tokens_per_s", "tokens/s per request"), ("speedup", "× plain")]
    if any("speedup_range" in r for r in rows):  # repeats: the paired ratios' range beside their median
        rows = [{**r, "range": "–".join(f"{x:.3f}" for x in r["speedup_range"]) if "speedup_range" in r else ""}
                for r in rows]
        columns.append(("range", "× plain, range of repeats"))
    table = markdown_table(rows, columns + [("pareto", "Pareto")])
    engines = sorted({r["engine"] for r in rows})
    even = "\n".join(f"| {k} | {'never (still faster at the largest C)' if v is None else v} |"
                     for k, v in doc["break_even"].items())
    described = {"continuous": "continuous (C requests in flight, closed loop)",
                 "static-batch": "static-batch (static batches of C, not continuous batching)"}
    text = (f"Engine: {', '.join(described.get(e, e) for e in engines)}" + "\n\n" + table
            + "\n\n**Break-even concurrency** (from this C on, no faster than plain decoding):\n\n"
              "| setting | C |\n|---|---|\n" + even + "\n")
    if doc.get("partial"):
        text = "**Partial result**: the run stopped before its last concurrency.\n\n" + text
    if doc.get("sources"):
        text += "\nJoined from " + ", ".join(f"`{s['command']}`" for s in doc["sources"]) + "\n"
    if doc.get("skipped"):
        text += "\nSkipped: " + "; ".join(f"{s['method']} γ{s['draft_length']} ({s['reason']})"
                                          for s in doc["skipped"][:5]) + "\n"
    stem = doc["experiment"]
    return Section(title=f"{stem}: throughput and per-request speed against concurrency", markdown=text,
                   images=plot(rows, out, stem=stem))


def _series(rows: list[dict]) -> dict[str, list[dict]]:
    series: dict[str, list[dict]] = {}
    for r in rows:
        series.setdefault(setting_key(r), []).append(r)
    return {k: sorted(v, key=lambda r: r["concurrency"]) for k, v in series.items()}


def plot(rows: list[dict], out: Path, *, stem: str = "concurrency") -> list[Path]:
    """Three PNGs: tokens/s against C, tokens/s against per-request tokens/s (Pareto), verify budget against C."""
    series = _series(rows)
    Cs = sorted({r["concurrency"] for r in rows})
    paths = []
    fig, axes = figure(6.5, 4.2)
    ax = axes[0, 0]
    for key, points in series.items():
        ax.plot([r["concurrency"] for r in points], [r["tokens_per_s"] for r in points], marker="o", ms=3,
                label=key, **({"color": "k", "ls": "--"} if is_plain(points[0]) else {}))
    plot_log_x(ax, Cs)
    ax.set(yscale="log", xlabel="concurrency C", ylabel="tokens/s (all requests)", title="throughput")
    ax.legend(fontsize=6)
    paths.append(out / f"{stem}_throughput.png")
    fig.savefig(paths[-1], dpi=110)

    fig, axes = figure(6.5, 4.2)
    ax = axes[0, 0]
    for key, points in series.items():
        ax.plot([r["per_request_tokens_per_s"] for r in points], [r["tokens_per_s"] for r in points], marker="o",
                ms=3, label=key, **({"color": "k", "ls": "--"} if is_plain(points[0]) else {}))
    front = sorted((r for r in rows if r["pareto"]), key=lambda r: r["per_request_tokens_per_s"])
    ax.plot([r["per_request_tokens_per_s"] for r in front], [r["tokens_per_s"] for r in front], color="0.6", lw=4,
            alpha=0.4, label="Pareto front")
    ax.set(xscale="log", yscale="log", xlabel="tokens/s per request", ylabel="tokens/s (all requests)",
           title="throughput against per-request speed (each point one C)")
    ax.legend(fontsize=6)
    paths.append(out / f"{stem}_pareto.png")
    fig.savefig(paths[-1], dpi=110)

    fig, axes = figure(6.5, 4.2)
    ax = axes[0, 0]
    for key, points in series.items():
        if not is_plain(points[0]):
            ax.plot([r["concurrency"] for r in points], [r["verified_per_round"] for r in points], marker="o", ms=3,
                    label=key)
    plot_log_x(ax, Cs)
    ax.set(xlabel="concurrency C", ylabel="verified drafts per request per round", title="verify budget against load")
    ax.legend(fontsize=6)
    paths.append(out / f"{stem}_budget.png")
    fig.savefig(paths[-1], dpi=110)
    return paths


def main(argv: list[str] | None = None) -> int:
    from dspark.cli import HostOptions, _host
    from dspark.config import parse

    argv = list(sys.argv[1:] if argv is None else argv)
    h, run, opts = parse([HostOptions, RunOptions, ConcurrencyOptions], argv, prog="dspark experiment concurrency")
    if opts.merge:
        doc = merge(opts.merge)
        doc["command"] = "dspark experiment concurrency " + " ".join(argv)
        doc["settings"]["out_dir"] = run.out_dir
        doc["break_even"] = break_even(doc["rows"])
        path = write_result(doc, run.out_dir, render)
        print(f"wrote {path} from {len(opts.merge)} runs; break-even concurrency: {doc['break_even']}")
        return 0
    check(opts)
    host = _host(h)
    prompts = load_prompts(host, opts.data, run.num_prompts, seed=run.seed, max_prompt_length=run.max_prompt_length)
    doc = envelope("concurrency", argv=argv, host=host, options=[h, run, opts])

    def checkpoint(part: dict) -> None:  # a run cut short (a device call's time limit) keeps the C it finished
        write_result({**doc, **part, "break_even": break_even(part["rows"]), "partial": True}, run.out_dir, render)
    doc.update(measure(host, run, opts, prompts=prompts, out_dir=Path(run.out_dir), progress=checkpoint))
    doc["break_even"] = break_even(doc["rows"])
    path = write_result(doc, run.out_dir, render)
    print(f"wrote {path}; break-even concurrency: {doc['break_even']}")
    return 0
