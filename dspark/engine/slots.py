"""Slots and admission: the fixed pool of C request slots of the continuous-batching engine.

Shapes: C slots, Tmax positions per slot, n requests admitted together, P their longest prompt, F host features.

A slot holds one request at a time: its committed tokens seq[s, :seq_len[s]] (the last one is the anchor), its
rows of the host KV cache and of the drafter's state (`Drafter.slot_state`), its seed, round counter and token
budget. Every round runs over all C slots, so shapes never change and a round can be replayed as a CUDA graph;
`active` marks the slots holding a live request, and idle slots commit nothing (their state stays frozen until the
next admission overwrites it). A request enters a free slot with its own prefill, batched with the other arrivals
of that moment, and leaves when it stops.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark.engine.kv_cache import KVCache
from dspark.engine.prefill import DrafterPrefill, Prefill
from dspark.engine.sampling import STREAM_SAMPLE, SamplingConfig, argmax, process, sample
from dspark.engine.protocol import DraftState, Drafter


PREFILL_BUCKET = 64  # prefill widths are multiples of this


@dataclass
class Request:
    """One request as the engine's CPU side sees it."""

    index: int  # position in the caller's prompt list
    prompt: list[int]
    limit: int  # max new tokens
    seed: int


def put_rows(full, rows: torch.Tensor, part) -> None:
    """Write the batch rows of `part` (a KVCache or a tensor with batch dim 0) into `full` at rows (n,), in place."""
    if isinstance(full, KVCache):
        full.k[:, rows] = part.k
        full.v[:, rows] = part.v
        full.lengths[rows] = part.lengths
    elif isinstance(full, torch.Tensor):
        full[rows] = part.to(full.dtype)
    else:
        raise TypeError(f"slot state of type {type(full).__name__} has no rows to admit into")


