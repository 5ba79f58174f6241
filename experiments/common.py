"""What every experiment runner shares: options, prompts per domain, drafters and policies by name, the decode
backend, one result row per decode, and writing `NAME.json` / `NAME.md` / PNGs into an output directory.

The decode backend is one function, `DECODE_BACKENDS[name](host, prompts, *, drafter, verifier, draft_length,
concurrency, max_new_tokens, sampling, seed) -> GenerationResult`: "continuous" keeps C requests in flight on the
slot engine (`generate(concurrency=C)`: a queued request enters as soon as one stops); "static-batch" runs the
prompts in successive static batches of C (`batch_size = C`: a batch's finished requests are not replaced, so the
load falls inside a batch). Every row records which engine measured it (`"engine"`).
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from dspark.engine.decode import generate
from dspark.engine.results import GenerationResult
from dspark.engine.sampling import SamplingConfig
from dspark.metrics import summarize

#: what a domain name means when no `--domains` mapping is given (DSPARK.md's chat / code / math split). Math is
#: CHAMP's 270 problems from the `champ-dataset` wheel (the `math` extra, installed by scripts/bootstrap.sh); without
#: it a host with a tokenizer stops with "pip install champ-dataset" (or pass --domains without math).
DEFAULT_DOMAINS = {"chat": "sharegpt", "code": "humaneval", "math": "champ"}
#: row keys copied from dspark.metrics.summarize (per-position lists included)
ROW_METRICS = ("tau", "tau_ci95", "accepted_per_round", "proposed_per_round", "verified_per_round", "verify_rate",
               "verified_token_savings", "tokens_per_s", "requests", "new_tokens", "request_rounds", "seconds",
               "mean_batch", "conditional_acceptance", "prefix_survival", "rows_verifying_k")


@dataclass
class RunOptions:
    """Options shared by the runners that decode (each runner adds its own dataclass)."""

    num_prompts: int = field(default=16, metadata={"help": "prompts per decode (per domain where there are domains)"})
    max_new_tokens: int = field(default=64, metadata={"help": "new tokens per request at most"})
    temperature: float = field(default=0.0, metadata={"help": "0 = greedy"})
    seed: int = field(default=0, metadata={"help": "request i is seeded with seed + i (same for every setting)"})
    drafter_paths: dict[str, str] = field(default_factory=dict, metadata={
        "help": "NAME=DIR checkpoints per drafter name (NAME@GAMMA=DIR: the one trained at that gamma); a drafter "
                "without one gets random weights (a warning)"})
    max_prompt_length: int = field(default=512, metadata={"help": "skip prompts longer than this many tokens"})
    out_dir: str = field(default="results", metadata={"help": "directory for NAME.json, NAME.md and the PNGs"})


# ---- prompts ----------------------------------------------------------------------------------------------------
def random_prompts(n: int, vocab: int, *, key: str, seed: int) -> list[list[int]]:
    """n seeded token-id prompts of 8..32 tokens for hosts without a tokenizer; each repeats its first half, so the
    n-gram drafter has something to find. `key` (e.g. the domain) gives each source its own prompts."""
    digest = int(hashlib.sha256(f"{key}:{seed}".encode()).hexdigest()[:8], 16)
    g = torch.Generator().manual_seed(digest)
    out = []
    for _ in range(n):
        length = int(torch.randint(8, 33, (1,), generator=g))
        half = torch.randint(0, vocab, ((length + 1) // 2,), generator=g).tolist()
        out.append((half + half)[:length])
    return out


def load_prompts(host, source: str, n: int, *, seed: int = 0, max_prompt_length: int = 512) -> list[list[int]]:
    """Token ids of n prompts from `source` (sharegpt, humaneval, champ, a .jsonl file, ...), or random ids when the
    host has no tokenizer (random hosts). ShareGPT, the training source, gives its held-out split; the eval-only
    sets (humaneval, champ) and files all their prompts."""
    if n < 1:
        raise ValueError(f"need at least one prompt, got num_prompts={n}")
    if host.tokenizer is None:
        return random_prompts(n, host.vocab_size, key=source, seed=seed)
    from dspark.cli import EvalOptions, eval_prompts

    split = "heldout" if source == "sharegpt" else "all"
    ids = eval_prompts(host, EvalOptions(data=source, split=split, limit=n, max_prompt_length=max_prompt_length))
    if len(ids) < n:
        raise ValueError(f"{source!r} ({split}) has only {len(ids)} prompts within {max_prompt_length} tokens; "
                         f"asked for {n}")
    return ids


def parse_domains(domains: dict[str, str]) -> dict[str, str]:
    """Domain name -> data source; an empty mapping means DEFAULT_DOMAINS."""
    return dict(domains) if domains else dict(DEFAULT_DOMAINS)


# ---- drafters and policies --------------------------------------------------------------------------------------
def drafter_path(paths: dict[str, str], name: str, gamma: int | None = None) -> str | None:
    """The checkpoint for `name` evaluated at `gamma`: NAME@GAMMA when given, else NAME, else None."""
    unknown = [k for k in paths if k.partition("@")[0] == ""]
    if unknown:
        raise ValueError(f"--drafter-paths keys are NAME or NAME@GAMMA, got {unknown}")
    if gamma is not None and f"{name}@{gamma}" in paths:
        return paths[f"{name}@{gamma}"]
    return paths.get(name)


def build_drafters(host, names: list[str], paths: dict[str, str], draft_lengths: list[int]) -> dict:
    """{(name, gamma): drafter} for every listed drafter and gamma; one object per distinct checkpoint. Without a
    checkpoint DSpark / DFlash get random weights with a block of max(draft_lengths), so every gamma is valid."""
    from dspark.api import resolve_drafter

    if not names:
        raise ValueError("list at least one drafter (plain decoding is always measured)")
    for name in names:
        if name in ("none", "plain"):
            raise ValueError("plain decoding is always measured; list only drafters")
    built: dict = {}
    out = {}
    for name in names:
        for gamma in draft_lengths:
            path = drafter_path(paths, name, gamma)
            if (name, path) not in built:
                overrides = {"gamma": max(draft_lengths)} if path is None and name in ("dspark", "dflash") else {}
                built[name, path] = resolve_drafter(host, name, drafter_path=path, **overrides)
            out[name, gamma] = built[name, path]
    return out


def trained_length(drafter) -> int | None:
    """The block size a drafter was trained at (DSpark / DFlash gamma, EAGLE-3 ttt_length); None if it has none."""
    from drafters import DSparkDrafter, Eagle3Drafter

    if isinstance(drafter, DSparkDrafter):
        return drafter.config.block_size
    if isinstance(drafter, Eagle3Drafter):
        return drafter.config.ttt_length
    return None


POLICIES = ("full", "threshold", "scheduler", "lagged")


def check_settings(policies: list[str], **values: list[int]) -> None:
    """Refuse unknown policy names and empty or non-positive lists (concurrency, draft lengths) before any decoding,
    naming the option as the CLI spells it."""
    bad = [p for p in policies if p not in POLICIES]
    if bad:
        raise ValueError(f"unknown policies {bad}; choose from {list(POLICIES)}")
    for name, vals in values.items():
        if not vals or min(vals) < 1:
            raise ValueError(f"--{name.replace('_', '-')} needs values >= 1, got {vals}")


def build_policy(host, policy: str, *, draft_length: int, path: str | None, threshold: float | None = None,
                 cost=None):
    """The verifier for a policy name (full, threshold, scheduler, lagged) at this gamma, with the drafter
    checkpoint's STS calibration when it has one (the threshold is on cumulative survival a_k)."""
    from dspark.api import resolve_verifier
    from verifiers import policy_options

    return resolve_verifier(host, policy, draft_length=draft_length, drafter_path=path,
                            **policy_options(policy, threshold=threshold, cost_table=cost))


