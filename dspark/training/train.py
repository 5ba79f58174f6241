"""One training loop for every trainable drafter (DSPARK.md §3): the host is frozen and runs online in the step.

Shapes: B sequences per micro-batch, T tokens, V vocabulary, F concatenated host features, K draft positions.

Each micro-batch: the host runs once over the packed batch (taps = drafter.feature_layers) under no_grad, giving
features (B, T, F) and host_logits (B, T, V); the drafter turns a `TrainBatch` into a `TrainOutput`
(loss, loss parts, per-position teacher-forced acceptance). No feature cache on disk.

    dspark train --host smollm2 --drafter dspark --data sharegpt --output runs/dspark --max-steps 2000
    dspark train --config run.yaml --report-to wandb            # YAML keys = the TrainConfig fields below
    accelerate launch -m dspark.cli train --host smollm2 --drafter dflash --data regen.jsonl --output runs/df

Multi-GPU: `accelerate launch` starts one process per GPU; the drafter is wrapped in DDP, the frozen host is
replicated on every GPU and never wrapped. Each process takes its own rows of every global batch.

Checkpoints, OUTPUT/checkpoint-<step:08d>/ (written into OUTPUT/.tmp-checkpoint-<step>, fsynced, then renamed, so a
kill -9 mid-write leaves the earlier checkpoints intact; only complete checkpoints carry the final name):
    <the drafter's save_pretrained files>     loadable with `drafters.load_drafter(path, host)`
    trainer_state.json      step, epoch, micro-batches consumed, world size, config, python RNG state
    rng-<rank>.safetensors  torch CPU (and CUDA) RNG states of each process, uint8 tensors
    optimizer.safetensors   every tensor of the optimizer state_dict, keys "state.<param index>.<name>"
    optimizer.json          the rest of the optimizer state_dict (param groups, non-tensor state)
    scheduler.json          the LR scheduler state_dict
No pickle anywhere (torch.save is pickle). Resume (`--resume`, or automatically when OUTPUT has a checkpoint)
restores all of it and skips the consumed micro-batches of the same seeded data order, so an fp32 CPU run
resumed from step k logs the same losses as an uninterrupted one.

OUTPUT also holds metrics.jsonl (one record per optimizer step and per evaluation), config.yaml and, at the end,
training_curve.png.
"""
from __future__ import annotations

import json
import logging
import math
import os
import random
import resource
import shutil
import sys
import time
import warnings
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

import torch
import yaml
from accelerate import Accelerator
from accelerate.utils import is_tensorboard_available, is_wandb_available
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from drafters.base import TrainBatch, TrainOutput
from dspark.config import from_dict, parse, to_dict
from dspark.engine.host import Host
from dspark.training.data import TokenizedChat, collate, load_conversations, pack, tokenize_conversations

logger = logging.getLogger(__name__)

DRAFTERS = ("dspark", "dflash", "eagle3", "mtp")
CHECKPOINT_PREFIX = "checkpoint-"
# settings that fix the data order, the model or the optimisation path: a resumed run must not change them
_RESUME_FIXED = ("host", "drafter", "drafter_args", "data", "data_limit", "max_length", "seq_len", "batch_size",
                 "grad_accum", "seed", "lr", "weight_decay", "warmup_ratio", "max_grad_norm")


