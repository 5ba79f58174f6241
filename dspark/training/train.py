"""One training loop for every trainable drafter (docs/DSPARK.md §3): the host is frozen and runs online in the step.

Shapes: B sequences per micro-batch, T tokens, V vocabulary, F concatenated host features, K draft positions.

Each micro-batch: the host runs once over the packed batch (taps = drafter.feature_layers) under no_grad, giving
features (B, T, F) and host_logits (B, T, V); the drafter turns a `TrainBatch` into a `TrainOutput`
(loss, loss parts, per-position teacher-forced acceptance). No feature cache on disk.

    dspark train --host smollm2 --drafter dspark --data sharegpt --output runs/dspark --max-steps 2000
    dspark train --config run.yaml --report-to wandb            # YAML keys = the TrainConfig fields below
    accelerate launch -m dspark.cli train --host smollm2 --drafter dflash --data regen.jsonl --output runs/df

Multi-GPU: `accelerate launch` starts one process per GPU; the drafter is wrapped in DDP, the frozen host is
replicated on every GPU and never wrapped. Each process takes its own rows of every global batch, and N processes of
batch B train as one process of batch N*B does (tests/test_train.py, on the CPU with gloo): the same rows in each
global micro-batch (DataOrder), the same anchors per row (keyed by the row's place in the global micro-batch, not
by the process), and the global micro-batch's loss normalisation (each process's loss scaled by its share of the
summed TrainOutput.weight before DDP averages gradients). DSPARK_TRAIN_ROW_LOG=<dir> makes process r append the row
indices it trains on to <dir>/rows-<r>.jsonl (a debug record; tests check that no row is seen twice an epoch).

Checkpoints, OUTPUT/checkpoint-<step:08d>/ (written into OUTPUT/.tmp-checkpoint-<step>, fsynced, then renamed, so a
kill -9 mid-write leaves the earlier checkpoints intact; only complete checkpoints carry the final name):
    <the drafter's save_pretrained files>     loadable with `drafters.load_drafter(path, host)`
    trainer_state.json      step, epoch, micro-batches consumed, world size, packed rows read, config, python RNG state
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

import gzip
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
from dataclasses import dataclass, field, replace
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
from dspark.engine.acceptance import expected_tau
from dspark.engine.host import Host
from dspark.engine.jsonio import dumps, write_json_atomic
from dspark.engine.models import load_host
from dspark.engine.runtime import tune_cpu_allocator
from dspark.training.data import HELDOUT_FRACTION, TokenizedChat, collate, iter_tokenized, load_conversations, pack

logger = logging.getLogger(__name__)

DRAFTERS = ("dspark", "dflash", "eagle3", "mtp")
CHECKPOINT_PREFIX = "checkpoint-"
# settings that fix the data order, the model or the optimisation path: a resumed run must not change them
_RESUME_FIXED = ("host", "drafter", "drafter_args", "data", "data_limit", "heldout_fraction", "max_length", "seq_len",
                 "batch_size", "grad_accum", "seed", "lr", "weight_decay", "warmup_ratio", "max_grad_norm")


@dataclass
class TrainConfig:
    """Everything `dspark train` accepts; each field is a flag (`--max-steps`) and a YAML key (`max_steps`)."""

    output: str = field(metadata={"help": "output directory: checkpoints, metrics.jsonl, training curve"})
    host: str = field(default="smollm2", metadata={
        "help": "host model: smollm2, qwen2.5-coder-1.5b, qwen2.5-coder-0.5b, random:<shape>, a path or hub id"})
    drafter: Literal["dspark", "dflash", "eagle3", "mtp"] = field(default="dspark", metadata={"help": "drafter kind"})
    drafter_args: dict[str, Any] = field(default_factory=dict, metadata={
        "help": "drafter overrides passed to build_drafter, e.g. --drafter-args num_layers=3 block_size=7 head=rnn. "
                "DSpark / DFlash max_anchors (blocks per training row; default 512, DeepSpec's, 40 on a CPU): the GPU "
                "recipes (experiments/recipes/*-dspark.yaml, *-dflash.yaml) use 1024 on 2048-token rows, half the "
                "row's positions, since every anchor trains block_size more slots from the same host forward (more "
                "supervision per host token; held-out tau grows with it, benchmarks/results/cpu/anchor_ablation.md) "
                "at a cost linear in anchors (the drafter's layers and loss over anchors x block_size slots: "
                "benchmarks/results/training/)"})
    data: str = field(default="sharegpt", metadata={
        "help": "conversations: sharegpt, humaneval, a .jsonl[.gz] file, a saved datasets dir; or synthetic[:N] "
                "(random-token documents, ONLY for tests and cost runs on random hosts without a tokenizer)"})
    data_limit: Optional[int] = field(default=None, metadata={"help": "use at most this many training conversations"})
    on_error: Literal["skip", "raise"] = field(default="skip", metadata={
        "help": "malformed data records: skip them (each logged as file:line) or raise at the first (file:line)"})
    heldout_fraction: float = field(default=HELDOUT_FRACTION, metadata={
        "help": "fraction of conversations held out for eval; kept in every checkpoint (trainer_state.json), where "
                "`dspark eval` reads it, so eval's held-out prompts are the ones this run never trained on"})
    max_length: Optional[int] = field(default=None, metadata={
        "help": "tokens kept per conversation (ShareGPT chats are long); default 2048 on a GPU, 384 without one"})
    seq_len: Optional[int] = field(default=None, metadata={
        "help": "tokens per packed training sequence; default 2048 on a GPU, 384 without one"})
    batch_size: Optional[int] = field(default=None, metadata={
        "help": "packed sequences per process per micro-batch; default 4 on a GPU, 2 without one"})
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
    init_layers_from_host: bool = field(default=False, metadata={
        "help": "start the drafter's decoder layers (DSpark / DFlash backbone, MTP's layer) from the host's last "
                "layers' weights instead of random ones (a fresh run only; weights without a counterpart, as "
                "Qwen2's attention biases, are left out and logged)"})
    stage_timing_every: int = field(default=0, metadata={
        "help": "every N-th step also logs `stage_s`: seconds in the host forward, the drafter's forward and loss, "
                "backward and the optimizer, each stage closed by a device synchronize on those steps only (0 = off)"})
    report_to: Literal["none", "wandb", "tensorboard"] = field(default="none", metadata={
        "help": "tracker besides metrics.jsonl (wandb runs offline unless WANDB_MODE is set)"})
    project: str = field(default="dspark", metadata={"help": "tracker project name"})
    bf16: bool = field(default=True, metadata={"help": "bf16 autocast with fp32 master weights (GPU only)"})
    loss_impl: Literal["fused", "reference"] = field(default="fused", metadata={
        "help": "the drafter's training loss: fused (the LM head, loss and its gradient in chunks of rows, bf16 GEMMs "
                "with float32 accumulation, never a float32 rows x vocabulary tensor; drafters/losses.py) or "
                "reference (float32 logits in checkpointed chunks, what the fused one is tested against)"})
    compile_layers: bool = field(default=False, metadata={
        "help": "torch.compile the drafter's RMSNorm and MLP modules (CUDA only; fuses their elementwise ops, the "
                "largest part of a fused-loss step after the GEMMs in benchmarks/results/training/; its own effect "
                "is not measured yet: benchmarks/train_speed.py --compile-layers)"})
    sparse_attention: bool = field(default=True, metadata={
        "help": "DSpark / DFlash block training through a flex-attention BlockMask where it applies (CUDA, bf16, "
                "triton; the same keys, fewer FLOPs); false = the dense mask everywhere (= DSPARK_SPARSE_ATTENTION=0)"})
    resume: Literal["auto", "always", "never"] = field(default="auto", metadata={
        "const": "always", "help": "auto: continue from the newest checkpoint in output if any; always (bare "
                                   "--resume): require one; never: refuse an output dir that has checkpoints"})

    def __post_init__(self) -> None:
        for name in ("max_length", "seq_len", "batch_size", "grad_accum", "save_every", "keep_checkpoints",
                     "eval_batches"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {self.max_steps}")
        if self.eval_every < 0 or not 0.0 <= self.warmup_ratio < 1.0 or self.epochs <= 0:
            raise ValueError("eval_every must be >= 0, warmup_ratio in [0, 1) and epochs > 0")
        if self.stage_timing_every < 0:
            raise ValueError(f"stage_timing_every must be >= 0, got {self.stage_timing_every}")


# Sizes a run leaves unset (None), by device. Without a GPU: the quickstart's `small` recipe (dspark/quickstart.py,
# SmolLM2 on 2 CPU cores: ~4 s a step, a few GB), where the GPU sizes (2048-token rows, 4 a batch, 512 DSpark anchors
# a row) take minutes a step and more memory than a laptop has.
SIZE_DEFAULTS = {"cuda": dict(max_length=2048, seq_len=2048, batch_size=4),
                 "cpu": dict(max_length=384, seq_len=384, batch_size=2)}
CPU_DRAFTER_DEFAULTS = {"dspark": {"max_anchors": 40}, "dflash": {"max_anchors": 40}}


def resolve_sizes(cfg: TrainConfig, device: torch.device) -> TrainConfig:
    """cfg with the sizes it leaves unset filled in for `device` (SIZE_DEFAULTS; on a CPU also the drafter's
    CPU_DRAFTER_DEFAULTS unless --drafter-args sets them). The saved config holds the resolved values."""
    kind = "cuda" if device.type == "cuda" else "cpu"
    sizes = {k: v for k, v in SIZE_DEFAULTS[kind].items() if getattr(cfg, k) is None}
    drafter_args = cfg.drafter_args
    if kind == "cpu":
        drafter_args = {**CPU_DRAFTER_DEFAULTS.get(cfg.drafter, {}), **cfg.drafter_args}
    if (sizes or drafter_args != cfg.drafter_args) and kind == "cpu":
        logger.info("no GPU: CPU-sized defaults %s", {**sizes, **{f"drafter_args.{k}": v for k, v in
                                                                 drafter_args.items() if k not in cfg.drafter_args}})
    return replace(cfg, **sizes, drafter_args=drafter_args)


def rows_needed(cfg: TrainConfig, world: int) -> int | None:
    """Packed training rows a run consumes: one epoch of max_steps optimizer steps (None = all, an epoch-based run)."""
    return None if cfg.max_steps is None else cfg.max_steps * cfg.grad_accum * cfg.batch_size * world


def step_memory(cfg: TrainConfig, host: Host, drafter, *, element_size: int, sparse: bool,
                device: torch.device | str | None = None) -> int:
    """Bytes of the largest tensors one training step holds at once: a lower estimate (activations only; weights and
    optimizer state are already allocated when it is taken). B rows of T tokens, V vocabulary, N attention heads:
    the host's logits (B, T, V) float32 for the whole step and one host layer's attention scores (B, N, T, T); one
    chunk of the vocabulary-sized loss (drafters/losses.py); DSpark / DFlash with the dense block mask: each backbone
    layer's attention probabilities over A*S block queries x (T + A*S) keys (S = block_size), kept for backward;
    EAGLE-3: each unrolled step's (B, N, T, T + j) scores and probabilities."""
    from drafters.losses import FUSED_CHUNK_ELEMENTS_CUDA, loss_chunk_elements

    B, T, N, V = cfg.batch_size, cfg.seq_len, host.num_heads, host.vocab_size
    if cfg.loss_impl == "fused":  # the host's logits in the host's dtype, a chunk's logits and bias in the compute one
        chunk = min(FUSED_CHUNK_ELEMENTS_CUDA if torch.device(device or "cpu").type == "cuda" else
                    loss_chunk_elements(device), B * T * V)
        total = B * T * V * element_size + 2 * B * N * T * T * 4 + 2 * chunk * element_size
    else:
        total = B * T * V * 4 + 2 * B * N * T * T * 4 + 6 * min(loss_chunk_elements(device), B * T * V) * 4
    config = getattr(drafter, "config", None)
    if drafter.kind == "dspark" and not sparse:
        slots = min(config.max_anchors, T) * config.block_size
        total += (config.num_layers + 1) * B * N * slots * (T + slots) * element_size
    elif drafter.kind == "eagle3":
        total += sum(2 * B * N * T * (T + j) * element_size for j in range(config.ttt_length))
    return total