def workload_context(prompts: list[list[int]], max_new_tokens: int) -> int:
    """The cached positions per request that a cost table should be timed at for these prompts: the longest prompt
    plus the new tokens, the cache the slot engine allocates for them (its CUDA-graph rounds attend that whole
    cache, so at large C its reads, not the verify width, set a round's cost)."""
    return max((len(p) for p in prompts), default=0) + max_new_tokens


def cost_table(host, path: str | None, *, concurrency: list[int], draft_lengths: list[int], out_dir: Path,
               context: int, drafters: dict | None = None):
    """The SPS(M) table: loaded from `path`, else profiled now on this host at `context` cached positions per
    request (the runners pass `workload_context`); plus the draft cost of every (name, gamma) drafter of
    `drafters` it lacks (the schedulers' draft gate prices it). Saved as OUT_DIR/cost.json (a loaded `path` is
    never rewritten). why the context matters: a table timed at 32 positions priced SmolLM2's rounds at C = 512 on
    the H200 as if the cache were free, and the scheduler verified drafts that cost more than they bought."""
    from verifiers.cost_model import CostModel, draft_key, profile, profile_draft

    sizes = sorted(set(concurrency))
    if path:
        cost = CostModel.load(path, expect_host=host.name, expect_device=host.device)
    else:
        tokens = sorted({1, 2, 4, 8} | {g + 1 for g in draft_lengths})
        cost = profile(host, batch_sizes=sizes, tokens_per_request=tokens, repeats=3, warmup=1, context=context)
    for (name, gamma), drafter in (drafters or {}).items():
        trained = trained_length(drafter)
        if draft_key(drafter, gamma) in cost.draft or (name in ("dspark", "dflash") and trained is not None
                                                       and gamma > trained):
            continue
        cost.draft[draft_key(drafter, gamma)] = profile_draft(host, drafter, batch_sizes=sizes, draft_length=gamma,
                                                              context=context, repeats=3, warmup=1)
    out_dir.mkdir(parents=True, exist_ok=True)
    cost.save(out_dir / "cost.json")
    return cost