@dataclass
class TrainConfig:
    """Everything `dspark train` accepts; each field is a flag (`--max-steps`) and a YAML key (`max_steps`)."""

    output: str = field(metadata={"help": "output directory: checkpoints, metrics.jsonl, training curve"})
    host: str = field(default="smollm2", metadata={"help": "host model: smollm2, random:<shape>, a path or hub id"})
    drafter: Literal["dspark", "dflash", "eagle3", "mtp"] = field(default="dspark", metadata={"help": "drafter kind"})
    drafter_args: dict[str, Any] = field(default_factory=dict, metadata={
        "help": "drafter overrides passed to build_drafter, e.g. --drafter-args num_layers=3 gamma=7 head=rnn"})
    data: str = field(default="sharegpt", metadata={
        "help": "conversations: sharegpt, humaneval, a .jsonl[.gz] file, a saved datasets dir; or synthetic[:N] "
                "(random-token documents, ONLY for tests and cost runs on random hosts without a tokenizer)"})
    data_limit: Optional[int] = field(default=None, metadata={"help": "use at most this many training conversations"})
    on_error: Literal["skip", "raise"] = field(default="skip", metadata={
        "help": "malformed data records: skip them (each logged as file:line) or raise at the first (file:line)"})
    heldout_fraction: float = field(default=0.02, metadata={"help": "fraction of conversations held out for eval"})
    max_length: int = field(default=2048, metadata={"help": "tokens kept per conversation (ShareGPT chats are long)"})
    seq_len: int = field(default=2048, metadata={"help": "tokens per packed training sequence"})
    batch_size: int = field(default=4, metadata={"help": "packed sequences per process per micro-batch"})
    grad_accum: int = field(default=1, metadata={"help": "micro-batches per optimizer step"})
    lr: float = field(default=6e-4, metadata={"help": "peak learning rate (AdamW)"})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay"})
    warmup_ratio: float = field(default=0.04, metadata={"help": "linear warmup share of the steps, then cosine"})
    max_grad_norm: float = field(default=1.0, metadata={"help": "gradient clipping norm (0 = off)"})
    max_steps: Optional[int] = field(default=None, metadata={"help": "optimizer steps; None = epochs x epoch"})
    epochs: float = field(default=10.0, metadata={"help": "passes over the data when max_steps is not set"})
    seed: int = field(default=0, metadata={"help": "seed of initialisation, data order and anchor sampling"})
    save_every: int = field(default=500, metadata={"help": "checkpoint every N steps (and always at the end)"})
    keep_checkpoints: int = field(default=2, metadata={"help": "keep the newest N checkpoints"})
    eval_every: int = field(default=500, metadata={"help": "evaluate on held-out data every N steps (0 = off)"})
    eval_batches: int = field(default=8, metadata={"help": "micro-batches per evaluation"})
    report_to: Literal["none", "wandb", "tensorboard"] = field(default="none", metadata={
        "help": "tracker besides metrics.jsonl (wandb runs offline unless WANDB_MODE is set)"})
    project: str = field(default="dspark", metadata={"help": "tracker project name"})
    bf16: bool = field(default=True, metadata={"help": "bf16 autocast with fp32 master weights (GPU only)"})
    sparse_attention: bool = field(default=True, metadata={
        "help": "DSpark / DFlash block training through a flex-attention BlockMask where it applies (CUDA, bf16, "
                "triton; the same keys, fewer FLOPs); false = the dense mask everywhere (= DSPARK_SPARSE_ATTENTION=0)"})
    resume: Literal["auto", "always", "never"] = field(default="auto", metadata={
        "const": "always", "help": "auto: continue from the newest checkpoint in output if any; always (bare "
                                   "--resume): require one; never: refuse an output dir that has checkpoints"})

    def __post_init__(self) -> None:
        for name in ("max_length", "seq_len", "batch_size", "grad_accum", "save_every", "keep_checkpoints",
                     "eval_batches"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {self.max_steps}")
        if self.eval_every < 0 or not 0.0 <= self.warmup_ratio < 1.0 or self.epochs <= 0:
            raise ValueError("eval_every must be >= 0, warmup_ratio in [0, 1) and epochs > 0")


# ---------------------------------------------------------------------------------------------------------
# Data


def synthetic_chats(n: int, *, vocab_size: int, seed: int, max_length: int) -> list[TokenizedChat]:
    """ONLY for tests and cost runs on random hosts that have no tokenizer: n documents, each a random-token prompt
    (not a target) followed by a response that repeats a random 3-6 token motif (targets), so a drafter has
    structure to learn. Not a stand-in for real data."""
    g = torch.Generator().manual_seed(seed)
    chats = []
    for _ in range(n):
        prompt = torch.randint(0, vocab_size, (int(torch.randint(4, 17, (1,), generator=g)),), generator=g)
        motif = torch.randint(0, vocab_size, (int(torch.randint(3, 7, (1,), generator=g)),), generator=g)
        response = motif.repeat(12)[: int(torch.randint(16, 49, (1,), generator=g))]
        ids = (prompt.tolist() + response.tolist())[:max_length]
        chats.append(TokenizedChat(ids, ([0] * len(prompt) + [1] * len(response))[:max_length]))
    return chats


def build_rows(cfg: TrainConfig, host: Host, *, split: Literal["train", "heldout"],
               limit: int | None) -> list[TokenizedChat]:
    """Conversations -> tokenize_chat (host tokenizer, cut at max_length) -> pack into seq_len rows."""
    if cfg.data.startswith("synthetic"):
        n = int(cfg.data.partition(":")[2] or 256)
        n = n if split == "train" else max(8, int(n * cfg.heldout_fraction))
        chats = synthetic_chats(min(n, limit or n), vocab_size=host.vocab_size, max_length=cfg.max_length,
                                seed=cfg.seed if split == "train" else cfg.seed + 7919)
    else:
        if host.tokenizer is None:
            raise ValueError(f"host {cfg.host!r} has no tokenizer, so {cfg.data!r} cannot be tokenised; random hosts "
                             "train on --data synthetic (tests and cost runs only)")
        conversations = load_conversations(cfg.data, split=split, heldout_fraction=cfg.heldout_fraction, limit=limit,
                                           on_error=cfg.on_error)
        chats = tokenize_conversations(host.tokenizer, conversations, max_length=cfg.max_length)
    # a conversation cut before its first response token trains nothing
    chats = [c for c in chats if sum(c.loss_mask) > 0 and len(c.input_ids) > 1]
    return pack(chats, seq_len=cfg.seq_len)


@dataclass
class DataOrder:
    """Deterministic micro-batch order: epoch e shuffles the rows with seed (seed, e); global micro-batch m of an
    epoch is rows perm[m*B*W : (m+1)*B*W], and process r takes the r-th B of them. Incomplete batches are dropped."""

    rows: list[TokenizedChat]
    batch_size: int
    world_size: int
    rank: int
    seed: int

    def __post_init__(self) -> None:
        self.per_epoch = len(self.rows) // (self.batch_size * self.world_size)
        self._epoch, self._perm = -1, None

    def rows_of(self, micro: int) -> list[TokenizedChat]:
        """This process's rows of global micro-batch number `micro` (counted from the start of training)."""
        epoch, index = divmod(micro, self.per_epoch)
        if epoch != self._epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._epoch, self._perm = epoch, torch.randperm(len(self.rows), generator=g).tolist()
        start = (index * self.world_size + self.rank) * self.batch_size
        return [self.rows[i] for i in self._perm[start : start + self.batch_size]]


def _generator(device: torch.device, seed: int, micro: int, rank: int, world_size: int) -> torch.Generator:
    """Anchor-sampling generator of one micro-batch, a pure function of (seed, micro, rank): resumed runs repeat."""
    return torch.Generator(device).manual_seed((seed * 2_654_435_761 + micro * world_size + rank) % 2**63)


# ---------------------------------------------------------------------------------------------------------
# The step


class Objective(torch.nn.Module):
    """forward(batch) = drafter.training_loss(batch). why: DDP synchronises gradients through forward()."""

    def __init__(self, drafter: torch.nn.Module) -> None:
        super().__init__()
        self.drafter = drafter

    def forward(self, batch: TrainBatch) -> TrainOutput:
        return self.drafter.training_loss(batch)


def make_batch(host: Host, rows: list[TokenizedChat], *, taps: tuple[int, ...], device: torch.device,
               pad_token_id: int, generator: torch.Generator | None, autocast) -> TrainBatch:
    """Collate rows and run the frozen host once: features (B, T, F) and host_logits (B, T, V)."""
    chat = collate(rows, pad_token_id=pad_token_id).to(device)
    with torch.no_grad(), autocast():
        out = host.forward(chat.input_ids, document_ids=chat.document_ids, taps=taps)
        host_logits = host.logits(out.hidden)  # (B, T, V) float32
    return TrainBatch(input_ids=chat.input_ids, loss_mask=chat.loss_mask, document_ids=chat.document_ids,
                      features=out.features, host_logits=host_logits, generator=generator)


def expected_tau(acceptance: torch.Tensor) -> float:
    """tau = 1 + sum_k prod_{i<=k} acc_i from conditional acceptance (K,) (the bonus token included)."""
    return 1.0 + float(torch.cumprod(acceptance.double(), 0).sum())


def _summary(outputs: list[TrainOutput], accelerator: Accelerator) -> dict[str, Any]:
    """Mean loss, loss parts and acceptance over micro-batches and processes."""
    keys = sorted(k for k in outputs[0].metrics if k not in ("loss", "acceptance"))  # those two come from fields
    local = torch.tensor([[float(o.loss.detach()), *(float(o.metrics[k]) for k in keys)] for o in outputs],
                         dtype=torch.float64).mean(0)
    acc = torch.stack([o.acceptance.detach().double().cpu() for o in outputs]).mean(0)  # (K,)
    both = accelerator.reduce(torch.cat([local, acc]).to(accelerator.device), reduction="mean").cpu()
    loss, parts, acc = both[0], both[1 : 1 + len(keys)], both[1 + len(keys) :]
    record = {"loss": float(loss), **{k: float(v) for k, v in zip(keys, parts)}}
    record["acceptance"] = [float(a) for a in acc]
    record["tau"] = expected_tau(acc)
    return record


# ---------------------------------------------------------------------------------------------------------
# Checkpoints: safetensors + JSON, atomic by rename


def _fsync_tree(directory: Path) -> None:
    for path in sorted(directory.rglob("*")):
        if path.is_file():
            with open(path, "rb") as fh:
                os.fsync(fh.fileno())
    _fsync_dir(directory)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=1))