def available_memory(device: torch.device) -> int:
    """Bytes a step can still allocate: free GPU memory, or the host's available memory (psutil, which accelerate
    depends on)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    import psutil

    return psutil.virtual_memory().available


def check_step_memory(cfg: TrainConfig, host: Host, drafter, device: torch.device, *, element_size: int) -> None:
    """Stop before the first step, with the flags that lower it, when `step_memory` exceeds what is available: a
    step past it is killed by the kernel with no message or fails with CUDA out of memory."""
    sparse = device.type == "cuda" and cfg.sparse_attention and element_size == 2
    need = step_memory(cfg, host, drafter, element_size=element_size, sparse=sparse, device=device)
    have = available_memory(device)
    if need <= have:
        return
    knobs = ["--batch-size", "--seq-len"]
    if drafter.kind == "dspark":
        knobs.append("--drafter-args max_anchors=N")
    elif drafter.kind == "eagle3":
        knobs.append("--drafter-args ttt_length=N")
    raise MemoryError(f"a training step needs at least {need / 2**30:.1f} GiB but only {have / 2**30:.1f} GiB "
                      f"{'of GPU memory is free' if device.type == 'cuda' else 'of memory is available'} "
                      f"at batch_size={cfg.batch_size}, seq_len={cfg.seq_len}; lower it with {', '.join(knobs)}")


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


def build_rows(cfg: TrainConfig, host: Host, *, split: Literal["train", "heldout"], limit: int | None,
               max_rows: int | None = None) -> list[TokenizedChat]:
    """Conversations -> tokenize_chat (host tokenizer, cut at max_length) -> pack into seq_len rows. max_rows: the
    first that many rows only, tokenising no conversation past them (a 20-step run reads a few dozen chats, not
    17k ShareGPT ones)."""
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
        chats = iter_tokenized(host.tokenizer, conversations, max_length=cfg.max_length)
    # a conversation cut before its first response token trains nothing
    chats = (c for c in chats if sum(c.loss_mask) > 0 and len(c.input_ids) > 1)
    return pack(chats, seq_len=cfg.seq_len, max_rows=max_rows)


def target_counts(rows: list[TokenizedChat], vocab_size: int) -> torch.Tensor:
    """How often each token id (V,) is a training target (loss_mask 1) in the packed rows."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for row in rows:
        ids = torch.tensor(row.input_ids)[torch.tensor(row.loss_mask, dtype=torch.bool)]
        counts += torch.bincount(ids, minlength=vocab_size)[:vocab_size]
    return counts


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

    def indices_of(self, micro: int) -> list[int]:
        """Indices into `rows` of this process's rows of global micro-batch number `micro` (counted from the start
        of training). They depend on the world size only through the global batch B*W: process r's rows are places
        r*B .. r*B+B-1 of the one-process micro-batch of B*W rows."""
        epoch, index = divmod(micro, self.per_epoch)
        if epoch != self._epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._epoch, self._perm = epoch, torch.randperm(len(self.rows), generator=g).tolist()
        start = (index * self.world_size + self.rank) * self.batch_size
        return self._perm[start : start + self.batch_size]