# ---- the decode backend -----------------------------------------------------------------------------------------
def static_batch_decode(host, prompts, *, drafter, verifier, draft_length: int, concurrency: int,
                        max_new_tokens: int, sampling: SamplingConfig, seed: int,
                        timing: bool = False) -> GenerationResult:
    """Static batches of `concurrency` requests through dspark.engine.decode.generate: each batch is admitted at once
    and a request that stops early is not replaced (not continuous batching). `timing`: generate's stage split."""
    return generate(host, prompts, drafter=drafter, verifier=verifier, draft_length=draft_length,
                    max_new_tokens=max_new_tokens, sampling=sampling, seed=seed, batch_size=concurrency,
                    timing=timing)


def continuous_decode(host, prompts, *, drafter, verifier, draft_length: int, concurrency: int,
                      max_new_tokens: int, sampling: SamplingConfig, seed: int,
                      timing: bool = False) -> GenerationResult:
    """Closed loop on the slot engine: `concurrency` requests in flight, a queued one entering as soon as one stops
    (continuous batching, as serving benchmarks run with a maximum concurrency)."""
    return generate(host, prompts, drafter=drafter, verifier=verifier, draft_length=draft_length,
                    max_new_tokens=max_new_tokens, sampling=sampling, seed=seed, concurrency=concurrency,
                    timing=timing)


#: engine name -> decode function
DECODE_BACKENDS: dict[str, Callable[..., GenerationResult]] = {"continuous": continuous_decode,
                                                               "static-batch": static_batch_decode}


def backend(name: str) -> Callable[..., GenerationResult]:
    if name not in DECODE_BACKENDS:
        raise ValueError(f"unknown engine {name!r}; choose one of {sorted(DECODE_BACKENDS)}")
    return DECODE_BACKENDS[name]


def result_row(result: GenerationResult, *, draft_length: int, **labels) -> dict:
    """One JSON row: the labels, then summarize()'s metrics (ROW_METRICS) with per_request_tokens_per_s, and where
    the slot engine decoded it, `engine_stats` (engine_stats)."""
    m = summarize(result, draft_length=draft_length)
    row = {**labels, "draft_length": draft_length, **{k: m[k] for k in ROW_METRICS},
           "per_request_tokens_per_s": m["tokens_per_s_per_request"]}
    if result.engine:
        row["engine_stats"] = engine_stats(result)
    return row