def optimizer_to_files(state_dict: dict, directory: Path) -> None:
    """optimizer.safetensors (every tensor, "state.<index>.<name>") + optimizer.json (everything else)."""
    tensors, plain = {}, {}
    for index, state in state_dict["state"].items():
        plain[str(index)] = {}
        for name, value in state.items():
            if torch.is_tensor(value):
                tensors[f"state.{index}.{name}"] = value.detach().cpu().contiguous()
            else:
                plain[str(index)][name] = value
    save_file(tensors, directory / "optimizer.safetensors")
    _write_json(directory / "optimizer.json", {"state": plain, "param_groups": state_dict["param_groups"]})


def optimizer_from_files(directory: Path) -> dict:
    meta = json.loads((directory / "optimizer.json").read_text())
    state: dict[int, dict] = {int(i): dict(values) for i, values in meta["state"].items()}
    for key, tensor in load_file(directory / "optimizer.safetensors").items():
        _, index, name = key.split(".", 2)
        state.setdefault(int(index), {})[name] = tensor
    return {"state": state, "param_groups": meta["param_groups"]}


def checkpoints(output: Path) -> list[Path]:
    """Complete checkpoints in `output`, oldest first (half-written ones only exist under a .tmp- name)."""
    found = [p for p in output.glob(CHECKPOINT_PREFIX + "*") if p.is_dir() and p.name[len(CHECKPOINT_PREFIX):].isdigit()]
    return sorted(found, key=lambda p: int(p.name[len(CHECKPOINT_PREFIX):]))


