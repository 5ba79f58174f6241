"""`dspark <command> ...`: the console script. Every command's flags are typed dataclass fields (dspark.config),
so `--config run.yaml` works everywhere and unknown keys are errors.

    dspark quickstart [--size ci|small|full]        train a DSpark drafter, measure where speculation pays, report
    dspark generate --prompt "..." [--drafter ngram|dspark|... | --drafter-path DIR] [--json]
    dspark eval --drafter-path DIR --data sharegpt --temperature 1 --json
    dspark compare --run a.json --against b.json    tau ratio of two evals with a paired bootstrap interval
    dspark train --output DIR [--drafter dspark|dflash|eagle3|mtp] [--data FILE]   train a drafter, host frozen
    dspark regenerate --output FILE.jsonl [--data sharegpt]   the host's own answers to prompts (training data)
    dspark profile --host smollm2 --out cost.json    verify steps per second by tokens a step, for the schedulers
    dspark calibrate --drafter-path DIR --data sharegpt   STS temperatures (+ reliability diagram), train side
    dspark sweep --drafter-path DIR --draft-lengths 1 3 5 7 --batch-sizes 1 4 16   dspark.sweep, static batches
    dspark experiment NAME ...                     concurrency, savings, threshold, length, acceptance, simulate
    dspark report RESULTS_DIR [--report-to wandb]  one markdown page (tables + PNGs) from experiment results
    dspark bench --host HOST --drafter NAME --concurrency 1 4 --num-prompts 8 --out-dir DIR   dspark.sweep, C in flight
    dspark export --drafter-path DIR --format deepspec --output OUT   the reference's layout (docs/DEEPSPEC.md)

eval, sweep and calibrate take the held-out split a `dspark train` drafter was trained with (docs/RELIABILITY.md §7).
"""
from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional

from dspark.config import ConfigError, parse
from dspark.engine.jsonio import dumps


@dataclass
class HostOptions:
    host: str = field(default="smollm2", metadata={
        "help": "host: smollm2, qwen2.5-coder-1.5b, qwen2.5-coder-0.5b, a .gguf file, random:<shape>, a directory or a "
                "cached hub id"})
    device: str = field(default="auto", metadata={"help": "auto (cuda if available), cpu, cuda, cuda:1, ..."})
    dtype: str = field(default="auto", metadata={"help": "auto (bf16 on GPU, fp32 on CPU), float32, bfloat16, float16"})
    deterministic: bool = field(default=False, metadata={
        "help": "deterministic kernels, no TF32, CUBLAS_WORKSPACE_CONFIG set (dspark.set_deterministic; "
                "docs/RELIABILITY.md says what it guarantees)"})
    compile: Literal["auto", "on", "off"] = field(default="auto", metadata={
        "help": "decode steps (and the drafter's propose and observe) through torch.compile (fewer kernels per step; "
                "each step shape compiles once, counted in the warm-up; dspark.engine.compiled); auto = on CUDA"})


DRAFTER_DTYPE_HELP = ("the dtype a drafter decodes in: host (its weights cast to the host's dtype, bf16 on a GPU) or "
                      "float32 (its float32 master weights as trained: on a bf16 host each draft step then reads "
                      "twice the bytes)")


@dataclass
class DecodeOptions:
    drafter: str = field(default="none", metadata={
        "help": "a registered name: none (plain decoding), ngram, dspark, dflash, mtp, eagle3, small-lm; with "
                "--drafter-path the checkpoint's weights, without it random weights (a warning). Never a folder, "
                "even one of the same name: folders go to --drafter-path"})
    drafter_path: Optional[str] = field(default=None, metadata={
        "help": "a save_pretrained drafter directory (or a `dspark train --output` directory: its newest checkpoint); "
                "with --drafter small-lm, the small LM named like a host (e.g. qwen2.5-coder-0.5b)"})
    verifier: Literal["full", "threshold", "scheduler", "lagged"] = field(default="full", metadata={
        "help": "how many drafts each request verifies per round"})
    threshold: Optional[float] = field(default=None, metadata={"help": "confidence threshold (--verifier threshold)"})
    cost_table: Optional[str] = field(default=None, metadata={
        "help": "SPS(B) JSON from `dspark profile` (--verifier scheduler|lagged)"})
    calibration: Optional[str] = field(default=None, metadata={
        "help": "STS JSON from `dspark calibrate` (default: the drafter directory's calibration.json)"})
    draft_gate: bool = field(default=True, metadata={
        "help": "--verifier scheduler|lagged: skip the draft forward while speculation does not pay for itself, "
                "probing again later (priced with the cost table's draft cost, `dspark profile --drafter-path`); "
                "--no-draft-gate drafts every round"})
    drafter_dtype: Literal["host", "float32"] = field(default="host", metadata={"help": DRAFTER_DTYPE_HELP})
    draft_length: int = field(default=7, metadata={"help": "draft length γ: draft tokens proposed per round"})
    max_new_tokens: int = field(default=128, metadata={"help": "new tokens per request at most"})
    temperature: float = field(default=0.0, metadata={"help": "0 = greedy"})
    top_p: float = field(default=1.0, metadata={"help": "nucleus mass in (0, 1]; 1 = off"})
    top_k: int = field(default=0, metadata={"help": "0 = off"})
    seed: int = field(default=0, metadata={"help": "request i is seeded with seed + i"})
    batch_size: Optional[int] = field(default=None, metadata={
        "help": "requests decoded together in static batches (default: all at once)"})