def _anchor_seeds(seed: int, keys: range) -> torch.Tensor:
    """(len(keys),) long: the anchor-noise key of each row (TrainBatch.anchor_seeds), a pure function of the run's
    seed and the row's place `key` in the global order, so resumed runs repeat and the split over processes does not
    matter."""
    return torch.tensor([(seed * 2**40 + k) % 2**63 for k in keys], dtype=torch.long)


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
               pad_token_id: int, anchor_seeds: torch.Tensor | None, autocast,
               loss_impl: str = "fused") -> TrainBatch:
    """Collate rows and run the frozen host once: features (B, T, F) and host_logits (B, T, V), in the host's dtype
    for the fused loss (bf16 on a GPU: the values the reference's float32 copy holds), float32 for the reference."""
    chat = collate(rows, pad_token_id=pad_token_id).to(device)
    with torch.no_grad(), autocast():
        out = host.forward(chat.input_ids, document_ids=chat.document_ids, taps=taps)
        host_logits = host.lm_head(out.hidden) if loss_impl == "fused" else host.logits(out.hidden)  # (B, T, V)
    return TrainBatch(input_ids=chat.input_ids, loss_mask=chat.loss_mask, document_ids=chat.document_ids,
                      features=out.features, host_logits=host_logits, anchor_seeds=anchor_seeds)


