"""Simulator validation: the slot engine's measured throughput against the replay simulator's prediction, for the
same host, prompts, drafters and policies, in one process.

    dspark experiment simulator_validation --host smollm2 --drafters ngram dspark --drafter-paths dspark=ckpt/dspark \\
        --policies full scheduler --draft-length 7 --concurrency 1 8 64 --num-prompts 64 --max-new-tokens 128 \\
        --out-dir runs/sim                             # on the GPU: runs/sim/simulator_validation.json
    dspark experiment simulator_validation --host random:tiny-llama --drafters ngram --policies full \\
        --concurrency 1 2 --num-prompts 4 --max-new-tokens 8 --out-dir /tmp/val      # CPU smoke

Steps, all on this machine:
1. the SPS(B) table (the verify step with its LM head) and each drafter's propose and observe costs
   (`dspark.sweep.cost_table`: profiled here, replayed CUDA graphs on CUDA, unless --cost-table);
2. per drafter, a verify-all decode of the prompts at the smallest C: its round log is the simulator's trace;
3. measured: plain decoding and every (drafter, policy) on the slot engine at every C, closed loop, the prompts
   cycled to max(C, --num-prompts) requests;
4. the machine's two constants, from the plain run at each C: `admission_ms` (measured: wall time of its
   admissions per group of arrivals) and `step_overhead_ms` (its time not explained by the table's verify steps
   or by admissions, per round: acceptance, CPU bookkeeping; negative where the table overprices the step), and
   whether its rounds overlapped the CPU's bookkeeping (CUDA: dspark.engine.serve.overlap_allowed, as every
   policy's rounds there), which the replay then models (`Pricing.overlap`; each row says whether it `overlapped`);
5. predicted: `experiments.simulator.simulate` with slot pricing (every slot in every step, bucketed widths), the
   profiled draft cost and those constants, on the same request sequence;
6. the relative error of every prediction.
The plain rows fit the step overhead, so they are not a test: `max_relative_error` is over the speculative rows
(the claim to check: within 15 %), `max_relative_error_all` includes the plain ones.
Writes OUT_DIR/simulator_validation.json (`rows`: measured and predicted tokens/s and tau, relative error;
`constants` per C with the plain run's timings; `max_relative_error`), simulator_validation.md and
simulator_validation.png, and keeps what the predictions were made from: cost.json, trace_<drafter>.json and each
drafter checkpoint's calibration_<drafter>.json. So a change to the simulator or its pricing is checked against a
past GPU run on any machine, without decoding again:

    dspark experiment simulator_validation --replay benchmarks/results/simulator/compiled --out-dir /tmp/again
"""
from __future__ import annotations

import json
import shutil
import sys
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Callable, Optional

import torch

from dspark.documents import Section, envelope, figure, write_result
from dspark.engine.workload import continuous_decode, warmed
from dspark.sweep import build_policy, check_settings, cost_table, workload_context
from experiments.common import RunOptions, build_drafters, drafter_path, load_prompts, sampling_config

NAME = "simulator_validation"


@dataclass
class ValidateOptions:
    drafters: list[str] = field(default_factory=lambda: ["ngram", "dspark"], metadata={
        "help": "drafter names (ngram, dspark, dflash, eagle3, mtp, small-lm); plain decoding is always measured"})
    policies: list[str] = field(default_factory=lambda: ["full", "scheduler"], metadata={
        "help": "verification policies: full (every draft), threshold, scheduler, lagged"})
    draft_length: int = field(default=7, metadata={"help": "draft length γ: draft tokens proposed per round"})
    concurrency: list[int] = field(default_factory=lambda: [1, 8, 64], metadata={"help": "requests in flight"})
    threshold: float = field(default=0.5, metadata={"help": "survival threshold of the 'threshold' policy"})
    cost_table: Optional[str] = field(default=None, metadata={
        "help": "SPS(B) JSON with draft costs from `dspark profile --drafter...` (default: profile this host now)"})
    data: str = field(default="sharegpt", metadata={"help": "prompt source for hosts with a tokenizer"})
    replay: Optional[str] = field(default=None, metadata={
        "help": "a folder this runner wrote: re-predict its measured rows with today's simulator (no host, no "
                "decoding; the other options are ignored) into --out-dir"})