@dataclass
class ServeOptions:
    """Continuous batching for generate / eval / calibrate (`dspark bench` takes a list of concurrencies instead)."""

    concurrency: Optional[int] = field(default=None, metadata={
        "help": "continuous batching instead of static batches: this many requests in flight, a queued one entering "
                "as soon as one stops (the slot engine); excludes --batch-size"})


@dataclass
class GenerateOptions:
    prompt: list[str] = field(default_factory=list, metadata={"help": "prompt text (repeat the flag for a batch)"})
    json: bool = field(default=False, metadata={
        "help": "print one JSON object {outputs, stats} (a statistic undefined for the run, e.g. tau of a request "
                "with no round, is null)"})
    chat: bool = field(default=True, metadata={"help": "wrap prompts in the tokenizer's chat template"})


@dataclass
class EvalOptions:
    data: str = field(default="sharegpt", metadata={
        "help": "sharegpt, humaneval, champ (math), a .jsonl file or a datasets dir"})
    split: Optional[Literal["train", "heldout", "all"]] = field(default=None, metadata={
        "help": "which split's prompts. Default: heldout (all of an evaluation set, humaneval or champ, that the "
                "drafter did not train on); for `dspark calibrate` train, so that a calibration never fits on the "
                "held-out prompts `dspark eval` scores (and then loads that calibration for)"})
    heldout_fraction: Optional[float] = field(default=None, metadata={
        "help": "share of the conversations in the held-out split. Default: the value the drafter was trained with "
                "(its checkpoint's trainer_state.json) when it was trained on this --data, else 0.02; another value "
                "than the drafter's own is refused, since its held-out split would then hold prompts it trained on"})
    limit: int = field(default=32, metadata={"help": "prompts evaluated"})
    on_error: Literal["skip", "raise"] = field(default="skip", metadata={
        "help": "malformed data records: skip them (each logged as file:line) or raise at the first (file:line)"})
    offset: int = field(default=0, metadata={
        "help": "skip this many fitting prompts first (e.g. calibrate on prompts an eval does not use)"})
    max_prompt_length: int = field(default=512, metadata={"help": "skip prompts longer than this many tokens"})
    output: Optional[str] = field(default=None, metadata={
        "help": "also write the metrics JSON here (a metric undefined for the run is null: e.g. plain decoding's "
                "verify rate, with no draft verified)"})
    json: bool = field(default=False, metadata={
        "help": "print the metrics as one JSON object (undefined metrics null, as in --output)"})


@dataclass
class ProfileOptions:
    out: str = field(default="cost.json", metadata={"help": "the SPS(B) table (JSON; a .csv beside it)"})
    batch_sizes: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32],
                                   metadata={"help": "requests per step to time"})
    tokens_per_request: list[int] = field(default_factory=lambda: [1, 2, 4, 8], metadata={
        "help": "tokens per request per step (1 + verified drafts)"})
    context: int = field(default=256, metadata={
        "help": "cached positions per request while timing: the workload's longest prompt plus its new tokens (eager "
                "steps attend that prefix; graph mode attends the whole cache the slot engine allocates for it)"})
    repeats: int = field(default=10, metadata={"help": "timed steps per point (median kept)"})
    warmup: int = field(default=3, metadata={"help": "untimed steps per point"})
    mode: Literal["auto", "eager", "graph"] = field(default="auto", metadata={
        "help": "time each step as called (eager) or as a replayed CUDA graph (graph: how the slot engine runs on "
                "CUDA); auto = graph on CUDA, eager elsewhere"})
    engine_json: Optional[str] = field(default=None, metadata={
        "help": "also export the engine-neutral scheduling JSON (with --calibration's STS temperatures)"})
    calibration: Optional[str] = field(default=None, metadata={"help": "STS JSON to include in --engine-json"})
    sglang_sps_table: Optional[str] = field(default=None, metadata={
        "help": "also write the table as SGLang's DSpark scheduler reads it (--speculative-dspark-sps-table-path)"})
    drafter: Optional[str] = field(default=None, metadata={
        "help": "also time this drafter's own propose step (a registered name; with --drafter-path its weights) at "
                "every --batch-sizes, so the schedulers can tell when drafting does not pay"})
    drafter_path: Optional[str] = field(default=None, metadata={"help": "the drafter checkpoint to time"})
    drafter_dtype: Literal["host", "float32"] = field(default="host", metadata={"help": DRAFTER_DTYPE_HELP})
    draft_lengths: list[int] = field(default_factory=lambda: [7], metadata={
        "help": "draft lengths γ to time the drafter at"})


@dataclass
class CalibrateOptions:
    out: Optional[str] = field(default=None, metadata={"help": "STS JSON (default: DRAFTER_PATH/calibration.json)"})
    report: Optional[str] = field(default=None, metadata={
        "help": "report JSON (default: beside --out); a reliability PNG is written next to it"})
    holdout: float = field(default=0.5, metadata={
        "help": "share of the prompts kept out of the fit: the report's before/after is measured on them "
                "(0 = fit and report on every prompt, an optimistic report)"})