def _summary(outputs: list[TrainOutput], accelerator: Accelerator, *, slots: int) -> dict[str, Any]:
    """Loss, loss parts and acceptance of micro-batches 0..slots-1 over processes (a process may have fewer: eval).

    Loss and parts of micro-batch i: the mean over processes weighted by TrainOutput.weight, which is the value one
    process would log for all their rows (every part shares the loss's normaliser; other metrics, e.g. DSpark's
    anchor count, get the same weighting); then the plain mean over micro-batches, as gradient accumulation
    averages them. Acceptance: the plain mean over micro-batches and processes (its per-position denominators are
    not reported, so N processes log it within noise of, not equal to, one process)."""
    keys = sorted(k for k in outputs[0].metrics if k not in ("loss", "acceptance"))  # those two come from fields
    K = outputs[0].acceptance.numel()
    # columns: present, weight, weight x (loss, parts...), acceptance (K)
    table = torch.zeros(slots, 3 + len(keys) + K, dtype=torch.float64)
    for i, o in enumerate(outputs):
        w = 1.0 if o.weight is None else float(o.weight)
        values = torch.tensor([float(o.loss.detach()), *(float(o.metrics[k]) for k in keys)], dtype=torch.float64)
        table[i, :2] = torch.tensor([1.0, w], dtype=torch.float64)
        table[i, 2 : 3 + len(keys)] = w * values
        table[i, 3 + len(keys) :] = o.acceptance.detach().double().cpu()
    table = accelerator.reduce(table.to(accelerator.device), reduction="sum").cpu()
    table = table[table[:, 0] > 0]
    # a micro-batch with no valid token anywhere has loss 0 on every process
    means = (table[:, 2 : 3 + len(keys)] / table[:, 1:2].clamp(min=1e-30)).mean(0)
    loss, parts = means[0], means[1:]
    acc = (table[:, 3 + len(keys) :] / table[:, :1]).mean(0)  # (K,)
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
    write_json_atomic(directory / "optimizer.json", {"state": plain, "param_groups": state_dict["param_groups"]})


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
    partial = output / f".tmp-{CHECKPOINT_PREFIX}{step:08d}"
    if accelerator.is_main_process:
        shutil.rmtree(partial, ignore_errors=True)
        # first: save_pretrained replaces the whole directory it is given
        drafter.save_pretrained(partial)
    accelerator.wait_for_everyone()
    rng = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and accelerator.device.type == "cuda":
        rng["torch_cuda"] = torch.cuda.get_rng_state(accelerator.device)
    save_file(rng, partial / f"rng-{accelerator.process_index}.safetensors")
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        optimizer_to_files(optimizer.state_dict(), partial)
        write_json_atomic(partial / "scheduler.json", scheduler.state_dict())
        version, internal, gauss = random.getstate()
        write_json_atomic(partial / "trainer_state.json",
                          {**trainer_state, "python_rng": [version, list(internal), gauss]})
        _fsync_tree(partial)
        if final.exists():  # only when this step was saved before (a resume that had nothing left to do)
            shutil.rmtree(final)
        os.replace(partial, final)
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
        fh.write(dumps(record) + "\n")  # strict JSON: a NaN loss is written null
    scalars = {k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "step"}
    prefix = "eval/" if record.get("kind") == "eval" else "train/"
    for k, a in enumerate(record.get("acceptance", []), start=1):
        scalars[f"acc_{k}"] = a
    accelerator.log({prefix + k: v for k, v in scalars.items()}, step=record["step"])