def _check(opts: ValidateOptions) -> None:
    check_settings(opts.policies, concurrency=opts.concurrency, draft_length=[opts.draft_length])


def measure(host, run: RunOptions, opts: ValidateOptions, *, prompts: list[list[int]], out_dir: Path,
            progress: Optional[Callable[[dict], None]] = None) -> dict:
    """Measured and predicted rows at every C; `progress`, when given, receives the result so far after every C but
    the last (main writes it, marked partial: a device call cut short keeps the C it finished)."""
    from dspark.api import saved_calibration
    from dspark.engine.graphs import defers_observe
    from experiments.simulator import simulate, trace_from_result
    from verifiers import build_verifier
    from verifiers.cost_model import draft_key

    _check(opts)
    K = opts.draft_length
    drafters = {name: d for (name, _), d in build_drafters(host, opts.drafters, run.drafter_paths, [K]).items()}
    cost = cost_table(host, opts.cost_table, concurrency=opts.concurrency, draft_lengths=[K], out_dir=out_dir,
                      drafters=[(d, K) for d in drafters.values()],
                      context=workload_context(prompts, run.max_new_tokens))
    sampling = sampling_config(run.temperature)

    def decode(batch, drafter, verifier, C):
        return warmed(continuous_decode)(host, batch, drafter=drafter, verifier=verifier,
                                         draft_length=K if drafter else 0, max_new_tokens=run.max_new_tokens,
                                         sampling=sampling, seed=run.seed, concurrency=C)

    def policy(name: str, drafter_name: str):
        return build_policy(host, name, draft_length=K, path=drafter_path(run.drafter_paths, drafter_name, K),
                            threshold=opts.threshold, cost=cost)

    traces = {name: trace_from_result(decode(prompts, d, build_verifier("full"), min(opts.concurrency)),
                                      draft_length=K, method=name) for name, d in drafters.items()}
    for name, trace in traces.items():  # kept, with the calibration the policies read, for `--replay`
        (out_dir / f"trace_{name}.json").write_text(json.dumps(trace) + "\n")
        calibration = saved_calibration(drafter_path(run.drafter_paths, name, K))  # what build_policy applies
        if calibration is not None:
            shutil.copyfile(calibration, out_dir / f"calibration_{name}.json")
    rows, constants = [], {}
    for C in opts.concurrency:
        batch = [prompts[i % len(prompts)] for i in range(max(C, len(prompts)))]
        plain = decode(batch, None, None, C)
        e = plain.engine
        constants[C] = _constants({"seconds": plain.seconds, "rounds": plain.rounds, "admit_s": e["admit_s"],
                                   "admissions": e["admissions"], "overlapped": e["overlapped"]}, cost, C)
        shared = dict(concurrency=C, cost=cost, requests=len(batch))
        any_trace = next(iter(traces.values()), None) or trace_from_result(plain, draft_length=0, method="plain")
        predicted = simulate(any_trace, policy=None, pricing=_pricing(constants[C], cost), **shared)
        rows.append(_row("plain", "none", C, plain, predicted, fitted=True, K=0, requests=len(batch)))
        for name, drafter in drafters.items():
            key = draft_key(drafter, K)
            for p in opts.policies:
                verifier = policy(p, name)
                measured = decode(batch, drafter, verifier, C)
                deferred = defers_observe(drafter, verifier, K)
                pricing = _pricing(constants[C], cost, key=key, deferred=deferred,
                                   overlapped=measured.engine["overlapped"])
                predicted = simulate(traces[name], policy=policy(p, name), pricing=pricing, **shared)
                rows.append(_row(name, p, C, measured, predicted, fitted=False, K=K, requests=len(batch),
                                 draft_key=key, deferred_observe=deferred))
                print(f"C={C:4d} {name}/{p}: measured {rows[-1]['measured_tokens_per_s']:.1f} tok/s, predicted "
                      f"{rows[-1]['predicted_tokens_per_s']:.1f} ({100 * rows[-1]['relative_error']:+.1f} %)",
                      flush=True)
        if progress is not None and C != opts.concurrency[-1]:
            progress(_result(rows, constants, K))
    return _result(rows, constants, K)