@dataclass
class SweepOptions:
    """`dspark sweep`: dspark.sweep for one drafter over draft lengths and static batch sizes (its other flags are
    DecodeOptions' and, for the prompts, EvalOptions'; --draft-length and --batch-size are not used)."""

    draft_lengths: list[int] = field(default_factory=lambda: [1, 3, 5, 7], metadata={
        "help": "draft lengths γ (draft tokens proposed per round), each a setting"})
    batch_sizes: list[int] = field(default_factory=lambda: [1, 4, 16], metadata={
        "help": "concurrency C: the prompts decoded in static batches of C (dspark.sweep's static-batch engine; "
                "`dspark bench` and `dspark experiment concurrency` keep C in flight instead)"})
    out_dir: str = field(default="sweep", metadata={
        "help": "directory for concurrency.json, concurrency.md and its PNGs (dspark.sweep)"})


@dataclass
class ExportOptions:
    drafter_path: str = field(metadata={"help": "the drafter checkpoint to export (dspark's or DeepSpec's)"})
    output: str = field(metadata={"help": "directory to write the exported checkpoint to (replaced)"})
    format: Literal["deepspec"] = field(default="deepspec", metadata={
        "help": "deepspec: the layout of deepseek-ai/DeepSpec, which vLLM, SGLang and TensorRT-LLM load"})
    host: Optional[str] = field(default=None, metadata={
        "help": "the host the drafter was trained for (default: the one the checkpoint records)"})
    device: str = field(default="cpu", metadata={"help": "where the host is loaded to read its embedding and LM head"})
    dtype: Literal["float32", "bfloat16"] = field(default="float32", metadata={"help": "dtype of the written weights"})
    mask_token_id: Optional[int] = field(default=None, metadata={
        "help": "DSpark/DFlash: the embedding row holding the mask embedding (default: the first row past the "
                "tokenizer's vocabulary, 151669 on Qwen3)"})


@dataclass
class BenchOptions:
    """`dspark bench`: dspark.sweep for plain decoding and at most one drafter at --draft-length under --verifier,
    C requests in flight (its other flags are DecodeOptions'; --batch-size is not used)."""

    concurrency: list[int] = field(default_factory=lambda: [1, 8], metadata={
        "help": "requests kept in flight (closed loop: a queued request enters as soon as one finishes)"})
    num_prompts: int = field(default=16, metadata={
        "help": "requests per run, the prompt set repeated to fill (max(C, this) at concurrency C)"})
    data: str = field(default="mtbench", metadata={
        "help": "the prompts: mtbench (six MT-Bench first turns, built in) or a `dspark eval --data` source "
                "(sharegpt, humaneval, champ, a .jsonl file or a datasets dir; its held-out split, all of an "
                "evaluation set), its first --num-prompts that fit --max-prompt-length"})
    max_prompt_length: int = field(default=512, metadata={"help": "with --data other than mtbench: skip prompts "
                                                                  "longer than this many tokens"})
    out_dir: str = field(default="bench", metadata={
        "help": "directory for concurrency.json, concurrency.md and its PNGs (dspark.sweep)"})


@dataclass
class CompareOptions:
    run: str = field(metadata={"help": "an eval JSON (dspark eval --output FILE): the numerator"})
    against: list[str] = field(metadata={"help": "eval JSONs of the same prompts to divide it by"})
    level: float = field(default=0.95, metadata={"help": "confidence level of the paired bootstrap interval"})
    json: bool = field(default=False, metadata={"help": "print one JSON object per comparison"})


def _host(opts: HostOptions):
    from dspark.api import load_host, set_deterministic

    if opts.deterministic:
        set_deterministic()  # before the host is loaded: cuBLAS reads its workspace setting when CUDA starts
    compile = {"auto": None, "on": True, "off": False}[opts.compile]  # auto: Host.compiling decides (CUDA)
    return load_host(opts.host, dtype=opts.dtype, device=opts.device, compile=compile)


def check_drafter_flag(d: DecodeOptions) -> None:
    """ConfigError unless --drafter is a registered name; a folder there gets a hint to use --drafter-path."""
    from drafters import DRAFTERS

    if d.drafter == "none" or d.drafter in DRAFTERS:
        return
    hint = (f"; {d.drafter!r} is a folder: pass a checkpoint directory as --drafter-path {d.drafter}"
            if Path(d.drafter).is_dir() else "")
    raise ConfigError(f"unknown --drafter {d.drafter!r}: choose none or one of {', '.join(sorted(DRAFTERS))}{hint}")


def _decode_kwargs(d: DecodeOptions, serve: ServeOptions) -> dict:
    check_drafter_flag(d)
    if serve.concurrency is not None and d.batch_size is not None:
        raise ConfigError("--concurrency (continuous batching) and --batch-size (static batches) exclude each other")
    return dict(drafter=None if d.drafter == "none" and d.drafter_path else d.drafter, drafter_path=d.drafter_path,
                verifier=d.verifier, threshold=d.threshold, cost_table=d.cost_table, calibration=d.calibration,
                draft_gate=d.draft_gate, draft_length=d.draft_length, max_new_tokens=d.max_new_tokens,
                temperature=d.temperature, top_p=d.top_p, top_k=d.top_k, seed=d.seed, batch_size=d.batch_size,
                concurrency=serve.concurrency, drafter_dtype=d.drafter_dtype)