def to_device(device: torch.device, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """CPU tensors on `device`. why pinned and non-blocking on CUDA: a copy from pageable memory makes the CPU wait
    for everything queued on the stream first (here: a round launched before this admission, serve's overlap);
    the pinned blocks come from torch's caching host allocator, which keeps each until its copy has run."""
    if device.type != "cuda":
        return tuple(t.to(device) for t in tensors)
    return tuple(t.pin_memory().to(device, non_blocking=True) for t in tensors)


def draw_first(logits: torch.Tensor, sampling: SamplingConfig, seeds: torch.Tensor, position: torch.Tensor):
    """The token after the prompt from logits (n, V), keyed by its absolute position (n,), as decode._draw."""
    if sampling.greedy:
        return argmax(logits)
    return sample(process(logits, sampling), seeds, position, STREAM_SAMPLE)


class Slots:
    """Per-slot state of C requests on the host's device, and admission into free slots."""

    def __init__(self, host, drafter: Drafter, verifier, *, capacity: int, max_len: int,
                 sampling: SamplingConfig, prefill: str = "eager", drafter_prefill: str | None = None) -> None:
        device, C = host.device, capacity
        self.host, self.drafter, self.verifier = host, drafter, verifier
        self.capacity, self.max_len, self.sampling = C, max_len, sampling
        # idle slots hold two dummy tokens: every drafter can then propose from them (EAGLE-3 reads position
        # seq_len - 2) without indexing before the start, which a captured round would do on never-used slots
        self.state = DraftState(seq=torch.zeros(C, max_len, dtype=torch.long, device=device),
                                seq_len=torch.full((C,), 2, dtype=torch.long, device=device),
                                seeds=torch.zeros(C, dtype=torch.long, device=device),
                                rounds=torch.zeros(C, dtype=torch.long, device=device), sampling=sampling)
        self.active = torch.zeros(C, dtype=torch.bool, device=device)  # (C,)
        self.remaining = torch.zeros(C, dtype=torch.long, device=device)  # (C,) tokens allowed after the anchor
        self.cache = host.new_cache(C, max_len)
        self.prefill = Prefill(host, max_len=max_len, taps=drafter.feature_layers, mode=prefill)
        drafter.begin(host=host, batch_size=C, max_len=max_len)
        # after begin: it borrows the drafter's state; its mode that of the host's prefill unless given
        self.drafter_prefill = DrafterPrefill(drafter, host, max_len=max_len, mode=drafter_prefill or prefill)
        verifier.begin(batch_size=C)
        # the CPU side: which request each slot holds (None = free), and mirrors that need no device read
        self.request: list[Request | None] = [None] * C
        self.remaining_cpu = [0] * C
        self.cache_len = [0] * C  # host cache lengths, for the eager attention window
        self.rounds_cpu = [0] * C
        self.next_width = -1  # the verifier's bound on this round's lengths, from the last round's copy; -1 = none
        self.busy = 0  # requests in flight
        # features of plain rounds not yet observed (keep_backlog; round.accept(defer=True), round.flush_observe)
        self.backlog: torch.Tensor | None = None  # (C, rows, F)
        self.backlog_n: torch.Tensor | None = None  # (C,) rows in use

    def keep_backlog(self, rows: int) -> None:
        """Room for `rows` plain rounds' features per slot (F = the drafter's taps x the host's hidden size)."""
        F = len(self.drafter.feature_layers) * self.host.hidden_size
        device = self.state.seq.device
        self.backlog = torch.zeros(self.capacity, rows, F, dtype=self.host.dtype, device=device)
        self.backlog_n = torch.zeros(self.capacity, dtype=torch.long, device=device)

    def prefill_warmup_s(self) -> float:
        """Seconds spent capturing (or preparing) admission shapes: the host's prefill and the drafter's part."""
        return self.prefill.warmup_s + self.drafter_prefill.warmup_s

    def prefill_graphs(self) -> int:
        return self.prefill.graphs + self.drafter_prefill.graphs

    def free(self) -> list[int]:
        return [s for s, r in enumerate(self.request) if r is None]

    def in_flight(self) -> int:
        return self.busy

    @torch.no_grad()
    def admit(self, slots: list[int], requests: list[Request]) -> torch.Tensor:
        """Prefill `requests` together and place them in `slots`; returns, on the device, (n, 2): each one's first
        new token and whether its prefill logits were finite (1) — read by the caller when it needs them, so that
        an admission waits on nothing the device is still running (a round launched before it, serve's overlap)."""
        host, device, n = self.host, self.host.device, len(requests)
        plen_cpu = torch.tensor([len(r.prompt) for r in requests])
        # why a bucketed width: each new prefill shape costs kernel and attention-plan selection on a GPU (a
        # fraction of a second with cuDNN attention), and arrivals come with every prompt length;
        # the padding positions are written past each row's end and never attended to
        P = min(-(-int(plen_cpu.max()) // PREFILL_BUCKET) * PREFILL_BUCKET, self.max_len)
        seq = torch.zeros(n, self.max_len, dtype=torch.long)
        for b, r in enumerate(requests):
            seq[b, : len(r.prompt)] = torch.tensor(r.prompt)
        seq, plen, seeds, rows, remaining = to_device(
            device, seq, plen_cpu, torch.tensor([r.seed for r in requests]), torch.tensor(slots),
            torch.tensor([r.limit - 1 for r in requests]))
        cache, hidden, features = self.prefill(seq[:, :P], plen)  # the prompts in a cache of n rows
        last = hidden.gather(1, (plen - 1).view(n, 1, 1).expand(n, 1, hidden.shape[-1]))
        logits = host.logits(last[:, 0])  # (n, V)
        # why: argmax / sampling of NaN logits returns some token; the caller refuses it like a round's non-finite
        # logits (serve: FloatingPointError naming the requests) before committing anything of that request
        finite = torch.isfinite(logits).all(-1)  # (n,)
        first = draw_first(logits, self.sampling, seeds, plen)  # (n,)
        seq.scatter_(1, plen.unsqueeze(1), first.unsqueeze(1))
        sub = DraftState(seq=seq, seq_len=plen + 1, seeds=seeds, rounds=torch.zeros_like(plen),
                         sampling=self.sampling)
        self._admit_drafter(rows, features, plen, sub)
        put_rows(self.cache, rows, cache)
        for full, part in ((self.state.seq, seq), (self.state.seq_len, sub.seq_len), (self.state.seeds, seeds),
                           (self.state.rounds, sub.rounds), (self.remaining, remaining)):
            put_rows(full, rows, part)
        self.active.index_fill_(0, rows, True)  # why not active[rows] = True: that copies the value from the CPU
        if self.backlog_n is not None:  # the drafter observed the prompt (_admit_drafter): nothing is pending
            self.backlog_n.index_fill_(0, rows, 0)
        for s, r in zip(slots, requests):
            self.request[s] = r
            self.remaining_cpu[s], self.cache_len[s], self.rounds_cpu[s] = r.limit, len(r.prompt), 0
        self.busy += len(slots)
        return torch.stack([first, finite.long()], 1)

    def _admit_drafter(self, rows: torch.Tensor, features, plen: torch.Tensor, sub: DraftState) -> None:
        """The drafter's begin/observe/prefill on the arrivals alone (DrafterPrefill), then their rows written into
        the slots' state."""
        for name, part in self.drafter_prefill(features, plen, sub).items():
            put_rows(getattr(self.drafter, name), rows, part)

    def retire(self, slots: list[int]) -> list[Request]:
        """Free `slots`; their state stays as it was (frozen: idle slots commit nothing)."""
        done = [self.request[s] for s in slots]
        for s in slots:
            self.request[s] = None
        self.busy -= len(slots)
        if slots:
            self.active.index_fill_(0, to_device(self.active.device, torch.tensor(slots))[0], False)
        return done