def _constants(plain: dict, cost, C: int) -> dict:
    """The machine's constants at C from its plain run's timings (`plain`: seconds, rounds, admit_s, admissions,
    overlapped; kept in the result as `plain_run`, so that `--replay` refits them under today's pricing):
    `admission_ms` per group of arrivals, and `step_overhead_ms`, the plain round's time not explained by the
    table's verify step (C rows of one token, priced by that shape) or by admissions; negative when the table
    prices the step above what the engine took (the constant then corrects the table)."""
    from verifiers.prefix_scheduler import forward_seconds

    rounds = max(1, plain["rounds"])
    step_s = float(forward_seconds(cost, C, torch.tensor([1]))[0])
    return {"admission_ms": 1000 * plain["admit_s"] / max(1, plain["admissions"]),
            "step_overhead_ms": 1000 * (plain["seconds"] - plain["admit_s"] - plain["rounds"] * step_s) / rounds,
            "verify_ms_table": 1000 * step_s, "overlap": plain["overlapped"], "plain_run": dict(plain)}


def _pricing(constants: dict, cost, *, key: str | None = None, deferred: bool = False,
             overlapped: bool | None = None):
    """The slot pricing of one row: the machine's constants, and for a drafter (`key`, its cost-table entry) its
    profiled propose and observe (none where unprofiled), its deferred observe and whether its rounds overlapped."""
    from experiments.simulator import Pricing

    machine = dict(mode="slots", admission_ms=constants["admission_ms"],
                   step_overhead_ms=constants["step_overhead_ms"],
                   overlap=constants["overlap"] if overlapped is None else overlapped)
    if key is None:
        return Pricing(**machine)
    profiled = key in cost.draft

    def draft_seconds(R, step="propose"):
        return (cost.draft_seconds(key, R, step=step) or 0.0) if profiled else 0.0
    return Pricing(draft_seconds=draft_seconds, observe_seconds=partial(draft_seconds, step="observe"),
                   deferred_observe=deferred, **machine)