def cmd_generate(argv) -> int:
    from dspark.api import generate

    h, d, g, v = parse([HostOptions, DecodeOptions, GenerateOptions, ServeOptions], argv, prog="dspark generate")
    if not g.prompt:
        raise ConfigError("give at least one --prompt")
    host = _host(h)
    out = generate(host, prompts=g.prompt, chat=g.chat, progress=not g.json, **_decode_kwargs(d, v))
    stats = out.stats
    if g.json:
        print(dumps({"outputs": [{"text": t, "token_ids": ids, "finish_reason": r}
                                      for t, ids, r in zip(out.texts, out.token_ids, out.result.finish_reasons)],
                          "stats": stats}))
    else:
        for i, text in enumerate(out.texts):
            print(f"--- [{i}] ---\n{text}")
        print(f"tau {stats['tau']:.2f} | {stats['new_tokens']} tokens in {stats['rounds']} rounds, "
              f"{stats['seconds']:.2f} s ({stats['tokens_per_s']:.1f} tok/s)")
    return 0


def trained_split(drafter_path) -> dict | None:
    """{"data", "heldout_fraction"} a drafter was trained with, from the trainer_state.json that `dspark train`
    writes into every checkpoint; None for a checkpoint without one (saved by other means)."""
    from dspark.api import checkpoint_dir
    from dspark.training.data import HELDOUT_FRACTION

    state = checkpoint_dir(drafter_path) / "trainer_state.json"
    if not state.is_file():
        return None
    config = json.loads(state.read_text()).get("config", {})
    # a run saved before heldout_fraction was a setting trained with the default
    return {"data": config.get("data"), "heldout_fraction": config.get("heldout_fraction", HELDOUT_FRACTION)}


def _same_source(a: str | None, b: str) -> bool:
    """Whether two --data values name the same conversations ("sharegpt", or one file under two spellings)."""
    return a == b or (a is not None and Path(a).exists() and Path(b).exists() and Path(a).resolve() == Path(b).resolve())


def resolve_split(d: DecodeOptions, e: EvalOptions, *, default_split: str = "heldout") -> EvalOptions:
    """`e` with split and heldout_fraction decided: the held-out fraction the drafter was trained with when it was
    trained on this --data (else dspark's default), so its held-out prompts are ones it never saw in training."""
    from dataclasses import replace

    from dspark.training.data import EVAL_SETS, HELDOUT_FRACTION

    if e.heldout_fraction is not None and not 0.0 <= e.heldout_fraction < 1.0:
        raise ConfigError(f"--heldout-fraction must be in [0, 1), got {e.heldout_fraction}")
    split = e.split or default_split
    trained = trained_split(d.drafter_path) if d.drafter_path and d.drafter not in ("ngram", "small-lm") else None
    if (e.split is None and default_split == "heldout" and e.data in EVAL_SETS
            and not (trained is not None and _same_source(trained["data"], e.data))):
        split = "all"  # an evaluation set the drafter never trained on is held out whole
    fraction = e.heldout_fraction
    if trained is not None and _same_source(trained["data"], e.data):
        if fraction is not None and fraction != trained["heldout_fraction"] and split != "all":
            raise ConfigError(f"--heldout-fraction {fraction} differs from the {trained['heldout_fraction']} drafter "
                              f"{d.drafter_path} was trained with on {e.data!r}: its held-out split is that one "
                              "(drop --heldout-fraction)")
        fraction = trained["heldout_fraction"]
    return replace(e, split=split, heldout_fraction=HELDOUT_FRACTION if fraction is None else fraction)


def eval_prompts(host, opts: EvalOptions) -> list[list[int]]:
    """Token ids of up to `limit` prompts of the data split that fit `max_prompt_length` (split and
    heldout_fraction as `resolve_split` decides them); fewer than `limit` with a warning saying so."""
    import warnings

    from dspark.api import encode_prompts
    from dspark.training.data import HELDOUT_FRACTION, load_conversations, prompts

    if opts.offset < 0 or opts.limit < 1:
        raise ConfigError(f"--offset must be >= 0 and --limit >= 1, got {opts.offset} and {opts.limit}")
    split = opts.split or "heldout"
    fraction = HELDOUT_FRACTION if opts.heldout_fraction is None else opts.heldout_fraction
    wanted = opts.offset + opts.limit
    conversations = load_conversations(opts.data, split=split, heldout_fraction=fraction,
                                       limit=max(4 * wanted, wanted + 16), on_error=opts.on_error)
    ids = [p for p in encode_prompts(host, prompts(conversations)) if len(p) <= opts.max_prompt_length]
    where = f"{opts.data!r} ({split} split" + (f", heldout_fraction {fraction})" if split != "all" else ")")
    if len(ids) <= opts.offset:
        raise ValueError(f"no prompt of {where} fits --max-prompt-length {opts.max_prompt_length}"
                         + (f" after skipping {opts.offset}" if opts.offset else ""))
    if len(ids) < wanted:
        # the loader stops at `limit` conversations: short of it, the split itself ran out
        scanned = "" if len(conversations) < max(4 * wanted, wanted + 16) else f" among its first {len(conversations)}"
        warnings.warn(f"{where} has only {len(ids)} prompts that fit --max-prompt-length {opts.max_prompt_length}"
                      + scanned
                      + (f", {len(ids) - opts.offset} after skipping {opts.offset}" if opts.offset else "")
                      + f": using {len(ids) - opts.offset}, not --limit {opts.limit}", stacklevel=2)
    return ids[opts.offset: wanted]


