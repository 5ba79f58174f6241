"""Self-distillation data (docs/DSPARK.md §3): the host answers the prompts of a chat dataset itself.

Each conversation's prompt (its system turns and first user turn, `dspark.training.data.prompts`) is rendered with the
host's chat template and decoded by `dspark.engine.decode.generate` in batches. Every batch is appended to the output
JSONL, one line per prompt, flushed and fsynced:

    {"id": "<conversation id>", "conversations": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}

which `dspark.training.data.load_conversations("out.jsonl")` (and so `dspark train --data out.jsonl`) reads back.

Resumable: a restart skips the ids already in the output file and drops a last line cut by a kill, so no work is
lost or duplicated. Request i's sampling noise is keyed by a hash of (seed, id) and the decode loop's draws do not
depend on batch companions, so a resumed file holds the same responses as an uninterrupted one.

    dspark regenerate --host smollm2 --data sharegpt --output data/sharegpt_smollm2.jsonl --max-new-tokens 512
    dspark regenerate --config regen.yaml --temperature 0.7 --top-p 0.95
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional

from tqdm.auto import tqdm

from dspark.config import parse
from dspark.engine.decode import generate
from dspark.engine.host import Host
from dspark.engine.models import load_host, render_chat
from dspark.engine.runtime import tune_cpu_allocator
from dspark.engine.sampling import SamplingConfig
from dspark.training.data import load_conversations, prompts

logger = logging.getLogger(__name__)


@dataclass
class RegenerateConfig:
    """Everything `dspark regenerate` accepts; each field is a flag and a YAML key."""

    output: str = field(metadata={"help": "output JSONL file (appended to; existing ids are skipped)"})
    host: str = field(default="smollm2", metadata={
        "help": "host model: smollm2, qwen2.5-coder-1.5b, qwen2.5-coder-0.5b, a path or hub id"})
    data: str = field(default="sharegpt", metadata={
        "help": "conversations to take prompts from (see dspark.training.data)"})
    split: Literal["train", "heldout", "all"] = field(default="train", metadata={"help": "which split's prompts"})
    limit: Optional[int] = field(default=None, metadata={"help": "use at most this many conversations"})
    on_error: Literal["skip", "raise"] = field(default="skip", metadata={
        "help": "malformed data records: skip them (each logged as file:line) or raise at the first (file:line)"})
    max_prompt_length: int = field(default=1024, metadata={"help": "skip prompts longer than this many tokens"})
    max_new_tokens: int = field(default=512, metadata={"help": "response length cap"})
    temperature: float = field(default=1.0, metadata={"help": "sampling temperature (0 = greedy)"})
    top_p: float = field(default=1.0, metadata={"help": "nucleus sampling mass (1 = off)"})
    top_k: int = field(default=0, metadata={"help": "top-k sampling (0 = off)"})
    seed: int = field(default=0, metadata={"help": "sampling seed, combined with each conversation id"})
    batch_size: int = field(default=16, metadata={"help": "prompts decoded together (and written per batch)"})
    device: str = field(default="auto", metadata={"help": "auto (cuda if available), cpu, cuda, cuda:1, ..."})
    dtype: str = field(default="auto", metadata={"help": "auto (bf16 on GPU, fp32 on CPU), float32, bfloat16, float16"})

    def __post_init__(self) -> None:
        for name in ("max_prompt_length", "max_new_tokens", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        SamplingConfig(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)  # validates


def request_seed(seed: int, conversation_id: str) -> int:
    """A non-negative int63 seed per (seed, id), stable across runs, batches and machines."""
    digest = hashlib.sha256(f"{seed}\0{conversation_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def completed_ids(path: Path) -> set[str]:
    """Ids already in the output file. A last line cut by a kill (no final newline) is cut off the file; a
    complete line that is not a JSON record is an error (the file was not written by this tool)."""
    if not path.exists():
        return set()
    data = path.read_bytes()
    done: set[str] = set()
    position = 0
    while position < len(data):
        newline = data.find(b"\n", position)
        if newline < 0:  # why drop even if it parses: it may be cut anywhere, and it is redone identically
            logger.warning("%s: dropping a truncated last line (%d bytes) left by an interrupted run", path,
                           len(data) - position)
            with path.open("r+b") as fh:
                fh.truncate(position)
            break
        line = data[position:newline]
        if line.strip():
            try:
                done.add(str(json.loads(line)["id"]))
            except (json.JSONDecodeError, KeyError, TypeError) as error:
                number = data.count(b"\n", 0, position) + 1
                raise ValueError(f"{path}:{number} is not a regenerated record ({error}); refusing to append to "
                                 "it") from None
        position = newline + 1
    return done


def load_chat_host(name: str, device: str, dtype: str = "auto") -> Host:
    """The host for regeneration (dtype "auto": bf16 on CUDA, fp32 elsewhere); it must have a tokenizer."""
    host = load_host(name, device=device, dtype=dtype)
    if host.tokenizer is None:
        raise ValueError(f"host {name!r} has no tokenizer: regeneration renders chat prompts and decodes text")
    return host


def regenerate(cfg: RegenerateConfig, host: Host | None = None) -> Path:
    """Write (or complete) cfg.output with the host's responses to the dataset's prompts; returns its path."""
    host = host or load_chat_host(cfg.host, cfg.device, cfg.dtype)
    tokenizer = host.tokenizer
    output = Path(cfg.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    done = completed_ids(output)

    conversations = load_conversations(cfg.data, split=cfg.split, limit=cfg.limit, on_error=cfg.on_error)
    todo, seen, too_long = [], set(done), 0
    for conversation, messages in zip(conversations, prompts(conversations)):
        if conversation.id in seen:  # done before, or a repeated id in the source: first occurrence wins
            continue
        seen.add(conversation.id)
        ids = tokenizer(render_chat(tokenizer, messages, add_generation_prompt=True), add_special_tokens=False)
        ids = ids["input_ids"]  # the template writes bos itself, exactly as dspark.training.data.tokenize_chat renders
        if len(ids) > cfg.max_prompt_length or len(ids) + cfg.max_new_tokens > host.max_context:
            too_long += 1
            continue
        todo.append((conversation.id, messages, ids))
    logger.info("%s: %d prompts to answer (%d already in %s, %d skipped as longer than %d tokens)", cfg.data,
                len(todo), len(done), output, too_long, cfg.max_prompt_length)

    sampling = SamplingConfig(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k)
    stops = host.stop_token_ids
    bar = tqdm(total=len(todo), desc="regenerate", unit="prompt")
    with output.open("ab") as fh:
        for lo in range(0, len(todo), cfg.batch_size):
            batch = todo[lo : lo + cfg.batch_size]
            result = generate(host, [ids for _, _, ids in batch], max_new_tokens=cfg.max_new_tokens,
                              sampling=sampling, seeds=[request_seed(cfg.seed, cid) for cid, _, _ in batch],
                              stop_token_ids=stops)
            lines = []
            for (cid, messages, _), new in zip(batch, result.token_ids):
                if new and new[-1] in stops:
                    new = new[:-1]  # the end-of-turn token is the template's to write, not the content's
                text = tokenizer.decode(new, skip_special_tokens=False)
                record = {"id": cid, "conversations": messages + [{"role": "assistant", "content": text}]}
                lines.append(json.dumps(record, ensure_ascii=False) + "\n")
            # why one write, flush and fsync per batch: a kill loses at most this batch and cuts at most the
            # last line, which the next run drops
            fh.write("".join(lines).encode("utf-8"))
            fh.flush()
            os.fsync(fh.fileno())
            bar.update(len(batch))
    bar.close()
    return output


def main_regenerate(argv: list[str] | None = None) -> Path:
    """`dspark regenerate ...`: parse flags / --config YAML into RegenerateConfig and run."""
    (cfg,) = parse([RegenerateConfig], argv, prog="dspark regenerate", description=__doc__.split("\n\n")[0])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    path = regenerate(cfg)
    print(path)
    return path


if __name__ == "__main__":

    tune_cpu_allocator()  # as the `dspark` command does
    main_regenerate(sys.argv[1:])
