"""Throughput and τ against concurrency C: plain decoding and every (drafter, policy, draft length γ) setting, all
decoded in this one process on the same prompts and seeds, on the slot engine (dspark.engine.workload: C requests
in flight, or static batches of C). The one tool behind `dspark experiment concurrency`, `dspark bench` and
`dspark sweep` (front-ends that only choose the drafters, the prompts and the engine) and benchmarks/speed.py's
engine rows; every one of them writes OUT_DIR/concurrency.json, concurrency.md and three PNGs.

    sweep = Sweep(drafted=[Drafted("ngram", 3, drafter)], policies=["full", "scheduler"], concurrency=[1, 4])
    run(host, prompts, sweep, doc=envelope(NAME, argv=argv, host=host, options=[...]), out_dir="results")

concurrency.json: the envelope (dspark.documents: experiment "concurrency", command, environment, host, settings =
the front-end's flags), drafter_admission (captured or eager: dspark.engine.serve.CAPTURE_DRAFTER_ADMISSION), and
- rows, one per setting and C: method ("plain" or the drafter's name), policy ("none" for plain), draft_length (0
  for plain), trained_length (a drafter's trained block, None without one; plain rows have none), concurrency,
  engine; tokens_per_s (with repeats the median, every decode's in tokens_per_s_repeats), per_request_tokens_per_s,
  speedup over plain decoding at the same C (with repeats the median of the paired ratios, their range in
  speedup_range), pareto; tau and the rest of ROW_METRICS (dspark.metrics.summarize); ttft_s_mean, latency_s_mean;
  identical_to_plain (greedy: the share of requests whose tokens equal plain decoding's at the same C, 1.0
  wherever the arithmetic is exact; None when sampling); engine_stats (`engine_stats`);
- skipped: settings not decoded (a draft length past a DSpark / DFlash drafter's trained block), with the reason;
- break_even: setting key (method/policy/γN) -> the smallest C from which on it is never faster than plain
  decoding; None while it is still faster at the largest C;
- partial: true until the last C (the file is rewritten after every C, so a run cut short keeps what it measured);
  sources: in a document joined by `merge`, each part's path, command and environment.

Every decode is timed after an untimed warm-up of the same cache on CUDA (workload.warmed); max(C, len(prompts))
requests are decoded at each C, the prompts cycled. The schedulers price rounds with an SPS(B) table: Sweep.cost_table,
or one profiled here first at the workload's context with every drafter's draft cost (OUT_DIR/cost.json).
"""
from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from dspark.documents import Section, figure, plot_log_x, write_result
from dspark.engine.results import GenerationResult
from dspark.engine.sampling import SamplingConfig
from dspark.engine.workload import backend, warmed
from dspark.metrics import summarize

NAME = "concurrency"  # the document's `experiment` and its files' stem, whichever front-end wrote it
POLICIES = ("full", "threshold", "scheduler", "lagged")
COSTED = ("scheduler", "lagged")  # the policies that price rounds with an SPS(B) table
#: row keys copied from dspark.metrics.summarize (per-position lists included)
ROW_METRICS = ("tau", "tau_ci95", "accepted_per_round", "proposed_per_round", "verified_per_round", "verify_rate",
               "verified_token_savings", "tokens_per_s", "requests", "new_tokens", "request_rounds", "seconds",
               "mean_batch", "conditional_acceptance", "prefix_survival", "rows_verifying_k")


@dataclass(frozen=True)
class Drafted:
    """A drafter at one draft length: what a sweep crosses with its policies."""

    method: str  # the rows' name for it: a registered drafter name or a checkpoint's label
    draft_length: int
    drafter: object
    path: Optional[str] = None  # its checkpoint: the confidence policies load the STS calibration saved there


@dataclass
class Sweep:
    """What one run decodes (plain decoding, then every drafted x policy, at every C) and how it times it."""

    drafted: list[Drafted]
    policies: list[str]
    concurrency: list[int]
    max_new_tokens: int = 64
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    seed: int = 0  # request i is seeded with seed + i, in every setting
    engine: str = "continuous"  # a name of dspark.engine.workload.DECODE_BACKENDS
    repeats: int = 1  # timed decodes of every row per C, the settings' order rotated each time
    stage_timing: bool = False  # CUDA events split every round's device seconds by stage (engine_stats.stage_s)
    threshold: Optional[float] = None  # the threshold policy's survival threshold
    cost_table: Optional[str] = None  # SPS(B) JSON for the schedulers; None: profiled here when one is needed
    calibration: Optional[str] = None  # STS JSON for the confidence policies; None: each checkpoint's own
    draft_gate: bool = True  # the schedulers skip the draft forward while it does not pay