def _drafter_label(d: DecodeOptions) -> str:
    """The drafter's kind for reports: what was loaded, so the checkpoint's config.json kind whenever a checkpoint
    is given (dflash for a DSpark-class checkpoint with no head, even under --drafter dspark), else the flag."""
    if d.drafter_path is None or d.drafter in ("ngram", "small-lm"):
        return d.drafter
    from dspark.api import checkpoint_dir
    from drafters.checkpoint import read_config
    from drafters.dspark import DSparkConfig, variant_name

    config = read_config(checkpoint_dir(d.drafter_path))
    # a DFlash checkpoint is a DSpark-class one with the head off: name it as the drafter names itself
    if config["kind"] == "dspark":
        return variant_name(config["config"].get("head", DSparkConfig.head))
    return config["kind"]


def cmd_eval(argv) -> int:
    from dspark.api import generate
    from dspark.metrics import summarize

    h, d, e, v = parse([HostOptions, DecodeOptions, EvalOptions, ServeOptions], argv, prog="dspark eval")
    e = resolve_split(d, e)
    host = _host(h)
    out = generate(host, prompts=eval_prompts(host, e), progress=not e.json, **_decode_kwargs(d, v))
    # every setting that defines the prompts and the decoding (dspark.metrics.check_pairable: compare pairs only
    # results equal in all of them)
    metrics = {"host": h.host, "drafter": _drafter_label(d), "drafter_path": d.drafter_path, "verifier": d.verifier,
               "threshold": d.threshold, "data": e.data, "split": e.split, "heldout_fraction": e.heldout_fraction,
               "offset": e.offset, "limit": e.limit, "max_prompt_length": e.max_prompt_length,
               "max_new_tokens": d.max_new_tokens, "temperature": d.temperature, "top_p": d.top_p, "top_k": d.top_k,
               "seed": d.seed, "batch_size": d.batch_size, "concurrency": v.concurrency,
               "drafter_dtype": d.drafter_dtype, **summarize(out.result, draft_length=d.draft_length)}
    if e.output:
        Path(e.output).parent.mkdir(parents=True, exist_ok=True)
        Path(e.output).write_text(dumps(metrics, indent=1) + "\n")
    if e.json:
        print(dumps(metrics))
    else:
        lo, hi = metrics["tau_ci95"]
        print(f"tau {metrics['tau']:.3f} [95% {lo:.3f}, {hi:.3f}] over {metrics['request_rounds']} request-rounds "
              f"({metrics['requests']} prompts); verify rate {metrics['verify_rate']:.3f}; "
              f"{metrics['tokens_per_s']:.1f} tok/s")
        print("conditional acceptance per position: "
              + " ".join("nan" if math.isnan(a) else f"{a:.3f}" for a in metrics["conditional_acceptance"]))
    return 0


def _eval_json(path: str) -> dict:
    try:
        metrics = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such eval result (write one with `dspark eval ... --output {path}`)")
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path}: not an eval JSON ({error})") from error
    if not isinstance(metrics, dict) or "tau" not in metrics:
        raise ValueError(f"{path}: not an eval JSON (no 'tau')")
    return metrics


def cmd_compare(argv) -> int:
    """tau of one eval result over others on the same prompts, with a paired bootstrap interval."""
    from dspark.metrics import check_pairable, paired_tau_ratio

    (c,) = parse([CompareOptions], argv, prog="dspark compare")
    run = _eval_json(c.run)
    for other_path in c.against:
        other = _eval_json(other_path)
        try:
            check_pairable(run, other)
        except ValueError as error:  # e.g. "were not decoded the same way: temperature 0.0 vs 1.0"
            raise ValueError(f"{c.run} and {other_path} {error}") from None
        try:
            cmp = paired_tau_ratio(run, other, level=c.level)
        except ValueError as error:
            raise ValueError(f"{c.run} vs {other_path}: {error}") from None
        if c.json:
            print(dumps({"run": c.run, "against": other_path, **cmp}))
        else:
            lo, hi = cmp["ci"]
            print(f"{c.run} / {other_path}: tau {cmp['tau'][0]:.3f} / {cmp['tau'][1]:.3f} = {cmp['ratio']:.3f} "
                  f"[{lo:.3f}, {hi:.3f}] ({c.level:.0%} paired bootstrap over {cmp['requests']} requests); "
                  f"ratio <= 1 in {cmp['p_not_above']:.1%} of resamples")
    return 0