def save_checkpoint(*, accelerator: Accelerator, drafter, optimizer, scheduler, trainer_state: dict, output: Path,
                    keep: int) -> Path:
    """Write checkpoint-<step> atomically (temp dir, fsync, rename), then prune to the newest `keep`."""
    step = trainer_state["step"]
    final = output / f"{CHECKPOINT_PREFIX}{step:08d}"
    staging = output / f".tmp-{CHECKPOINT_PREFIX}{step:08d}"
    if accelerator.is_main_process:
        shutil.rmtree(staging, ignore_errors=True)
        # first: save_pretrained replaces the whole directory it is given
        drafter.save_pretrained(staging)
    accelerator.wait_for_everyone()
    rng = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and accelerator.device.type == "cuda":
        rng["torch_cuda"] = torch.cuda.get_rng_state(accelerator.device)
    save_file(rng, staging / f"rng-{accelerator.process_index}.safetensors")
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        optimizer_to_files(optimizer.state_dict(), staging)
        _write_json(staging / "scheduler.json", scheduler.state_dict())
        version, internal, gauss = random.getstate()
        _write_json(staging / "trainer_state.json", {**trainer_state, "python_rng": [version, list(internal), gauss]})
        _fsync_tree(staging)
        if final.exists():  # only when this step was saved before (a resume that had nothing left to do)
            shutil.rmtree(final)
        os.replace(staging, final)
        _fsync_dir(output)
        for old in checkpoints(output)[:-keep]:
            shutil.rmtree(old)
    accelerator.wait_for_everyone()
    return final