@dataclass(frozen=True)
class Setting:
    """One row per C: plain decoding (drafted None) or a drafter under a policy."""

    drafted: Optional[Drafted] = None
    policy: str = "none"

    @property
    def method(self) -> str:
        return "plain" if self.drafted is None else self.drafted.method

    @property
    def draft_length(self) -> int:
        return 0 if self.drafted is None else self.drafted.draft_length


# ---- settings ---------------------------------------------------------------------------------------------------
def check_settings(policies: list[str], **values: list[int]) -> None:
    """Refuse unknown policy names and empty or non-positive lists (concurrency, draft lengths) before any decoding,
    naming the option as the CLI spells it."""
    bad = [p for p in policies if p not in POLICIES]
    if bad:
        raise ValueError(f"unknown policies {bad}; choose from {list(POLICIES)}")
    for name, vals in values.items():
        if not vals or min(vals) < 1:
            raise ValueError(f"--{name.replace('_', '-')} needs values >= 1, got {vals}")


def check(sweep: Sweep) -> None:
    """Everything that would fail mid-run, refused before the first decode."""
    check_settings(sweep.policies, concurrency=sweep.concurrency)
    if sweep.drafted and not sweep.policies:
        raise ValueError("drafters need at least one policy (--policies / --verifier)")
    backend(sweep.engine)
    if isinstance(sweep.repeats, bool) or not isinstance(sweep.repeats, int) or sweep.repeats < 1:
        raise ValueError(f"--repeats must be an integer >= 1, got {sweep.repeats!r}")


def trained_length(drafter) -> int | None:
    """The block size a drafter was trained at (DSpark / DFlash block_size, EAGLE-3 ttt_length); None if it has
    none."""
    from drafters import DSparkDrafter, Eagle3Drafter

    if isinstance(drafter, DSparkDrafter):
        return drafter.config.block_size
    if isinstance(drafter, Eagle3Drafter):
        return drafter.config.ttt_length
    return None


def block_limit(drafter) -> int | None:
    """The longest draft a drafter can make: a DSpark / DFlash block (positions past it were never trained, and
    it refuses them); None where any length works."""
    from drafters import DSparkDrafter

    return drafter.config.block_size if isinstance(drafter, DSparkDrafter) else None


def settings(sweep: Sweep) -> tuple[list[Setting], list[Drafted]]:
    """Plain decoding, then every drafted x policy; and the drafted left out (draft length past block_limit)."""
    out, skipped = [Setting()], []
    for d in sweep.drafted:
        limit = block_limit(d.drafter)
        if limit is not None and d.draft_length > limit:
            skipped.append(d)
            continue
        out += [Setting(d, policy) for policy in sweep.policies]
    return out, skipped


def build_policy(host, policy: str, *, draft_length: int, path: str | None, threshold: float | None = None,
                 cost=None, calibration: str | None = None, draft_gate: bool = True):
    """The verifier for a policy name (full, threshold, scheduler, lagged) at this draft length, given only the
    options it takes: the threshold (on cumulative survival a_k) for threshold, the cost table and draft gate for
    the schedulers, the STS calibration (default: the checkpoint's own) for every policy that reads confidences."""
    from dspark.api import resolve_verifier
    from verifiers import policy_options

    return resolve_verifier(host, policy, draft_length=draft_length, drafter_path=path,
                            calibration=None if policy == "full" else calibration,
                            draft_gate=draft_gate or policy not in COSTED,
                            **policy_options(policy, threshold=threshold, cost_table=cost))


def workload_context(prompts: list[list[int]], max_new_tokens: int) -> int:
    """The cached positions per request that a cost table should be timed at for these prompts: the longest prompt
    plus the new tokens, the cache the slot engine allocates for them (its CUDA-graph rounds attend that whole
    cache, so at large C its reads, not the verify width, set a round's cost)."""
    return max((len(p) for p in prompts), default=0) + max_new_tokens