def cmd_profile(argv) -> int:
    from verifiers.calibration import STSCalibrator
    from dspark.api import resolve_drafter
    from verifiers.cost_model import draft_key, export_engine_json, profile, profile_draft

    h, p = parse([HostOptions, ProfileOptions], argv, prog="dspark profile")
    # why first: a bad --calibration must fail before anything is written (no partial outputs)
    sts = STSCalibrator.load(p.calibration).temperatures if p.engine_json and p.calibration else None
    if any(k < 1 for k in p.draft_lengths):
        raise ConfigError(f"--draft-lengths must be >= 1, got {p.draft_lengths}")
    host = _host(h)
    drafter = (resolve_drafter(host, p.drafter, drafter_path=p.drafter_path, dtype=p.drafter_dtype)
               if p.drafter is not None or p.drafter_path is not None else None)
    cost = profile(host, batch_sizes=p.batch_sizes, tokens_per_request=p.tokens_per_request, repeats=p.repeats,
                   warmup=p.warmup, context=p.context, mode=p.mode)
    for K in p.draft_lengths if drafter is not None else ():
        cost.draft[draft_key(drafter, K)] = profile_draft(host, drafter, batch_sizes=p.batch_sizes, draft_length=K,
                                                          repeats=p.repeats, warmup=p.warmup, context=p.context,
                                                          mode=p.mode)
    Path(p.out).parent.mkdir(parents=True, exist_ok=True)
    cost.save(p.out)
    cost.to_csv(Path(p.out).with_suffix(".csv"))
    if p.engine_json:
        export_engine_json(p.engine_json, cost=cost, sts_temperatures=sts)
    if p.sglang_sps_table:
        from verifiers.engine_tables import export_sglang_sps

        export_sglang_sps(p.sglang_sps_table, cost)
    print(f"wrote {p.out} ({cost.mode} steps). Host verify steps per second (SPS) by M, the tokens in one step "
          "(requests x tokens a request): "
          + ", ".join(f"M = {m}: {s:.1f} steps/s ({1000 / s:.2f} ms a step)" for m, s in zip(cost.tokens, cost.sps)))
    for key, entry in cost.draft.items():
        observe = entry.get("observe_seconds", [0.0] * len(entry["seconds"]))
        print(f"  drafter step {key} by R, the requests in the step: "
              + ", ".join(f"R = {r}: propose {1000 * t:.2f} ms, observe {1000 * o:.2f} ms" for r, t, o
                          in zip(entry["batch_sizes"], entry["seconds"], observe)))
    return 0


def cmd_calibrate(argv) -> int:
    from dspark.api import CALIBRATION_FILE, checkpoint_dir, generate
    import torch

    from verifiers.calibration import STSCalibrator, calibration_report, outcomes_from_counts, reliability_diagram

    h, d, e, c, v = parse([HostOptions, DecodeOptions, EvalOptions, CalibrateOptions, ServeOptions], argv,
                          prog="dspark calibrate")
    if d.drafter_path is None:
        raise ConfigError("dspark calibrate needs --drafter-path (the calibration is saved with the drafter)")
    if d.verifier != "full":
        raise ConfigError("calibrate on a verify-all rollout (--verifier full): it reaches every position up to the "
                          "first rejection, which STS needs")
    if not 0.0 <= c.holdout < 1.0:
        raise ConfigError(f"--holdout must be in [0, 1), got {c.holdout}")
    # why train by default: eval scores the held-out prompts and loads this calibration by itself, so fitting on
    # them would judge the calibrated confidences on the very prompts they were fitted on
    e = resolve_split(d, e, default_split="train")
    eval_default = EvalOptions.limit
    if e.split != "train" and e.offset < eval_default:
        import warnings

        warnings.warn(f"fitting on {e.split} prompts {e.offset}..{e.offset + e.limit - 1}, which `dspark eval` also "
                      f"scores (by default its first {eval_default} held-out ones) and then judges with this "
                      f"calibration: use --offset {eval_default} or more (and eval a --limit below it), or the default "
                      "--split train", stacklevel=1)
    host = _host(h)
    out = generate(host, prompts=eval_prompts(host, e), progress=True, **_decode_kwargs(d, v))
    conf = out.result.log.confidences()
    if conf is None:
        raise ValueError(f"drafter {d.drafter_path} gives no confidences (no confidence head): nothing to calibrate")
    accepted, reached = outcomes_from_counts(out.result.log.column("verified"), out.result.log.column("accepted"),
                                             d.draft_length)
    # split by request, not by round: rounds of one response are correlated, so a held-out report needs other prompts
    request = out.result.log.column("request")
    n_requests = len(out.token_ids)
    n_test = int(round(c.holdout * n_requests))
    test = request >= n_requests - n_test if n_test else torch.ones_like(request, dtype=torch.bool)
    fit = ~test if n_test else test
    if not bool(fit.any()) or not bool(test.any()):
        raise ValueError(f"{n_requests} prompt(s) are too few to hold out {c.holdout:.0%}: raise --limit")
    sts = STSCalibrator.fit(conf[fit], accepted[fit], reached[fit])
    target = Path(c.out or checkpoint_dir(d.drafter_path) / CALIBRATION_FILE)
    report = calibration_report(conf[test], accepted[test], reached[test], calibrator=sts)
    sts.save(target)  # after the report is computed: a failing report leaves the drafter's old calibration alone
    report.update(data=e.data, split=e.split, heldout_fraction=e.heldout_fraction, offset=e.offset, limit=e.limit,
                  fit_requests=n_requests - n_test, report_requests=n_test or n_requests,
                  fit_rounds=int(fit.sum()), report_rounds=int(test.sum()),
                  mean_survival_ece={when: _nanmean(report[when]["survival"]["ece"]) for when in ("before", "after")})
    report_path = Path(c.report or target.with_name(target.stem + "_report.json"))
    report_path.write_text(dumps(report, indent=1) + "\n")
    reliability_diagram(report_path.with_suffix(".png"), conf[test], accepted[test], reached[test], calibrator=sts)
    before = report["before"]["survival"]["ece"]
    after = report["after"]["survival"]["ece"]
    where = f"on {n_test} held-out prompts" if n_test else "on the fitting prompts"
    print(f"wrote {target} (temperatures {[round(t, 3) for t in sts.temperatures]}), {report_path} and its PNG")
    print(f"survival ECE per position {where}, before -> after: "
          + " ".join(f"{100 * b:.1f}->{100 * a:.1f}%" for b, a in zip(before, after))
          + f"; mean {100 * report['mean_survival_ece']['before']:.2f}% -> "
            f"{100 * report['mean_survival_ece']['after']:.2f}%")
    return 0