def restore_rng(checkpoint: Path, trainer_state: dict, accelerator: Accelerator) -> None:
    rng_file = checkpoint / f"rng-{accelerator.process_index}.safetensors"
    if not rng_file.exists():  # a resume on more processes than saved: the data order still repeats exactly
        rng_file = checkpoint / "rng-0.safetensors"
    rng = load_file(rng_file)
    torch.set_rng_state(rng["torch_cpu"])
    if "torch_cuda" in rng and accelerator.device.type == "cuda":
        torch.cuda.set_rng_state(rng["torch_cuda"], accelerator.device)
    version, internal, gauss = trainer_state["python_rng"]
    random.setstate((version, tuple(internal), gauss))


# ---------------------------------------------------------------------------------------------------------
# Logging


def log_metrics(record: dict, *, accelerator: Accelerator, metrics_file: Path) -> None:
    """Append one record to metrics.jsonl (flushed) and send the scalars to the tracker (main process only)."""
    if not accelerator.is_main_process:
        return
    with metrics_file.open("a") as fh:
        fh.write(json.dumps(record) + "\n")
    scalars = {k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "step"}
    prefix = "eval/" if record.get("kind") == "eval" else "train/"
    for k, a in enumerate(record.get("acceptance", []), start=1):
        scalars[f"acc_{k}"] = a
    accelerator.log({prefix + k: v for k, v in scalars.items()}, step=record["step"])


def read_metrics(metrics_file: Path) -> list[dict]:
    """Records of metrics.jsonl; a last line cut by a kill is dropped."""
    if not metrics_file.exists():
        return []
    records = []
    for line in metrics_file.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return records


def _truncate_metrics(metrics_file: Path, step: int) -> None:
    """Keep only records up to `step` (a killed run may have logged past its last checkpoint)."""
    kept = [r for r in read_metrics(metrics_file) if r["step"] <= step]
    staging = metrics_file.with_suffix(".jsonl.tmp")
    staging.write_text("".join(json.dumps(r) + "\n" for r in kept))
    os.replace(staging, metrics_file)


def plot_curve(metrics_file: Path, path: Path) -> None:
    """training_curve.png: loss and expected tau against step, train and eval."""
    import matplotlib

    matplotlib.use("Agg")  # why: no display on training machines
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_file)
    fig, (ax_loss, ax_tau) = plt.subplots(1, 2, figsize=(11, 4))
    for kind, style in (("train", "-"), ("eval", "o-")):
        rows = [r for r in records if r.get("kind") == kind]
        if rows:
            steps = [r["step"] for r in rows]
            ax_loss.plot(steps, [r["loss"] for r in rows], style, label=kind, markersize=3)
            ax_tau.plot(steps, [r["tau"] for r in rows], style, label=kind, markersize=3)
    ax_loss.set(xlabel="step", ylabel="loss", title="loss")
    ax_tau.set(xlabel="step", ylabel="expected tau (teacher-forced)", title="1 + sum_k prod_{i<=k} acc_i")
    for ax in (ax_loss, ax_tau):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _peak_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