def cost_table(host, path: str | None, *, concurrency: list[int], draft_lengths: list[int], out_dir: Path,
               context: int, drafters=()):
    """The SPS(M) table: loaded from `path`, else profiled now on this host at `context` cached positions per
    request (workload_context); plus the draft cost of every (drafter, draft length) of `drafters` it lacks (the
    schedulers' draft gate prices it). Saved as OUT_DIR/cost.json (a loaded `path` is never rewritten). why the
    context matters: a table timed at a short context prices the rounds of a large C as if the cache were free, and
    the scheduler then verifies drafts that cost more than they buy."""
    from verifiers.cost_model import CostModel, draft_key, profile, profile_draft

    sizes = sorted(set(concurrency))
    if path:
        cost = CostModel.load(path, expect_host=host.name, expect_device=host.device)
    else:
        tokens = sorted({1, 2, 4, 8} | {k + 1 for k in draft_lengths})
        cost = profile(host, batch_sizes=sizes, tokens_per_request=tokens, repeats=3, warmup=1, context=context)
    for drafter, K in drafters:
        limit = block_limit(drafter)
        if draft_key(drafter, K) in cost.draft or (limit is not None and K > limit):
            continue
        cost.draft[draft_key(drafter, K)] = profile_draft(host, drafter, batch_sizes=sizes, draft_length=K,
                                                          context=context, repeats=3, warmup=1)
    out_dir.mkdir(parents=True, exist_ok=True)
    cost.save(out_dir / "cost.json")
    return cost


# ---- measuring ----------------------------------------------------------------------------------------------------
def measure(host, prompts: list[list[int]], sweep: Sweep, *, out_dir: Path,
            progress: Optional[Callable[[dict], None]] = None) -> dict:
    """Decode every setting at every C; returns {"rows", "skipped"} (rows carry speedup over plain). `progress`,
    when given, receives the same kind of dict after every C but the last."""
    check(sweep)
    decode = warmed(backend(sweep.engine))
    grid, left_out = settings(sweep)
    cost = None
    if any(s.policy in COSTED for s in grid):
        cost = cost_table(host, sweep.cost_table, concurrency=sweep.concurrency, out_dir=Path(out_dir),
                          draft_lengths=[d.draft_length for d in sweep.drafted],
                          drafters=[(d.drafter, d.draft_length) for d in sweep.drafted],
                          context=workload_context(prompts, sweep.max_new_tokens))

    def verifier_for(s: Setting):  # a fresh one per decode: a scheduler's draft gate keeps state across rounds
        return None if s.drafted is None else build_policy(
            host, s.policy, draft_length=s.draft_length, path=s.drafted.path, threshold=sweep.threshold, cost=cost,
            calibration=sweep.calibration, draft_gate=sweep.draft_gate)
    for s in grid:  # a missing threshold or a calibration too short for a draft length fails here, not mid-run
        verifier_for(s)
    greedy = sweep.sampling.temperature == 0
    rows, skipped = [], []
    for C in sweep.concurrency:
        batch = [prompts[i % len(prompts)] for i in range(max(C, len(prompts)))]
        skipped += [{"method": d.method, "draft_length": d.draft_length, "concurrency": C,
                     "reason": f"draft length {d.draft_length} > the block of {block_limit(d.drafter)} it was "
                               "trained with"} for d in left_out]
        timed: dict[int, list[dict]] = {}
        tokens: dict[int, list[list[int]]] = {}
        for repeat in range(sweep.repeats):
            # why rotated: plain decoding first at every C made its row the one that met each C's first-use costs
            shift = repeat % len(grid)
            for i in [*range(shift, len(grid)), *range(shift)]:
                s = grid[i]
                result = decode(host, batch, drafter=None if s.drafted is None else s.drafted.drafter,
                                verifier=verifier_for(s), draft_length=s.draft_length, concurrency=C,
                                max_new_tokens=sweep.max_new_tokens, sampling=sweep.sampling, seed=sweep.seed,
                                timing=sweep.stage_timing)
                labels = dict(method=s.method, policy=s.policy, concurrency=C, engine=sweep.engine)
                if s.drafted is not None:
                    labels["trained_length"] = trained_length(s.drafted.drafter)
                row = result_row(result, draft_length=s.draft_length, **labels)
                timed.setdefault(i, []).append(row)
                tokens.setdefault(i, result.token_ids)  # every repeat decodes the same tokens: the first is kept
                print(f"C={C:4d} {setting_key(row):24s} tau {row['tau']:.2f} {row['tokens_per_s']:.1f} tok/s"
                      + (f" (repeat {repeat + 1}/{sweep.repeats})" if sweep.repeats > 1 else ""), flush=True)
        for i in range(len(grid)):
            row = _repeated(timed[i])
            row["identical_to_plain"] = (sum(a == b for a, b in zip(tokens[i], tokens[0])) / len(batch)
                                         if greedy else None)
            rows.append(row)
        if progress is not None and C != sweep.concurrency[-1]:
            so_far = [dict(r) for r in rows]
            add_speedup(so_far)
            progress({"rows": so_far, "skipped": list(skipped)})
    add_speedup(rows)
    return {"rows": rows, "skipped": skipped}