def _nanmean(values: list[float]) -> float:
    kept = [v for v in values if not math.isnan(v)]
    return sum(kept) / len(kept) if kept else float("nan")


def one_drafter_sweep(host, d: DecodeOptions, *, draft_lengths: list[int], concurrency: list[int], engine: str):
    """The dspark.sweep grid of `dspark bench` / `dspark sweep`: plain decoding, and the --drafter / --drafter-path
    drafter (if any) at every draft length under --verifier with its --threshold, --cost-table, --calibration and
    --draft-gate, decoded with --max-new-tokens, --temperature / --top-p / --top-k and --seed."""
    from dspark.api import resolve_drafter
    from dspark.engine.sampling import SamplingConfig
    from dspark.sweep import Drafted, Sweep

    drafter = resolve_drafter(host, None if d.drafter == "none" else d.drafter, drafter_path=d.drafter_path,
                              dtype=d.drafter_dtype)
    drafted = [] if drafter is None else [Drafted(_drafter_label(d), K, drafter, path=d.drafter_path)
                                          for K in draft_lengths]
    return Sweep(drafted=drafted, policies=[d.verifier], concurrency=concurrency, max_new_tokens=d.max_new_tokens,
                 sampling=SamplingConfig(temperature=d.temperature, top_p=d.top_p, top_k=d.top_k), seed=d.seed,
                 engine=engine, threshold=d.threshold, cost_table=d.cost_table, calibration=d.calibration,
                 draft_gate=d.draft_gate)


def cmd_sweep(argv) -> int:
    """dspark.sweep over --draft-lengths and --batch-sizes (static batches) for one drafter against plain decoding,
    on the prompts `dspark eval` decodes (its held-out split, --limit of them)."""
    from dspark.documents import envelope
    from dspark.sweep import NAME, check_settings, run

    h, d, e, s = parse([HostOptions, DecodeOptions, EvalOptions, SweepOptions], argv, prog="dspark sweep")
    check_drafter_flag(d)
    if d.drafter == "none" and not d.drafter_path:
        raise ValueError("dspark sweep compares a drafter with plain decoding: give --drafter or --drafter-path")
    check_settings([d.verifier], batch_sizes=s.batch_sizes, draft_lengths=s.draft_lengths)
    e = resolve_split(d, e)  # the held-out split the drafter was trained with
    host = _host(h)  # as every command loads it: --deterministic switches before the host loads
    sweep = one_drafter_sweep(host, d, draft_lengths=s.draft_lengths, concurrency=s.batch_sizes,
                              engine="static-batch")
    # a host without a tokenizer (random:<shape>) decodes seeded random token ids, as `dspark bench` does
    prompts = eval_prompts(host, e) if host.tokenizer is not None else bench_prompts(host, e.limit)
    run(host, prompts, sweep, out_dir=s.out_dir,
        doc=envelope(NAME, argv=argv, host=host, options=[h, d, e, s], prog="dspark sweep"))
    return 0


def plugin_commands() -> dict:
    """Commands that other installed code registers under the entry-point group `dspark.commands` (this
    repository's `experiments/` registers `experiment` and `report` in pyproject.toml). why entry points: the
    runners sit above the package in the layer order, so the package must not import them; they plug in instead."""
    from importlib.metadata import entry_points

    return {ep.name: ep for ep in entry_points(group="dspark.commands")}


def cmd_export(argv) -> int:
    """A drafter checkpoint in another layout; with its STS calibration, also as SGLang reads it."""
    import shutil

    import torch

    from dspark.api import CALIBRATION_FILE, checkpoint_dir, load_host
    from drafters import load_drafter
    from drafters.checkpoint import read_config
    from drafters.deepspec import export_deepspec
    from verifiers.calibration import STSCalibrator
    from verifiers.engine_tables import export_sglang_sts

    (x,) = parse([ExportOptions], argv, prog="dspark export")
    source = checkpoint_dir(x.drafter_path)
    host_name = x.host or read_config(source)["host"]["name"]
    if host_name is None:
        raise ConfigError(f"{source} records no host: pass --host")
    host = load_host(host_name, dtype="float32", device=x.device)
    drafter = load_drafter(source, host)
    out = export_deepspec(drafter, host, x.output, mask_token_id=x.mask_token_id,
                          dtype={"float32": torch.float32, "bfloat16": torch.bfloat16}[x.dtype])
    written = [out / "config.json"]
    calibration = source / CALIBRATION_FILE
    if calibration.is_file():  # evaluating the export here picks it up; SGLang reads the second
        shutil.copyfile(calibration, out / CALIBRATION_FILE)
        export_sglang_sts(out / "sglang_sts.json", STSCalibrator.load(calibration), dataset=str(source))
        written += [out / CALIBRATION_FILE, out / "sglang_sts.json"]
    print(f"wrote {out} ({drafter.name} for host {host_name!r}, DeepSpec layout): " + ", ".join(p.name for p in written)
          + " and the weights")
    return 0


