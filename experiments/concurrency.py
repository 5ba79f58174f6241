"""Concurrency and break-even: throughput and per-request speed against concurrency C, for plain decoding and every
(drafter, policy, draft length) setting, all decoded in this one process on the same prompts and seeds. The
front-end of dspark.sweep with the most options: several drafters by name (NAME=DIR / NAME@N=DIR checkpoints),
several policies and draft lengths, --repeats, --merge. `dspark bench` and `dspark sweep` run the same tool for one
drafter and write the same concurrency.json.

    dspark experiment concurrency --host smollm2 --drafters ngram dspark dflash eagle3 mtp \\
        --drafter-paths dspark=ckpt/dspark dflash=ckpt/dflash eagle3=ckpt/eagle3 mtp=ckpt/mtp \\
        --policies full threshold scheduler --draft-lengths 3 5 7 --concurrency 1 2 4 8 16 32 64 \\
        --num-prompts 64 --max-new-tokens 128 --out-dir results/concurrency
    dspark experiment concurrency --host random:tiny-llama --drafters ngram dspark --policies full scheduler \\
        --draft-lengths 3 7 --concurrency 1 2 4 --num-prompts 8 --max-new-tokens 16 --out-dir /tmp/cc   # CPU smoke

Writes OUT_DIR/concurrency.json (the schema: dspark.sweep's docstring; rows of method, policy, draft_length,
concurrency, engine, tokens_per_s, per_request_tokens_per_s, tau, speedup, identical_to_plain, engine_stats, ...;
`break_even`: setting -> C or null), concurrency.md and PNGs: tokens/s against C, the throughput / per-request speed
curve (Pareto front marked) and the verify budget against load.

Engine: "continuous" (default) keeps C requests in flight on the slot engine, a queued request entering as soon as
one stops; "static-batch" runs the prompts in successive static batches of C (requests that finish early are not
replaced). max(num_prompts, C) requests are decoded at each C.
Scheduler policies need an SPS(B) table: --cost-table, or one is profiled on this host first (OUT_DIR/cost.json).

--repeats N decodes every row N times per C, rotating the settings' order each time (so that no setting is always
first at a C); a row then holds the median tokens/s and its speedup is the median of the paired ratios to plain
decoding's decode of the same repeat, with their range (`speedup_range`): the noise between single decodes is then
visible beside each ratio.
The JSON is rewritten after every C (`"partial": true` until the last), so a run cut short keeps what it measured.
A sweep too long for one sitting runs as several (e.g. --concurrency 1 4 16 64, then 256 512, each profiling the
SPS(B) table at its own C) and `--merge A/concurrency.json B/concurrency.json --out-dir DIR` joins them
into one document (break-even over every C; each source's command and environment kept under `sources`).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Optional

from dspark.documents import envelope, write_result
from dspark.sweep import NAME, Drafted, Sweep, break_even, check, check_settings, merge, render, run
from experiments.common import RunOptions, build_drafters, drafter_path, load_prompts, sampling_config


@dataclass
class ConcurrencyOptions:
    drafters: list[str] = field(default_factory=lambda: ["ngram", "dspark"], metadata={
        "help": "drafter names (ngram, dspark, dflash, eagle3, mtp, small-lm); plain decoding is always measured"})
    policies: list[str] = field(default_factory=lambda: ["full", "scheduler"], metadata={
        "help": "verification policies: full (every draft), threshold, scheduler, lagged"})
    draft_lengths: list[int] = field(default_factory=lambda: [3, 7], metadata={
        "help": "draft lengths γ (draft tokens proposed per round)"})
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
        "help": "CUDA events split every round's device seconds by stage (each row's engine_stats.stage_s): a "
                "diagnostic, the events themselves cost a little"})
    merge: list[str] = field(default_factory=list, metadata={
        "help": "concurrency.json files of one sweep run in parts: join their rows into OUT_DIR (nothing decoded)"})


def _check(opts: ConcurrencyOptions) -> None:
    """The options' errors, before a host or drafter is loaded."""
    check_settings(opts.policies, concurrency=opts.concurrency, draft_lengths=opts.draft_lengths)
    check(Sweep(drafted=[], policies=opts.policies, concurrency=opts.concurrency, engine=opts.engine,
                repeats=opts.repeats))


def sweep_of(host, run: RunOptions, opts: ConcurrencyOptions) -> Sweep:
    """The dspark.sweep grid these options name: every drafter at every draft length (its NAME@N or NAME
    checkpoint), every policy, every C."""
    _check(opts)
    drafters = build_drafters(host, opts.drafters, run.drafter_paths, opts.draft_lengths)
    drafted = [Drafted(name, K, drafter, path=drafter_path(run.drafter_paths, name, K))
               for (name, K), drafter in drafters.items()]
    return Sweep(drafted=drafted, policies=opts.policies, concurrency=opts.concurrency,
                 max_new_tokens=run.max_new_tokens, sampling=sampling_config(run.temperature), seed=run.seed,
                 engine=opts.engine, repeats=opts.repeats, stage_timing=opts.stage_timing, threshold=opts.threshold,
                 cost_table=opts.cost_table)


def main(argv: list[str] | None = None) -> int:
    from dspark.cli import HostOptions, _host
    from dspark.config import parse

    argv = list(sys.argv[1:] if argv is None else argv)
    h, run_opts, opts = parse([HostOptions, RunOptions, ConcurrencyOptions], argv,
                              prog="dspark experiment concurrency")
    if opts.merge:
        doc = merge(opts.merge)
        doc["command"] = "dspark experiment concurrency " + " ".join(argv)
        doc["settings"]["out_dir"] = run_opts.out_dir
        doc["break_even"] = break_even(doc["rows"])
        path = write_result(doc, run_opts.out_dir, render)
        print(f"wrote {path} from {len(opts.merge)} runs; break-even concurrency: {doc['break_even']}")
        return 0
    _check(opts)
    host = _host(h)
    prompts = load_prompts(host, opts.data, run_opts.num_prompts, seed=run_opts.seed,
                           max_prompt_length=run_opts.max_prompt_length)
    run(host, prompts, sweep_of(host, run_opts, opts), out_dir=run_opts.out_dir,
        doc=envelope(NAME, argv=argv, host=host, options=[h, run_opts, opts]))
    return 0