def run(host, prompts: list[list[int]], sweep: Sweep, *, doc: dict, out_dir: str | Path) -> dict:
    """measure, writing OUT_DIR/concurrency.json (+ .md, PNGs) after every C (`"partial": true` until the last) and
    at the end with break_even; `doc` is the envelope (dspark.documents.envelope). Returns the final document."""
    import dspark.engine.serve as serve

    doc = {**doc, "drafter_admission": "captured" if serve.CAPTURE_DRAFTER_ADMISSION else "eager"}

    def checkpoint(part: dict) -> None:  # a run cut short (a time limit) keeps the C it finished
        write_result({**doc, **part, "break_even": break_even(part["rows"]), "partial": True}, out_dir, render)
    doc.update(measure(host, prompts, sweep, out_dir=Path(out_dir), progress=checkpoint))
    doc["break_even"] = break_even(doc["rows"])
    path = write_result(doc, out_dir, render)
    print(f"wrote {path}; break-even concurrency: {doc['break_even']}")
    return doc


def result_row(result: GenerationResult, *, draft_length: int, **labels) -> dict:
    """One JSON row: the labels, then summarize()'s metrics (ROW_METRICS) with per_request_tokens_per_s, the mean
    time to first token and latency, and where the slot engine decoded it, `engine_stats`."""
    m = summarize(result, draft_length=draft_length)
    row = {**labels, "draft_length": draft_length, **{k: m[k] for k in ROW_METRICS},
           "per_request_tokens_per_s": m["tokens_per_s_per_request"],
           "ttft_s_mean": statistics.fmean(result.ttft) if result.ttft else None,
           "latency_s_mean": statistics.fmean(result.latency) if result.latency else None}
    if result.engine:
        row["engine_stats"] = engine_stats(result)
    return row


def engine_stats(result: GenerationResult) -> dict:
    """Where a slot-engine decode's seconds went, for reading a row's speed: rounds and how many ran the drafter
    (the others were plain rounds of a draft gate), the mean verify width (tokens per slot per forward), the
    seconds the CPU waited on the device's copies (the rest of the wall time is its own work: launches, commits,
    admissions), admissions and their launch seconds, the mean requests in flight and, until the queue ran dry,
    their share of the slots, graphs captured and the warm-up left out of `seconds`, the garbage collections
    inside the loop and their seconds, and, when decoded with stage timing, the device seconds of each round stage
    (stage_s)."""
    e = result.engine
    widths, flight = e.get("widths") or [], e.get("in_flight") or []
    slots = max(1, min(e.get("concurrency") or 1, len(result.token_ids)))
    dry = max((i for i, c in enumerate(flight) if c == slots), default=-1) + 1  # the last round with all slots busy
    return {"rounds": result.rounds, "drafted_rounds": e.get("drafted_rounds"),
            "mean_width": sum(widths) / len(widths) if widths else None,
            "wait_s": e.get("wait_s"), "admissions": e.get("admissions"), "admit_s": e.get("admit_s"),
            "mean_in_flight": sum(flight) / len(flight) if flight else None,
            "in_flight_until_dry": sum(flight[:dry]) / (slots * dry) if dry else None,
            "graphs": e.get("graphs"), "prefill_graphs": e.get("prefill_graphs"), "warmup_s": e.get("warmup_s"),
            "overlapped": e.get("overlapped"), "gc_s": e.get("gc_s"), "gc_collections": e.get("gc_collections"),
            "stage_s": e.get("stage_s") or None}


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