def read_metrics(metrics_file: Path) -> list[dict]:
    """Records of metrics.jsonl, or of its gzip (.jsonl.gz: how recorded curves are committed); a last line cut by a
    kill is dropped."""
    metrics_file = Path(metrics_file)
    if not metrics_file.exists():
        return []
    raw = metrics_file.read_bytes()
    text = (gzip.decompress(raw) if metrics_file.suffix == ".gz" else raw).decode()
    records = []
    for line in text.splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return records


def _truncate_metrics(metrics_file: Path, step: int) -> None:
    """Keep only records up to `step` (a killed run may have logged past its last checkpoint)."""
    kept = [r for r in read_metrics(metrics_file) if r["step"] <= step]
    partial = metrics_file.with_suffix(".jsonl.tmp")
    partial.write_text("".join(dumps(r) + "\n" for r in kept))
    os.replace(partial, metrics_file)


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
    ax_tau.set(xlabel="step", ylabel="τ (teacher-forced)", title="τ: expected tokens a round, the bonus one included")
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


def _start(cfg: TrainConfig, output: Path, accelerator: Accelerator) -> Path | None:
    """The checkpoint to resume from (None = fresh start), after cleaning debris of a killed save."""
    if accelerator.is_main_process:
        output.mkdir(parents=True, exist_ok=True)
        # a killed save leaves only hidden partial directories (ours and save_pretrained's) with this tag
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


@dataclass
class Run:
    """Everything one training run holds between steps: built by `setup`, advanced by `train_step`."""

    cfg: TrainConfig
    output: Path
    accelerator: Accelerator
    host: Host
    drafter: Any
    trainable: list
    taps: tuple[int, ...]
    pad_token_id: int
    order: DataOrder
    train_rows: list[TokenizedChat]
    eval_rows: list[TokenizedChat]
    steps_per_epoch: int
    total: int
    optimizer: Any
    scheduler: Any
    use_bf16: bool
    model: Any = None  # the accelerate-prepared Objective, set once resume decided the metrics file

    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    def autocast(self):
        return torch.autocast("cuda", dtype=torch.bfloat16) if self.use_bf16 else nullcontext()


def init_layers_from_host(drafter, host: Host) -> None:
    """TrainConfig.init_layers_from_host: the drafter's InjectionStack (DSpark / DFlash backbone, MTP's block) from
    the host's last layers. A drafter without one (EAGLE-3's layer reads 2H-wide inputs) is refused, not skipped."""
    from drafters.blocks import InjectionStack

    stacks = [m for m in drafter.modules() if isinstance(m, InjectionStack)]
    if len(stacks) != 1:
        raise ValueError(f"init_layers_from_host: the {type(drafter).__name__} drafter has no decoder layers of the "
                         "host's shape to start from the host's (DSpark, DFlash and MTP have)")
    dropped = stacks[0].init_from_host(host.layers)
    logger.info("drafter layers initialised from the host's last %d layers%s", len(stacks[0].layers),
                f"; left out (no counterpart): {', '.join(dropped)}" if dropped else "")