def bench_prompts(host, n: int, source: EvalOptions | None = None) -> list[list[int]]:
    """n prompts: without a source the built-in six MT-Bench first turns (chat-templated) for a host with a
    tokenizer, else seeded random token ids, repeated to n; with one (split resolved), the prompts `dspark eval`
    would decode (eval_prompts, source.limit of them)."""
    import torch

    from dspark.api import encode_prompts
    from dspark.engine.workload import PROMPTS

    if source is not None:
        if host.tokenizer is None:
            raise ConfigError(f"--data {source.data} needs a host with a tokenizer ({host.name} has none): use "
                              "--data mtbench")
        return eval_prompts(host, source)
    if host.tokenizer is not None:
        ids = encode_prompts(host, PROMPTS, chat=True)
    else:
        g = torch.Generator().manual_seed(0)
        ids = [torch.randint(0, host.vocab_size, (8 + 5 * i,), generator=g).tolist() for i in range(6)]
    return [ids[i % len(ids)] for i in range(n)]


def cmd_bench(argv) -> int:
    """dspark.sweep at --concurrency (C in flight) for plain decoding and at most one drafter at --draft-length."""
    from dspark.documents import envelope
    from dspark.sweep import NAME, run

    h, d, b = parse([HostOptions, DecodeOptions, BenchOptions], argv, prog="dspark bench")
    check_drafter_flag(d)
    if b.num_prompts < 1 or any(c < 1 for c in b.concurrency):
        raise ConfigError("--num-prompts and every --concurrency must be >= 1")
    host = _host(h)
    source = None if b.data == "mtbench" else resolve_split(d, EvalOptions(
        data=b.data, limit=b.num_prompts, max_prompt_length=b.max_prompt_length))  # the split `dspark eval` uses
    prompts = bench_prompts(host, b.num_prompts, source)
    sweep = one_drafter_sweep(host, d, draft_lengths=[d.draft_length], concurrency=b.concurrency,
                              engine="continuous")
    run(host, prompts, sweep, out_dir=b.out_dir,
        doc=envelope(NAME, argv=argv, host=host, options=[h, d, b], prog="dspark bench"))
    return 0


def cmd_train(argv) -> int:
    from dspark.training.train import main_train

    main_train(argv)
    return 0


def cmd_regenerate(argv) -> int:
    from dspark.training.regenerate import main_regenerate

    main_regenerate(argv)
    return 0


def cmd_quickstart(argv) -> int:
    from dspark.quickstart import main_quickstart

    main_quickstart(argv)
    return 0


USAGE = ("usage: dspark <command> [--flag value ...]    (dspark <command> --help lists that command's flags)\n\n"
         "dspark: speculative decoding with DSpark, DFlash, EAGLE-3, MTP and n-gram drafters on a frozen host: "
         "train a drafter, decode, evaluate, and measure where speculation pays.\n\ncommands:\n"
         + __doc__.split("\n\n", 1)[1].rstrip())

COMMANDS = {"quickstart": cmd_quickstart, "generate": cmd_generate, "eval": cmd_eval, "train": cmd_train,
            "regenerate": cmd_regenerate, "profile": cmd_profile, "calibrate": cmd_calibrate, "sweep": cmd_sweep,
            "bench": cmd_bench, "compare": cmd_compare, "export": cmd_export}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] == "--version":
        from dspark import __version__

        print(__version__)
        return 0
    command, rest = argv[0], argv[1:]
    plugins = plugin_commands()
    if command not in COMMANDS and command not in plugins:
        hint = ("; the experiment commands register at install time (pip install -e .), or run `python -m "
                "experiments` from the repository" if command in ("experiment", "report") else "")
        print(f"dspark: unknown command {command!r}; commands: {', '.join([*COMMANDS, *plugins])}{hint}",
              file=sys.stderr)
        return 2
    from dspark.engine.runtime import tune_cpu_allocator

    tune_cpu_allocator()  # CPU training steps 1.26x faster on glibc (benchmarks/cpu_allocator.py)
    try:
        return COMMANDS[command](rest) if command in COMMANDS else plugins[command].load()(rest)
    except (ConfigError, ValueError, FileNotFoundError, ModuleNotFoundError) as error:
        # clear one-line errors for bad input and for a data set's missing package (its message says what to pip
        # install); set DSPARK_TRACEBACK=1 to see the stack
        import os

        if os.environ.get("DSPARK_TRACEBACK"):
            raise
        print(f"dspark {command}: error: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