# ---- derived numbers ----------------------------------------------------------------------------------------------
def is_plain(row: dict) -> bool:
    """Plain decoding's row: "plain", or "plain@<trace>" where a replay prices plain decoding per trace."""
    return row["method"] == "plain" or row["method"].startswith("plain@")


def setting_key(row: dict) -> str:
    """A setting's name across concurrencies: method/policy/γN (plain decoding: its method, "plain" or
    "plain@<trace>")."""
    if is_plain(row):
        return row["method"]
    return f"{row['method']}/{row['policy']}/γ{row['draft_length']}"


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
    series: dict[str, list[dict]] = {}
    for r in rows:
        if not is_plain(r):
            series.setdefault(setting_key(r), []).append(r)
    for key, points in series.items():
        crossing = None
        for r in sorted(points, key=lambda r: r["concurrency"], reverse=True):
            if not r["speedup"] <= 1.0:
                break
            crossing = r["concurrency"]
        out[key] = crossing
    return out


def merge(paths: list[str]) -> dict:
    """One concurrency document from several runs of one sweep split over C: rows and skipped joined, speedup and
    Pareto recomputed. A partial source (a run cut short) adds the C it finished. Refuses a (setting, C) measured
    twice and sources whose settings differ in anything but the concurrency list (host, prompts, tokens, seeds,
    drafters, policies, draft lengths)."""
    docs = []
    for path in paths:
        doc = json.loads(Path(path).read_text())
        if doc.get("experiment") != NAME:
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


# ---- the markdown and the PNGs --------------------------------------------------------------------------------------
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
    if any(r.get("identical_to_plain") is not None for r in rows):
        columns.append(("identical_to_plain", "same tokens as plain"))
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


def plot(rows: list[dict], out: Path, *, stem: str = NAME) -> list[Path]:
    """Three PNGs: tokens/s against C, tokens/s against per-request tokens/s (Pareto), verify budget against C."""
    series: dict[str, list[dict]] = {}
    for r in rows:
        series.setdefault(setting_key(r), []).append(r)
    series = {k: sorted(v, key=lambda r: r["concurrency"]) for k, v in series.items()}
    Cs = sorted({r["concurrency"] for r in rows})
    plain_style = {"color": "k", "ls": "--"}
    paths = []

    def save(fig, name: str) -> None:
        paths.append(out / f"{stem}_{name}.png")
        fig.savefig(paths[-1], dpi=110)

    fig, axes = figure(6.5, 4.2)
    ax = axes[0, 0]
    for key, points in series.items():
        ax.plot([r["concurrency"] for r in points], [r["tokens_per_s"] for r in points], marker="o", ms=3,
                label=key, **(plain_style if is_plain(points[0]) else {}))
    plot_log_x(ax, Cs)
    ax.set(yscale="log", xlabel="concurrency C", ylabel="tokens/s (all requests)", title="throughput")
    ax.legend(fontsize=6)
    save(fig, "throughput")

    fig, axes = figure(6.5, 4.2)
    ax = axes[0, 0]
    for key, points in series.items():
        ax.plot([r["per_request_tokens_per_s"] for r in points], [r["tokens_per_s"] for r in points], marker="o",
                ms=3, label=key, **(plain_style if is_plain(points[0]) else {}))
    front = sorted((r for r in rows if r["pareto"]), key=lambda r: r["per_request_tokens_per_s"])
    ax.plot([r["per_request_tokens_per_s"] for r in front], [r["tokens_per_s"] for r in front], color="0.6", lw=4,
            alpha=0.4, label="Pareto front")
    ax.set(xscale="log", yscale="log", xlabel="tokens/s per request", ylabel="tokens/s (all requests)",
           title="throughput against per-request speed (each point one C)")
    ax.legend(fontsize=6)
    save(fig, "pareto")

    fig, axes = figure(6.5, 4.2)
    ax = axes[0, 0]
    for key, points in series.items():
        if not is_plain(points[0]):
            ax.plot([r["concurrency"] for r in points], [r["verified_per_round"] for r in points], marker="o", ms=3,
                    label=key)
    plot_log_x(ax, Cs)
    ax.set(xlabel="concurrency C", ylabel="verified drafts per request per round", title="verify budget against load")
    if ax.lines:  # plain decoding alone verifies nothing
        ax.legend(fontsize=6)
    save(fig, "budget")
    return paths