def engine_stats(result: GenerationResult) -> dict:
    """Where a slot-engine decode's seconds went, for reading a row's speed: rounds and how many ran the drafter
    (the others were plain rounds of a draft gate), the mean verify width (tokens per slot per forward), the
    seconds the CPU waited on the device's copies (the rest of the wall time is its own work: launches, commits,
    admissions), admissions and their launch seconds, graphs captured and the warm-up left out of `seconds`, the
    garbage collections inside the loop and their seconds, and, when decoded with `timing`, the device seconds of
    each round stage (stage_s)."""
    e = result.engine
    widths = e.get("widths") or []
    return {"rounds": result.rounds, "drafted_rounds": e.get("drafted_rounds"),
            "mean_width": sum(widths) / len(widths) if widths else None,
            "wait_s": e.get("wait_s"), "admissions": e.get("admissions"), "admit_s": e.get("admit_s"),
            "graphs": e.get("graphs"), "warmup_s": e.get("warmup_s"), "overlapped": e.get("overlapped"),
            "gc_s": e.get("gc_s"), "gc_collections": e.get("gc_collections"), "stage_s": e.get("stage_s") or None}


# ---- outputs ----------------------------------------------------------------------------------------------------
@dataclass
class Section:
    """What a runner renders from its JSON: markdown (tables, notes) and the PNG files it wrote."""

    title: str
    markdown: str
    images: list[Path]


def envelope(name: str, *, argv, host, options: list) -> dict:
    """The header of every result JSON: experiment, command, environment, host and the options used."""
    from dspark.config import to_dict
    from dspark.quickstart import environment

    settings = {}
    for opts in options:
        settings.update(to_dict(opts))
    return {"experiment": name, "command": f"dspark experiment {name} " + " ".join(argv or []),
            "environment": environment(torch.device(host.device)), "host": host.name, "settings": settings}


def write_result(doc: dict, out_dir: str | Path, render: Callable[[dict, Path], Section]) -> Path:
    """Write OUT_DIR/NAME.json, the PNGs and OUT_DIR/NAME.md (from `render`); returns the JSON path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{doc['experiment']}.json"
    path.write_text(json.dumps(doc, indent=1, allow_nan=True) + "\n")
    section = render(doc, out)
    (out / f"{doc['experiment']}.md").write_text(section_markdown(doc, section, out))
    return path


def section_markdown(doc: dict, section: Section, relative_to: Path, *, level: int = 1) -> str:
    env = doc.get("environment", {})
    where = env.get("gpu") or env.get("processor", "")
    head = (f"{'#' * level} {section.title}\n\n`{doc.get('command', '')}` — {env.get('date', '')}, {where}, "
            f"torch {env.get('torch', '')}, host `{doc.get('host', '')}`\n\n")
    images = "".join(f"\n![{p.stem}]({p.relative_to(relative_to) if p.is_relative_to(relative_to) else p})\n"
                     for p in section.images)
    return head + section.markdown + "\n" + images


def fmt_list(values: list[float]) -> str:
    """A short text form of a per-position list."""
    return " ".join("nan" if isinstance(v, float) and math.isnan(v) else f"{v:.2f}" for v in values)


def figure(width: float = 6.0, height: float = 4.0, ncols: int = 1, nrows: int = 1):
    """A matplotlib Figure without pyplot (Agg, leaves the process-wide backend alone) and its axes array."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    return fig, fig.subplots(nrows, ncols, squeeze=False)


def plot_log_x(ax, values: list[int]) -> None:
    """A log-2 x axis labelled with the measured values (concurrency)."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(values, [str(v) for v in values])


def sampling_config(temperature: float) -> SamplingConfig:
    return SamplingConfig(temperature=temperature)


def is_plain(row: dict) -> bool:
    """Plain decoding's row: "plain", or "plain@<trace>" where a replay prices plain decoding per trace."""
    return row["method"] == "plain" or row["method"].startswith("plain@")


def setting_key(row: dict) -> str:
    """A setting's name across concurrencies: method/policy/gamma (plain decoding: its method, "plain" or
    "plain@<trace>")."""
    if is_plain(row):
        return row["method"]
    return f"{row['method']}/{row['policy']}/γ{row['draft_length']}"