# ---------------------------------------------------------------------------------------------------------
# The loop


def load_host(name: str, *, device: torch.device, dtype: torch.dtype) -> Host:
    from dspark.engine.models import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(name, dtype=dtype, device=device)
    return Host(model, tokenizer, name=name)


def _start(cfg: TrainConfig, output: Path, accelerator: Accelerator) -> Path | None:
    """The checkpoint to resume from (None = fresh start), after cleaning debris of a killed save."""
    if accelerator.is_main_process:
        output.mkdir(parents=True, exist_ok=True)
        # a killed save leaves only hidden staging directories (ours and save_pretrained's) with this tag
        for debris in output.glob(f".*tmp-{CHECKPOINT_PREFIX}*"):
            shutil.rmtree(debris, ignore_errors=True)
    accelerator.wait_for_everyone()
    found = checkpoints(output)
    if cfg.resume == "always" and not found:
        raise FileNotFoundError(f"--resume: no checkpoint in {output}")
    if cfg.resume == "never" and found:
        raise FileExistsError(f"{output} already has checkpoints ({found[-1].name}); use another --output or "
                              "--resume auto/always to continue it")
    if not found:
        return None
    latest = found[-1]
    saved = from_dict(TrainConfig, json.loads((latest / "trainer_state.json").read_text())["config"])
    changed = [k for k in _RESUME_FIXED if getattr(saved, k) != getattr(cfg, k)]
    if changed:
        raise ValueError(f"cannot resume {latest}: these settings differ from the saved run, which would change its "
                         f"data order or optimisation: " + ", ".join(f"{k} ({getattr(saved, k)!r} -> "
                                                                      f"{getattr(cfg, k)!r})" for k in changed))
    return latest