def replay(source: str | Path) -> dict:
    """Re-predict a validation's measured rows with today's simulator and pricing, without a host or decoding:
    `source` is a folder this runner wrote (its JSON, cost.json, trace_<drafter>.json and any
    calibration_<drafter>.json). The machine constants are refitted from each C's plain run; the measured values
    are the folder's. Returns the folder's document with the new rows, constants and largest errors."""
    from experiments.simulator import load_trace, simulate
    from verifiers import build_verifier, policy_options
    from verifiers.cost_model import CostModel

    source = Path(source)
    path = source / f"{NAME}.json"
    if not path.is_file():
        raise FileNotFoundError(f"no {NAME}.json in {source}: --replay takes a folder this runner wrote")
    doc = json.loads(path.read_text())
    K, settings = doc["draft_length"], doc.get("settings", {})
    plain = {r["concurrency"]: r for r in doc["rows"] if r["fitted"]}
    tested = [r for r in doc["rows"] if not r["fitted"]]
    if not tested or any("plain_run" not in c for c in doc["constants"].values()):
        raise ValueError(f"{path} cannot be replayed: it has no speculative rows, or it was written before "
                         f"validations kept their traces and plain timings (2026-12-07)")
    methods = list(dict.fromkeys(r["method"] for r in tested))
    traces = {}
    for m in methods:
        if not (source / f"trace_{m}.json").is_file():
            raise FileNotFoundError(f"{source} lacks trace_{m}.json, the logged rounds of drafter {m!r}")
        traces[m] = load_trace(source / f"trace_{m}.json")
    cost = CostModel.load(source / "cost.json")
    constants = {int(C): _constants(c["plain_run"], cost, int(C)) for C, c in doc["constants"].items()}

    def predicted_row(r: dict, predicted: dict) -> dict:
        got = r["measured_tokens_per_s"]
        return {**r, "predicted_tokens_per_s": predicted["tokens_per_s"], "predicted_tau": predicted["tau"],
                "relative_error": (predicted["tokens_per_s"] - got) / got, "predicted_steps": predicted["steps"]}

    rows = []
    for C, r in plain.items():
        shared = dict(concurrency=C, cost=cost, requests=r["requests"])
        rows.append(predicted_row(r, simulate(traces[methods[0]], policy=None,
                                              pricing=_pricing(constants[C], cost), **shared)))
        for t in (t for t in tested if t["concurrency"] == C):
            calibration = source / f"calibration_{t['method']}.json"
            policy = build_verifier(t["policy"], positions=K,
                                    **policy_options(t["policy"], threshold=settings.get("threshold"), cost_table=cost),
                                    calibration=calibration if t["policy"] != "full" and calibration.is_file()
                                    else None)
            pricing = _pricing(constants[C], cost, key=t["draft_key"], deferred=t["deferred_observe"],
                               overlapped=t["overlapped"])
            rows.append(predicted_row(t, simulate(traces[t["method"]], policy=policy, pricing=pricing, **shared)))
    return {**doc, **_result(rows, constants, K)}


def _result(rows: list[dict], constants: dict, K: int) -> dict:
    tested = [abs(r["relative_error"]) for r in rows if not r["fitted"]]
    return {"rows": rows, "constants": dict(constants), "draft_length": K,
            "max_relative_error": max(tested) if tested else None,
            "max_relative_error_all": max(abs(r["relative_error"]) for r in rows)}


def _row(method: str, policy: str, C: int, measured, predicted: dict, *, fitted: bool, K: int, requests: int,
         draft_key: str | None = None, deferred_observe: bool = False) -> dict:
    from dspark.metrics import summarize

    m = summarize(measured, draft_length=K)
    got, want = m["tokens_per_s"], predicted["tokens_per_s"]
    return {"method": method, "policy": policy, "concurrency": C, "fitted": fitted,
            "measured_tokens_per_s": got, "predicted_tokens_per_s": want, "relative_error": (want - got) / got,
            "measured_tau": m["tau"], "predicted_tau": predicted["tau"], "rounds": measured.rounds,
            "predicted_steps": predicted["steps"], "overlapped": measured.engine["overlapped"],
            "requests": requests, "draft_key": draft_key, "deferred_observe": deferred_observe}