def make_optimizer(params: list, *, lr: float, weight_decay: float, device: torch.device) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters. why fused on CUDA: the whole update in one multi-tensor kernel per
    group instead of a sequence of elementwise ones (5 ms for DSpark's 324M parameters on the Qwen2.5-Coder-1.5B
    shape, benchmarks/results/training/)."""
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=device.type == "cuda")


def compile_layers(drafter) -> None:
    """TrainConfig.compile_layers: torch.compile every RMSNorm and MLP module of the drafter in place (the state
    dict keeps its names)."""
    from drafters.blocks import MLP, RMSNorm

    for module in drafter.modules():
        if isinstance(module, (MLP, RMSNorm)):
            module.compile()


def setup(cfg: TrainConfig, host: Host | None, resume_from: Path | None, accelerator: Accelerator) -> Run:
    """Host, drafter (fresh, or the checkpoint's weights when resuming), data order, optimizer and schedule."""
    from drafters import build_drafter, load_drafter
    from transformers import get_cosine_schedule_with_warmup

    device, rank, world = accelerator.device, accelerator.process_index, accelerator.num_processes
    use_bf16 = cfg.bf16 and device.type == "cuda"
    torch.manual_seed(cfg.seed)  # drafter initialisation
    if host is None:
        host = load_host(cfg.host, device=device, dtype=torch.bfloat16 if use_bf16 else torch.float32)
    host.model.to(device)
    if resume_from is None:
        with warnings.catch_warnings():  # "random weights" is the point of a fresh training run
            warnings.filterwarnings("ignore", message=".*has no checkpoint.*")
            drafter = build_drafter(cfg.drafter, host, **cfg.drafter_args)
        if cfg.init_layers_from_host:
            init_layers_from_host(drafter, host)
    else:
        drafter = load_drafter(resume_from, host)
    drafter.to(device)
    if not cfg.sparse_attention and hasattr(drafter, "sparse_attention"):
        drafter.sparse_attention = False
    drafter.loss_impl = cfg.loss_impl
    if cfg.compile_layers and device.type == "cuda":
        compile_layers(drafter)
    trainable = [p for p in drafter.parameters() if p.requires_grad]
    # why fp32: these are the master weights; autocast does the bf16 compute
    bad = [n for n, p in drafter.named_parameters() if p.requires_grad and p.dtype != torch.float32]
    if bad:
        raise TypeError(f"trainable drafter parameters must be float32 master weights, not {bad[:3]}...")
    taps = tuple(drafter.feature_layers)
    host.check_taps(taps)
    check_step_memory(cfg, host, drafter, device, element_size=2 if use_bf16 else 4)
    pad_token_id = 0
    if host.tokenizer is not None:
        pad_token_id = host.tokenizer.pad_token_id if host.tokenizer.pad_token_id is not None else \
            (host.tokenizer.eos_token_id or 0)

    # the rows this run consumes, and no more; a resumed run reads the same rows as the run it continues (checkpoints
    # of runs that read them all carry no "train_rows")
    max_rows = rows_needed(cfg, world)
    if resume_from is not None:
        max_rows = json.loads((resume_from / "trainer_state.json").read_text()).get("train_rows")
    train_rows = build_rows(cfg, host, split="train", limit=cfg.data_limit, max_rows=max_rows)
    if resume_from is None and getattr(getattr(drafter, "config", None), "draft_vocab", 0):
        # EAGLE-3's reduced vocabulary: the tokens most frequent as targets in the rows this run trains on (a
        # resumed run has them in its checkpoint). why every process counts: the rows are the same everywhere
        drafter.set_draft_vocab(drafter.draft_vocab_from_counts(target_counts(train_rows, host.vocab_size)))
        logger.info("draft vocabulary: the %d most frequent of %d target token ids", drafter.config.draft_vocab,
                    host.vocab_size)
    order = DataOrder(train_rows, batch_size=cfg.batch_size, world_size=world, rank=rank, seed=cfg.seed)
    if order.per_epoch < cfg.grad_accum:
        raise ValueError(f"{len(train_rows)} packed sequences make {order.per_epoch} micro-batches of "
                         f"{cfg.batch_size} x {world} processes, fewer than grad_accum={cfg.grad_accum}")
    eval_rows = []
    if cfg.eval_every:
        eval_rows = build_rows(cfg, host, split="heldout", limit=cfg.eval_batches * cfg.batch_size * world * 8,
                               max_rows=cfg.eval_batches * cfg.batch_size * world)
        if not eval_rows:
            logger.warning("no held-out conversations in %s: evaluation is off", cfg.data)
    steps_per_epoch = order.per_epoch // cfg.grad_accum
    total = cfg.max_steps or max(1, math.ceil(cfg.epochs * steps_per_epoch))

    optimizer = make_optimizer(trainable, lr=cfg.lr, weight_decay=cfg.weight_decay, device=device)
    scheduler = get_cosine_schedule_with_warmup(optimizer, round(cfg.warmup_ratio * total), total)
    return Run(cfg=cfg, output=Path(cfg.output), accelerator=accelerator, host=host, drafter=drafter,
               trainable=trainable, taps=taps, pad_token_id=pad_token_id, order=order, train_rows=train_rows,
               eval_rows=eval_rows, steps_per_epoch=steps_per_epoch, total=total, optimizer=optimizer,
               scheduler=scheduler, use_bf16=use_bf16)


def resume(run: Run, resume_from: Path | None) -> int:
    """Optimizer, schedule, RNG and metrics of `resume_from` (None: a fresh start); returns the step to go on from."""
    accelerator, output = run.accelerator, run.output
    step = 0
    if resume_from is not None:
        trainer_state = json.loads((resume_from / "trainer_state.json").read_text())
        run.optimizer.load_state_dict(optimizer_from_files(resume_from))
        run.scheduler.load_state_dict(json.loads((resume_from / "scheduler.json").read_text()))
        restore_rng(resume_from, trainer_state, accelerator)
        step = trainer_state["step"]
        if trainer_state["world_size"] != accelerator.num_processes and accelerator.is_main_process:
            logger.warning("resuming a %d-process run on %d processes: the global batch and the data order "
                           "change from here on", trainer_state["world_size"], accelerator.num_processes)
        if accelerator.is_main_process:
            _truncate_metrics(output / "metrics.jsonl", step)
        if accelerator.is_main_process:
            logger.info("resumed from %s at step %d", resume_from, step)
    elif accelerator.is_main_process:
        (output / "metrics.jsonl").unlink(missing_ok=True)
    return step


class StageClock:
    """Seconds per stage of one training step, for `stage_timing_every`. Each `lap` closes a stage with a device
    synchronize, so that the GPU's queued work is counted in the stage that queued it; off, a lap does nothing (no
    synchronize: the step keeps its host-device overlap). Written here: torch.profiler would trace every kernel of
    a 0.4 s step, where four numbers per logged step are the question (where a step's time goes)."""

    STAGES = ("host", "forward", "backward", "optimizer")

    def __init__(self, device: torch.device, on: bool) -> None:
        self.device, self.on = device, on
        self.seconds = dict.fromkeys(self.STAGES, 0.0)
        self.last = self._now() if on else 0.0

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def lap(self, stage: str) -> None:
        if self.on:
            now = self._now()
            self.seconds[stage] += now - self.last
            self.last = now


def train_step(run: Run, step: int) -> dict:
    """One optimizer step (grad_accum micro-batches) from `step`; returns its metrics record (step = step + 1)."""
    cfg, accelerator, model = run.cfg, run.accelerator, run.model
    rank, world = accelerator.process_index, accelerator.num_processes
    every = cfg.stage_timing_every
    clock = StageClock(run.device, on=every > 0 and (step + 1) % every == 0)
    started = time.perf_counter()
    outputs, tokens = [], 0
    row_log = os.environ.get("DSPARK_TRAIN_ROW_LOG")
    for a in range(cfg.grad_accum):
        micro = step * cfg.grad_accum + a
        indices = run.order.indices_of(micro)
        rows = [run.train_rows[i] for i in indices]
        first = (micro * world + rank) * cfg.batch_size  # this process's first place in the global row order
        batch = make_batch(run.host, rows, taps=run.taps, device=run.device, pad_token_id=run.pad_token_id,
                           autocast=run.autocast, loss_impl=cfg.loss_impl,
                           anchor_seeds=_anchor_seeds(cfg.seed, range(first, first + len(rows))))
        clock.lap("host")
        tokens += sum(len(r.input_ids) for r in rows)
        if row_log:
            with open(Path(row_log) / f"rows-{rank}.jsonl", "a") as fh:
                fh.write(json.dumps({"step": step + 1, "micro": micro, "rank": rank, "rows": indices}) + "\n")
        # why no_sync: gradients are all-reduced once per optimizer step, not per micro-batch
        with accelerator.no_sync(model) if a < cfg.grad_accum - 1 else nullcontext():
            with run.autocast():
                out = model(batch)
            clock.lap("forward")
            loss = out.loss
            if world > 1 and out.weight is not None:
                # why: DDP averages the processes' gradients, weighing each process's mean alike; scaled by the
                # process's share of the global normaliser, the average is the gradient of the global micro-batch's
                # mean, which one process of batch N*B would take
                total = float(accelerator.reduce(torch.tensor([out.weight], dtype=torch.float64, device=run.device),
                                                 reduction="sum"))
                loss = loss * (out.weight * world / total) if total > 0 else loss
            accelerator.backward(loss / cfg.grad_accum)
            clock.lap("backward")
        outputs.append(out)
    grad_norm = torch.nn.utils.clip_grad_norm_(run.trainable,
                                               cfg.max_grad_norm if cfg.max_grad_norm > 0 else math.inf)
    lr = run.scheduler.get_last_lr()[0]
    run.optimizer.step()
    run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    clock.lap("optimizer")
    step += 1
    record = {"kind": "train", "step": step, "epoch": step * cfg.grad_accum / run.order.per_epoch,
              **_summary(outputs, accelerator, slots=cfg.grad_accum), "lr": lr, "grad_norm": float(grad_norm)}
    seconds = time.perf_counter() - started
    record["tokens_per_s"] = tokens * world / seconds
    record["step_s"] = seconds  # the optimizer step alone; "time" (Unix) also counts evaluation and saving
    record["time"] = time.time()
    record["peak_mem_gb"] = _peak_memory_gb(run.device)
    if clock.on:
        record["stage_s"] = clock.seconds
    return record


def train(cfg: TrainConfig, host: Host | None = None) -> Path:
    """Train cfg.drafter on cfg.host (or on an already loaded `host`, moved to the training device); returns the
    final checkpoint directory (a `load_drafter` path)."""
    # why check here: accelerate only warns and logs nowhere when the tracker's package is missing
    if cfg.report_to == "wandb" and not is_wandb_available():
        raise ImportError("--report-to wandb needs the wandb package: pip install wandb")
    if cfg.report_to == "tensorboard" and not is_tensorboard_available():
        raise ImportError("--report-to tensorboard needs tensorboard or tensorboardX: pip install tensorboardX")
    if cfg.report_to == "wandb":
        os.environ.setdefault("WANDB_MODE", "offline")  # why: no login or network needed; sync later by hand
    output = Path(cfg.output)
    accelerator = Accelerator(log_with=None if cfg.report_to == "none" else cfg.report_to, project_dir=str(output))
    world = accelerator.num_processes
    cfg = resolve_sizes(cfg, accelerator.device)  # before _start: the saved config holds the resolved sizes
    resume_from = _start(cfg, output, accelerator)
    run = setup(cfg, host, resume_from, accelerator)
    step = resume(run, resume_from)
    if accelerator.is_main_process:
        (output / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    run.model = model = accelerator.prepare_model(Objective(run.drafter))
    accelerator.init_trackers(cfg.project, config=to_dict(cfg), init_kwargs={
        "wandb": {"dir": str(output), "name": output.name}})
    metrics_file = output / "metrics.jsonl"
    n_params = sum(p.numel() for p in run.trainable)
    if accelerator.is_main_process:
        logger.info("training %s (%.2fM trainable parameters) on %s: %d packed rows, %d steps/epoch, %d steps, "
                    "%d process(es)", cfg.drafter, n_params / 1e6, cfg.host, len(run.train_rows),
                    run.steps_per_epoch, run.total, world)

    def state(step: int) -> dict:
        micro = step * cfg.grad_accum
        return {"step": step, "micro_batches": micro, "epoch": micro // run.order.per_epoch,
                "micro_in_epoch": micro % run.order.per_epoch, "world_size": world,
                "train_rows": len(run.train_rows), "config": to_dict(cfg)}

    def save(step: int) -> Path:
        return save_checkpoint(accelerator=accelerator, drafter=accelerator.unwrap_model(model).drafter,
                               optimizer=run.optimizer, scheduler=run.scheduler, trainer_state=state(step),
                               output=output, keep=cfg.keep_checkpoints)

    total = run.total
    bar = tqdm(total=total, initial=step, desc=f"train {cfg.drafter}", unit="step",
               disable=not accelerator.is_main_process)
    last_saved = resume_from
    model.train()
    while step < total:
        record = train_step(run, step)
        step = record["step"]
        log_metrics(record, accelerator=accelerator, metrics_file=metrics_file)
        bar.update(1)
        bar.set_postfix(loss=f"{record['loss']:.3f}", tau=f"{record['tau']:.2f}",
                        acc=" ".join(f"{a:.2f}" for a in record["acceptance"]))
        if run.eval_rows and (step % cfg.eval_every == 0 or step == total):
            log_metrics({"kind": "eval", "step": step, **evaluate(run.host, model, run.eval_rows, cfg=cfg,
                                                                  taps=run.taps, accelerator=accelerator,
                                                                  pad_token_id=run.pad_token_id,
                                                                  autocast=run.autocast)},
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
        start = i * cfg.batch_size if i * cfg.batch_size < len(mine) else 0
        part = mine[start : start + cfg.batch_size]
        # anchors keyed by the held-out row's index (rank + world * position in `mine`)
        keys = range(rank + world * start, rank + world * (start + len(part)), world)
        batch = make_batch(host, part, taps=taps, device=accelerator.device, pad_token_id=pad_token_id,
                           autocast=autocast, loss_impl=cfg.loss_impl,
                           anchor_seeds=_anchor_seeds(cfg.seed + 1, keys))
        with autocast():
            # why the unwrapped drafter: evaluation needs no gradient synchronisation
            outputs.append(accelerator.unwrap_model(model).drafter.training_loss(batch))
    model.train()
    return _summary(outputs, accelerator, slots=cfg.eval_batches)


def main_train(argv: list[str] | None = None) -> Path:
    """`dspark train ...`: parse flags / --config YAML into TrainConfig and train."""
    (cfg,) = parse([TrainConfig], argv, prog="dspark train", description=__doc__.split("\n\n")[0])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    path = train(cfg)
    print(path)
    return path


if __name__ == "__main__":

    tune_cpu_allocator()  # as the `dspark` command does
    main_train(sys.argv[1:])