def train(cfg: TrainConfig, host: Host | None = None) -> Path:
    """Train cfg.drafter on cfg.host (or on an already loaded `host`, moved to the training device); returns the
    final checkpoint directory (a `load_drafter` path)."""
    from drafters import build_drafter, load_drafter
    from transformers import get_cosine_schedule_with_warmup

    # why check here: accelerate only warns and logs nowhere when the tracker's package is missing
    if cfg.report_to == "wandb" and not is_wandb_available():
        raise ImportError("--report-to wandb needs the wandb package: pip install wandb")
    if cfg.report_to == "tensorboard" and not is_tensorboard_available():
        raise ImportError("--report-to tensorboard needs tensorboard or tensorboardX: pip install tensorboardX")
    if cfg.report_to == "wandb":
        os.environ.setdefault("WANDB_MODE", "offline")  # why: no login or network needed; sync later by hand
    output = Path(cfg.output)
    accelerator = Accelerator(log_with=None if cfg.report_to == "none" else cfg.report_to, project_dir=str(output))
    device, rank, world = accelerator.device, accelerator.process_index, accelerator.num_processes
    use_bf16 = cfg.bf16 and device.type == "cuda"

    def autocast():
        return torch.autocast("cuda", dtype=torch.bfloat16) if use_bf16 else nullcontext()

    resume_from = _start(cfg, output, accelerator)
    torch.manual_seed(cfg.seed)  # drafter initialisation
    if host is None:
        host = load_host(cfg.host, device=device, dtype=torch.bfloat16 if use_bf16 else torch.float32)
    host.model.to(device)
    if resume_from is None:
        with warnings.catch_warnings():  # "random weights" is the point of a fresh training run
            warnings.filterwarnings("ignore", message=".*has no checkpoint.*")
            drafter = build_drafter(cfg.drafter, host, **cfg.drafter_args)
    else:
        drafter = load_drafter(resume_from, host)
    drafter.to(device)
    if not cfg.sparse_attention and hasattr(drafter, "sparse_attention"):
        drafter.sparse_attention = False
    trainable = [p for p in drafter.parameters() if p.requires_grad]
    # why fp32: these are the master weights; autocast does the bf16 compute
    bad = [n for n, p in drafter.named_parameters() if p.requires_grad and p.dtype != torch.float32]
    if bad:
        raise TypeError(f"trainable drafter parameters must be float32 master weights, not {bad[:3]}...")
    taps = tuple(drafter.feature_layers)
    host.check_taps(taps)
    pad_token_id = 0
    if host.tokenizer is not None:
        pad_token_id = host.tokenizer.pad_token_id if host.tokenizer.pad_token_id is not None else \
            (host.tokenizer.eos_token_id or 0)

    train_rows = build_rows(cfg, host, split="train", limit=cfg.data_limit)
    order = DataOrder(train_rows, batch_size=cfg.batch_size, world_size=world, rank=rank, seed=cfg.seed)
    if order.per_epoch < cfg.grad_accum:
        raise ValueError(f"{len(train_rows)} packed sequences make {order.per_epoch} micro-batches of "
                         f"{cfg.batch_size} x {world} processes, fewer than grad_accum={cfg.grad_accum}")
    eval_rows = []
    if cfg.eval_every:
        eval_rows = build_rows(cfg, host, split="heldout", limit=cfg.eval_batches * cfg.batch_size * world * 8)
        if not eval_rows:
            logger.warning("no held-out conversations in %s: evaluation is off", cfg.data)
    steps_per_epoch = order.per_epoch // cfg.grad_accum
    total = cfg.max_steps or max(1, math.ceil(cfg.epochs * steps_per_epoch))

    optimizer = torch.optim.AdamW(trainable, lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = get_cosine_schedule_with_warmup(optimizer, round(cfg.warmup_ratio * total), total)
    step = 0
    if resume_from is not None:
        trainer_state = json.loads((resume_from / "trainer_state.json").read_text())
        optimizer.load_state_dict(optimizer_from_files(resume_from))
        scheduler.load_state_dict(json.loads((resume_from / "scheduler.json").read_text()))
        restore_rng(resume_from, trainer_state, accelerator)
        step = trainer_state["step"]
        if trainer_state["world_size"] != world and accelerator.is_main_process:
            logger.warning("resuming a %d-process run on %d processes: the global batch and the data order "
                           "change from here on", trainer_state["world_size"], world)
        if accelerator.is_main_process:
            _truncate_metrics(output / "metrics.jsonl", step)
        if accelerator.is_main_process:
            logger.info("resumed from %s at step %d", resume_from, step)
    elif accelerator.is_main_process:
        (output / "metrics.jsonl").unlink(missing_ok=True)
    if accelerator.is_main_process:
        (output / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    model = accelerator.prepare_model(Objective(drafter))
    accelerator.init_trackers(cfg.project, config=to_dict(cfg), init_kwargs={
        "wandb": {"dir": str(output), "name": output.name}})
    metrics_file = output / "metrics.jsonl"
    n_params = sum(p.numel() for p in trainable)
    if accelerator.is_main_process:
        logger.info("training %s (%.2fM trainable parameters) on %s: %d packed rows, %d steps/epoch, %d steps, "
                    "%d process(es)", cfg.drafter, n_params / 1e6, cfg.host, len(train_rows), steps_per_epoch, total,
                    world)

    def state(step: int) -> dict:
        micro = step * cfg.grad_accum
        return {"step": step, "micro_batches": micro, "epoch": micro // order.per_epoch,
                "micro_in_epoch": micro % order.per_epoch, "world_size": world, "config": to_dict(cfg)}

    def save(step: int) -> Path:
        return save_checkpoint(accelerator=accelerator, drafter=accelerator.unwrap_model(model).drafter,
                               optimizer=optimizer, scheduler=scheduler, trainer_state=state(step), output=output,
                               keep=cfg.keep_checkpoints)

    bar = tqdm(total=total, initial=step, desc=f"train {cfg.drafter}", unit="step",
               disable=not accelerator.is_main_process)
    last_saved = resume_from
    model.train()
    while step < total:
        started = time.perf_counter()
        outputs, tokens = [], 0
        for a in range(cfg.grad_accum):
            micro = step * cfg.grad_accum + a
            rows = order.rows_of(micro)
            batch = make_batch(host, rows, taps=taps, device=device, pad_token_id=pad_token_id, autocast=autocast,
                               generator=_generator(device, cfg.seed, micro, rank, world))
            tokens += sum(len(r.input_ids) for r in rows)
            # why no_sync: gradients are all-reduced once per optimizer step, not per micro-batch
            with accelerator.no_sync(model) if a < cfg.grad_accum - 1 else nullcontext():
                with autocast():
                    out = model(batch)
                accelerator.backward(out.loss / cfg.grad_accum)
            outputs.append(out)
        grad_norm = torch.nn.utils.clip_grad_norm_(trainable, cfg.max_grad_norm if cfg.max_grad_norm > 0 else math.inf)
        lr = scheduler.get_last_lr()[0]
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        record = {"kind": "train", "step": step, "epoch": step * cfg.grad_accum / order.per_epoch,
                  **_summary(outputs, accelerator), "lr": lr, "grad_norm": float(grad_norm)}
        seconds = time.perf_counter() - started
        record["tokens_per_s"] = tokens * world / seconds
        record["step_s"] = seconds  # the optimizer step alone; "time" (Unix) also counts evaluation and saving
        record["time"] = time.time()
        record["peak_mem_gb"] = _peak_memory_gb(device)
        log_metrics(record, accelerator=accelerator, metrics_file=metrics_file)
        bar.update(1)
        bar.set_postfix(loss=f"{record['loss']:.3f}", tau=f"{record['tau']:.2f}",
                        acc=" ".join(f"{a:.2f}" for a in record["acceptance"]))
        if eval_rows and (step % cfg.eval_every == 0 or step == total):
            log_metrics({"kind": "eval", "step": step, **evaluate(host, model, eval_rows, cfg=cfg, taps=taps,
                                                                  accelerator=accelerator, pad_token_id=pad_token_id,
                                                                  autocast=autocast)},
                        accelerator=accelerator, metrics_file=metrics_file)
        if step % cfg.save_every == 0 or step == total:
            last_saved = save(step)
    bar.close()
    if last_saved is None or last_saved.name != f"{CHECKPOINT_PREFIX}{step:08d}":
        last_saved = save(step)  # a resume with nothing left to do still returns a complete final checkpoint
    if accelerator.is_main_process:
        plot_curve(metrics_file, output / "training_curve.png")
    accelerator.end_training()
    return last_saved


@torch.no_grad()
def evaluate(host: Host, model, rows: list[TokenizedChat], *, cfg: TrainConfig, taps, accelerator: Accelerator,
             pad_token_id: int, autocast) -> dict:
    """Mean loss and teacher-forced acceptance over the first eval_batches micro-batches of held-out rows."""
    model.eval()
    world, rank = accelerator.num_processes, accelerator.process_index
    mine = rows[rank::world] or rows  # fewer rows than processes: every process still reports a mean
    outputs = []
    for i in range(min(cfg.eval_batches, max(1, math.ceil(len(mine) / cfg.batch_size)))):
        part = mine[i * cfg.batch_size : (i + 1) * cfg.batch_size] or mine[: cfg.batch_size]
        batch = make_batch(host, part, taps=taps, device=accelerator.device, pad_token_id=pad_token_id,
                           autocast=autocast, generator=_generator(accelerator.device, cfg.seed + 1, i, rank, world))
        with autocast():
            # why the unwrapped drafter: evaluation needs no gradient synchronisation
            outputs.append(accelerator.unwrap_model(model).drafter.training_loss(batch))
    model.train()
    return _summary(outputs, accelerator)


def main_train(argv: list[str] | None = None) -> Path:
    """`dspark train ...`: parse flags / --config YAML into TrainConfig and train."""
    (cfg,) = parse([TrainConfig], argv, prog="dspark train", description=__doc__.split("\n\n")[0])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    path = train(cfg)
    print(path)
    return path


if __name__ == "__main__":
    from dspark.api import tune_cpu_allocator

    tune_cpu_allocator()  # as the `dspark` command does
    main_train(sys.argv[1:])