def render(doc: dict, out: Path) -> Section:
    from dspark.metrics import markdown_table

    rows = doc["rows"]
    table = markdown_table(rows, [("concurrency", "C"), ("method", "method"), ("policy", "policy"),
                                  ("measured_tau", "τ measured"), ("predicted_tau", "τ predicted"),
                                  ("measured_tokens_per_s", "tokens/s measured"),
                                  ("predicted_tokens_per_s", "tokens/s predicted"),
                                  ("relative_error", "relative error"), ("fitted", "fitted"),
                                  ("overlapped", "overlapped")])
    consts = "\n".join(f"| {C} | {c['verify_ms_table']:.3f} | {c['step_overhead_ms']:.3f} | "
                       f"{c.get('overlap', False)} | {c['admission_ms']:.3f} |" for C, c in doc["constants"].items())
    worst = doc["max_relative_error"]
    text = ("**Partial result**: the run stopped before its last concurrency.\n\n" if doc.get("partial") else "")
    if doc.get("replayed"):
        text += (f"**Replayed** (`{doc['replayed']['command']}`, {doc['replayed']['environment']['date']}): the "
                 f"measured rows of `{doc['replayed']['from']}`, predicted again by the simulator of this tree.\n\n")
    text += (f"Largest relative error of a prediction (speculative rows): "
            f"{'n/a' if worst is None else f'{100 * worst:.1f} %'}; with the fitted plain rows: "
            f"{100 * doc['max_relative_error_all']:.1f} %.\n\n" + table
            + "\n\nMachine constants from the plain run at each C (the verify step from the cost table):\n\n"
              "| C | verify ms (table) | step overhead ms | rounds overlapped | admission ms |\n"
              "|---|---|---|---|---|\n" + consts + "\n")
    fig, axes = figure(4.8, 4.4)
    ax = axes[0, 0]
    for fitted, marker in ((False, "o"), (True, "s")):
        pts = [r for r in rows if r["fitted"] == fitted]
        ax.scatter([r["measured_tokens_per_s"] for r in pts], [r["predicted_tokens_per_s"] for r in pts],
                   marker=marker, label="plain (fitted)" if fitted else "speculative (predicted)")
    lo = min(min(r["measured_tokens_per_s"], r["predicted_tokens_per_s"]) for r in rows)
    hi = max(max(r["measured_tokens_per_s"], r["predicted_tokens_per_s"]) for r in rows)
    for f, style in ((1.0, "-"), (1.15, ":"), (0.85, ":")):
        ax.plot([lo, hi], [f * lo, f * hi], "k" + style, lw=0.8)
    ax.set(xscale="log", yscale="log", xlabel="measured tokens/s", ylabel="predicted tokens/s",
           title="simulator against the engine (dotted: ±15 %)")
    ax.legend(fontsize=7)
    path = out / f"{NAME}.png"
    fig.savefig(path, dpi=110)
    return Section(title="simulator validation: predicted against measured throughput", markdown=text, images=[path])


def main(argv: list[str] | None = None) -> int:
    from dspark.cli import HostOptions, _host
    from dspark.config import parse

    argv = list(sys.argv[1:] if argv is None else argv)
    h, run, opts = parse([HostOptions, RunOptions, ValidateOptions], argv, prog=f"dspark experiment {NAME}")
    if opts.replay:
        return _main_replay(opts.replay, run.out_dir, argv)
    _check(opts)
    host = _host(h)
    prompts = load_prompts(host, opts.data, run.num_prompts, seed=run.seed, max_prompt_length=run.max_prompt_length)
    doc = envelope(NAME, argv=argv, host=host, options=[h, run, opts])

    def checkpoint(part: dict) -> None:  # a run cut short (a device call's time limit) keeps the C it finished
        write_result({**doc, **part, "partial": True}, run.out_dir, render)
    doc.update(measure(host, run, opts, prompts=prompts, out_dir=Path(run.out_dir), progress=checkpoint))
    path = write_result(doc, run.out_dir, render)
    worst = doc["max_relative_error"]
    print(f"wrote {path}; largest relative error of a prediction: {'n/a' if worst is None else f'{100 * worst:.1f} %'}")
    return 0


def _main_replay(source: str, out_dir: str, argv: list[str]) -> int:
    """`--replay SOURCE`: SOURCE's document (its command, machine and measured rows) with today's predictions,
    written to out_dir (never over SOURCE's record), the replay's own command, machine and date under `replayed`."""
    from dspark.quickstart import environment

    if Path(out_dir).resolve() == Path(source).resolve():
        raise ValueError(f"--out-dir {out_dir} is the replayed folder: write the replay elsewhere, the measured "
                         f"record stays as it was")
    doc = replay(source)
    doc["replayed"] = {"from": str(source), "command": f"dspark experiment {NAME} " + " ".join(argv),
                       "environment": environment(torch.device("cpu"))}
    path = write_result(doc, out_dir, render)
    worst = doc["max_relative_error"]
    print(f"wrote {path}; replayed {source}: largest relative error of a prediction: {100 * worst:.1f} %")
    return 0

