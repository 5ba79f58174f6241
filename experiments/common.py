"""What the experiment runners share: options, prompts per domain, and drafters by name (with NAME@N checkpoints
per draft length). The decoding itself, the rows and the result files live in the package: dspark.sweep (the
throughput-against-concurrency tool, its rows and policies), dspark.engine.workload (the decode backends:
"continuous" keeps C requests in flight on the slot engine, "static-batch" runs static batches of C; every row
records which one measured it, `"engine"`), dspark.documents (NAME.json / NAME.md / PNGs).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch

from dspark.engine.sampling import SamplingConfig

#: what a domain name means when no `--domains` mapping is given (docs/DSPARK.md's chat / code / math split). Math is
#: CHAMP's 270 problems from the `champ-dataset` wheel (the `math` extra, installed by scripts/bootstrap.sh); without
#: it a host with a tokenizer stops with "pip install champ-dataset" (or pass --domains without math).
DEFAULT_DOMAINS = {"chat": "sharegpt", "code": "humaneval", "math": "champ"}


@dataclass
class RunOptions:
    """Options shared by the runners that decode (each runner adds its own dataclass)."""

    num_prompts: int = field(default=16, metadata={"help": "prompts per decode (per domain where there are domains)"})
    max_new_tokens: int = field(default=64, metadata={"help": "new tokens per request at most"})
    temperature: float = field(default=0.0, metadata={"help": "0 = greedy"})
    seed: int = field(default=0, metadata={"help": "request i is seeded with seed + i (same for every setting)"})
    drafter_paths: dict[str, str] = field(default_factory=dict, metadata={
        "help": "NAME=DIR checkpoints per drafter name (NAME@N=DIR: the one used at draft length N); a drafter "
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


# ---- drafters ----------------------------------------------------------------------------------------------------
def drafter_path(paths: dict[str, str], name: str, draft_length: int | None = None) -> str | None:
    """The checkpoint for `name` evaluated at `draft_length`: NAME@N when given, else NAME, else None."""
    unknown = [k for k in paths if k.partition("@")[0] == ""]
    if unknown:
        raise ValueError(f"--drafter-paths keys are NAME or NAME@N (N a draft length), got {unknown}")
    if draft_length is not None and f"{name}@{draft_length}" in paths:
        return paths[f"{name}@{draft_length}"]
    return paths.get(name)


def build_drafters(host, names: list[str], paths: dict[str, str], draft_lengths: list[int]) -> dict:
    """{(name, draft_length): drafter} for every listed drafter and draft length; one object per distinct
    checkpoint. Without a checkpoint DSpark / DFlash get random weights with a block of max(draft_lengths), so
    every draft length is valid."""
    from dspark.api import resolve_drafter

    if not names:
        raise ValueError("list at least one drafter (plain decoding is always measured)")
    for name in names:
        if name in ("none", "plain"):
            raise ValueError("plain decoding is always measured; list only drafters")
    built: dict = {}
    out = {}
    for name in names:
        for K in draft_lengths:
            path = drafter_path(paths, name, K)
            if (name, path) not in built:
                overrides = {"block_size": max(draft_lengths)} if path is None and name in ("dspark", "dflash") else {}
                built[name, path] = resolve_drafter(host, name, drafter_path=path, **overrides)
            out[name, K] = built[name, path]
    return out


def sampling_config(temperature: float) -> SamplingConfig:
    return SamplingConfig(temperature=temperature)
