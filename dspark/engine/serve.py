"""The continuous-batching driver: C slots, a queue of requests, rounds until every request has stopped.

Each iteration: one round over all slots (dspark.engine.round, eager or replayed graphs), its device-to-host copy
(one: where the verify width depends on device values it rides in the previous round's copy on CUDA,
graphs.lookahead_allowed, but for a round after an admission), then on the CPU the commit
of each live slot's new tokens (stops, budgets, streaming callbacks, the round log), retirement of the requests
that stopped, and admission of queued requests into the freed slots, each with its own prefill (batched with the
other arrivals of that moment; replayed as a CUDA graph where the rounds are, dspark.engine.prefill). Static-batch
decoding is the case where every request is admitted at once (C = the number of requests).

Overlap (`overlap_allowed`, CUDA): round r + 1 is launched before round r is committed, so the device runs it while
the CPU commits, retires and admits: before the wait for round r's copy where the launch needs nothing from it
(plain decoding, verify-all of a drafter whose width the CPU knows), right after it where the launch needs the
longest length of the draft proposed at the end of round r (n-gram lengths, the threshold) or a lagged scheduler's
bound; the copy is then non-blocking, into pinned memory. A draft gate then decides from the rounds before the last.

Python's cyclic garbage collector (`quiet_gc`): the objects alive when the loop starts (the models, captured graphs,
compiled code) are frozen for the loop, so that a collection inside it scans only what the loop allocates; the
collections that still run, and their wall time, are counted in EngineStats.
"""
from __future__ import annotations

import gc
import os
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from dspark.engine.graphs import round_runner
from dspark.engine.kv_cache import slot_cache_length
from dspark.engine.results import RoundLog
from dspark.engine.round import AHEAD, EXPECTED, EXPECTED_SCALE, FINITE, N_ACCEPTED, NEXT_WIDTH, PROPOSED, \
    SEQ_LEN, VERIFIED
from dspark.engine.slots import Request, Slots


@dataclass
class Sink:
    """Where the engine writes what it decodes, indexed by Request.index (shared with the caller)."""

    outputs: list[list[int]]
    reasons: list[str]
    latency: list[float]  # admission to last token
    ttft: list[float]  # admission to first token
    log: RoundLog
    stops: set[int]
    on_tokens: object = None  # callable(index, ids) -> bool, or None
    bar: object = None  # tqdm or None
    t0: float = field(default_factory=time.perf_counter)
    rows: list = field(default_factory=list)  # (request, round, proposed, verified, accepted, committed) per row
    confidence: list = field(default_factory=list)  # (device (C, K) confidences, live slots) per round

    def close(self) -> None:
        """Write the collected rows into the RoundLog: one tensor per column, confidences read back once."""
        names = ("request", "round", "proposed", "verified", "accepted", "committed")
        columns = torch.tensor(self.rows, dtype=torch.long).reshape(-1, len(names)).T
        for name, column in zip(names, columns):
            getattr(self.log, name).append(column.clone())
        drafted = [c for c, _ in self.confidence if c is not None]
        if drafted:
            # rows of plain rounds read a zero row appended after the drafted rounds' rows
            flat = torch.cat(drafted + [drafted[0].new_zeros(1, drafted[0].shape[1])]).cpu()  # (sum of C + 1, K)
            offsets, index, zero = 0, [], len(flat) - 1
            for c, live in self.confidence:
                if c is None:
                    index.extend(zero for _ in live)
                else:
                    index.extend(offsets + s for s in live)
                    offsets += c.shape[0]
            self.log.confidence.append(flat[torch.tensor(index, dtype=torch.long)])
        else:
            self.log.confidence.append(None)

    def take(self, request: Request, ids: list[int], remaining: int) -> tuple[list[int], bool, int]:
        """Cut ids at the budget and the first stop token; (taken, still live, tokens left). Calls on_tokens."""
        take, live = ids[: min(len(ids), remaining)], True
        for j, t in enumerate(take):
            if t in self.stops:
                take, live = take[: j + 1], False
                self.reasons[request.index] = "stop"
                break
        self.outputs[request.index].extend(take)
        remaining -= len(take)
        live = live and remaining > 0
        if self.on_tokens is not None and take and self.on_tokens(request.index, take) and live:
            self.reasons[request.index] = "stop"  # the callback's own stopping rule (e.g. StoppingCriteria)
            live = False
        if self.bar is not None:
            self.bar.update(len(take))
        return take, live, remaining


@dataclass
class EngineStats:
    rounds: int = 0
    admissions: int = 0  # prefill forwards (one per group of arrivals)
    graphs: int = 0  # CUDA graphs captured (propose once, verify and accept per verify width, prefill per shape)
    warmup_s: float = 0.0  # warm-up and capture
    stage_s: dict = field(default_factory=dict)  # draft / verify / accept device seconds, bookkeeping wall seconds
    in_flight: list[int] = field(default_factory=list)  # requests in flight at each round
    widths: list[int] = field(default_factory=list)  # the verify forward's width (L + 1 tokens per slot) each round
    drafted: int = 0  # rounds that ran the drafter (the others were plain: Verifier.draft_next)
    prefill_graphs: int = 0  # of `graphs`, the admission graphs captured: the host's prefill per arrival shape and
    # the drafter's part per shape where it is captured too (dspark.engine.prefill)
    admit_s: float = 0.0  # wall seconds launching admissions (prefills, the drafter's admission), capture excluded
    # wall seconds the CPU waited for the device's copies (rounds, first tokens): the loop's wall time less this is
    # the CPU's own work (launches, commits, admissions); where that exceeds the device's round, the CPU is the bound
    wait_s: float = 0.0
    overlapped: bool = False  # rounds launched before the last one was committed (overlap_allowed)
    gc_s: float = 0.0  # wall seconds of Python's garbage collections during the loop (quiet_gc)
    gc_collections: list[int] = field(default_factory=lambda: [0, 0, 0])  # of them, per generation collected


#: whether `serve` freezes the objects alive at its start for its loop (quiet_gc); False for an A/B of the effect
FREEZE_GC = True


def _drafter_admission_setting() -> bool:
    value = os.environ.get("DSPARK_DRAFTER_ADMISSION", "captured")
    if value not in ("captured", "eager"):
        raise ValueError(f"DSPARK_DRAFTER_ADMISSION must be captured or eager, got {value!r}")
    return value == "captured"


#: False: the drafter's part of each admission runs as called even where the rounds and the host's prefill replay
#: graphs (dspark.engine.prefill.DrafterPrefill): benchmarks/speed.py's A/B (--drafter-admission eager), or
#: DSPARK_DRAFTER_ADMISSION=eager in the environment (every process, e.g. each `dspark bench` a script starts)
CAPTURE_DRAFTER_ADMISSION = _drafter_admission_setting()


@contextmanager
def quiet_gc(stats: EngineStats):
    """Inside: the garbage collections counted and timed into `stats` (gc.callbacks) and, with FREEZE_GC, every
    object alive at entry frozen (gc.freeze), unfrozen at exit. Yields a function that freezes what exists at that
    moment too (for graphs captured inside the loop). why: a collection of the oldest generation scans every
    tracked object, and after torch.compile and graph capture a process holds hundreds of thousands of them, a
    pause that lands in whichever round triggers it; frozen, those objects are skipped and the loop's collections
    take several times less (benchmarks/gc_pause.py measures both). Where the caller froze objects already
    (gc.get_freeze_count() > 0) nothing is frozen or unfrozen here: gc.unfreeze would release theirs too."""
    started: list[float] = []

    def watch(phase: str, info: dict) -> None:
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            stats.gc_s += time.perf_counter() - started.pop()
            stats.gc_collections[info["generation"]] += 1

    freeze = FREEZE_GC and gc.isenabled() and gc.get_freeze_count() == 0
    if freeze:
        gc.freeze()
    gc.callbacks.append(watch)
    try:
        yield gc.freeze if freeze else (lambda: None)
    finally:
        gc.callbacks.remove(watch)
        if freeze:
            gc.unfreeze()


#: devices where the loop launches each round before committing the last one on the CPU (`overlap_allowed`)
OVERLAP_DEVICES = ("cuda",)


def overlap_allowed(runner, verifier, K: int, wanted: bool | None = None) -> str | None:
    """How round r + 1 may be launched before round r is committed on the CPU, so that the device runs it while the
    CPU commits, retires and admits (no round waits on the CPU's bookkeeping); None = in order (not on this
    device). "known": the launch needs nothing from round r's copy (plain decoding, or verify-all of a drafter
    whose width the CPU knows: the verify width is then bounded by the CPU's budgets, which lag one round but only
    from above), so it comes before the wait for that copy. "ahead": the launch needs round r's copy (the longest
    length of the draft proposed at the end of round r, graphs.lookahead_allowed, or a lagged scheduler's bound on
    round r + 1's lengths), so round r + 1 is launched as soon as that copy is read, and round r committed while
    r + 1 runs.

    Lossless like the order it replaces: the device is where tokens are decided, and it never reads the CPU's view;
    a request that stopped in round r (a stop token, a callback) runs one more round on the device whose row nobody
    commits (`Launched.requests`), and one whose budget ran out commits nothing more (round.accept). A verifier
    learns of round r (`after_round`) after round r + 1 was launched, so a draft gate decides from the rounds
    before the last: fewer finished rounds, still never a draft not yet made (Verifier.draft_next). Its cost: a
    freed slot is refilled one round later. On the CPU, where a device read costs nothing, it only costs that.
    `wanted`: False = in order, True = overlapped on any device, None = overlapped on OVERLAP_DEVICES."""
    if wanted is False or (wanted is None and runner.host.device.type not in OVERLAP_DEVICES):
        return None
    if K == 0 or (verifier.static_length and runner.known_width() is not None):
        return "known"
    return "ahead"


@dataclass
class Launched:
    """A round launched on the device, as the CPU commits it."""

    copy: HostCopy  # its packed output on its way to the CPU
    confidence: torch.Tensor | None  # (C, K) its draft's confidences (a device copy), None = none or a plain round
    L: int  # drafts per row of its verify forward
    drafting: bool
    requests: list  # slots.request when it was launched: each slot's row of this round belongs to that request


class HostCopy:
    """A round's packed output copied to the CPU: into pinned memory without blocking on CUDA (read by `wait`),
    cloned on the CPU (a static runner's output buffer is rewritten by the next round)."""

    def __init__(self, packed: torch.Tensor) -> None:
        self.event = None
        if packed.device.type == "cuda":
            self.host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            self.host.copy_(packed, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = packed.clone()

    def wait(self) -> torch.Tensor:
        if self.event is not None:
            self.event.synchronize()
        return self.host


def prefill_mode(graphs: bool | str) -> str:
    """How arrivals are prefilled (dspark.engine.prefill): replayed graphs where the rounds replay theirs, static
    buffers where the rounds re-run theirs (graphs="static")."""
    return "static" if graphs == "static" else "graph" if graphs else "eager"


def serve(host, requests: list[Request], *, drafter, verifier, K: int, sampling, sink: Sink, concurrency: int,
          graphs: bool | str | None = None, timing: bool = False, overlap: bool | None = None) -> EngineStats:
    """Decode every request with at most `concurrency` in flight, writing into `sink`; `overlap` as in
    overlap_allowed (None: on OVERLAP_DEVICES)."""
    C = max(1, min(concurrency, len(requests)))
    max_len = slot_cache_length(max(len(r.prompt) for r in requests) + max(r.limit for r in requests), K)
    use_graphs = host.device.type == "cuda" if graphs is None else graphs
    slots = Slots(host, drafter, verifier, capacity=C, max_len=max_len, sampling=sampling,
                  prefill=prefill_mode(use_graphs), drafter_prefill=None if CAPTURE_DRAFTER_ADMISSION else "eager")
    runner = round_runner(slots, host, drafter, verifier, K, graphs=graphs, timing=timing)
    stats = EngineStats()
    queue = deque(requests)
    overlap = overlap_allowed(runner, verifier, K, overlap)  # while every slot is idle
    stats.overlapped = overlap is not None
    if overlap:
        runner.slack = K + 1  # EagerRound's attention window: the CPU's cache lengths lag one round behind
    arriving: list[Arrivals] = []  # admitted requests whose first tokens the CPU has not read yet
    with quiet_gc(stats) as freeze:
        _loop(slots, runner, verifier, queue, sink, stats, arriving, K, overlap, freeze)
    return stats


def _loop(slots: Slots, runner, verifier, queue: deque, sink: Sink, stats: EngineStats, arriving: list,
          K: int, overlap: str | None, freeze) -> None:
    """serve's rounds until every request has stopped (its docstring and the module's say what one does)."""
    _fill(slots, queue, sink, stats, arriving)
    busy, captured = 0.0, runner.warmup_s + slots.prefill_warmup_s()  # capture inside the loop is not bookkeeping
    ahead = -1  # the longest length of the draft the last round proposed for this one (graphs.lookahead_allowed)
    fresh = True  # requests arrived since the last launch: the next round proposes afresh (they have no draft)
    pending: Launched | None = None  # a launched round the CPU has not committed yet
    while slots.in_flight() or pending is not None:
        start = time.perf_counter()
        packed = None
        # decided from finished rounds only (Verifier.draft_next); overlapped, from the rounds before the last
        drafting = K > 0 and bool(slots.in_flight()) and verifier.draft_next()
        if pending is not None and overlap == "ahead" and drafting:  # the launch needs the last round's copy
            packed = _wait(pending.copy, stats)  # (a plain round needs nothing from it: launched without the wait)
            ahead, slots.next_width = _carried(packed, K, fresh)
        launched = None
        if slots.in_flight():
            out, draft, L = runner(drafting, ahead if drafting and ahead >= 0 else None)
            # the round's device-to-host copy (the only one but in a round after an admission), and its confidences
            # for the log, taken before the next round's propose rewrites the draft buffers
            confidence = (draft.confidence.to(torch.float32, copy=True) if drafting and draft.confidence is not None
                          else None)
            launched = Launched(HostCopy(out), confidence, L, drafting, list(slots.request))
            fresh = False
        if overlap is None:  # in order: commit the round just launched
            pending, launched = launched, None
        if pending is not None:
            if packed is None:
                packed = _wait(pending.copy, stats)
                if overlap is None:  # in order: the next launch uses what this copy carries ("known": nothing)
                    ahead, slots.next_width = _carried(packed, K, fresh)
            _first_tokens(slots, arriving, sink, stats)
            done, committed, live, expected = _commit_round(slots, packed, pending, sink, stats.rounds, K)
            stats.in_flight.append(live)
            stats.widths.append(pending.L + 1)
            stats.drafted += pending.drafting
            verifier.after_round(slots=slots.capacity, rows=live, width=pending.L, drafted=pending.drafting,
                                 committed=committed, expected=expected if pending.drafting else None)
            _finish(slots, done, sink)
            if _fill(slots, queue, sink, stats, arriving):
                fresh, ahead = True, -1
            stats.rounds += 1
        pending = launched
        busy += time.perf_counter() - start
        if runner.warmup_s + slots.prefill_warmup_s() > stats.warmup_s:  # captured in this iteration: freeze that too
            stats.warmup_s = runner.warmup_s + slots.prefill_warmup_s()
            freeze()
    # widths and prefill shapes are captured as they are first used
    stats.graphs, stats.prefill_graphs = runner.graphs + slots.prefill_graphs(), slots.prefill_graphs()
    stats.warmup_s = runner.warmup_s + slots.prefill_warmup_s()
    stats.stage_s = runner.timer.seconds()
    if stats.stage_s and runner.timer.rounds:  # the timed rounds' mean over every round (captures left out)
        stats.stage_s = {k: v * stats.rounds / runner.timer.rounds for k, v in stats.stage_s.items()}
        captured = stats.warmup_s - captured
        stats.stage_s["bookkeeping"] = max(0.0, busy - captured - sum(stats.stage_s.values()))


def _carried(packed: torch.Tensor, K: int, fresh: bool) -> tuple[int, int]:
    """What a round's copy carries for the next launch: the longest length of the draft proposed at the end of the
    round (-1 = none, or `fresh`: arrivals since make it stale) and a lagged scheduler's bound on the next lengths."""
    return (-1 if fresh else int(packed[0, K + 1 + AHEAD])), int(packed[0, K + 1 + NEXT_WIDTH])


@dataclass
class Arrivals:
    """Requests admitted together, their first tokens on their way to the CPU (read before a round that holds them
    is committed, `_first_tokens`)."""

    copy: HostCopy  # (n, 2) first token, prefill logits finite
    slots: list[int]
    requests: list[Request]
    start: float  # when the admission began, capture excluded


def _fill(slots: Slots, queue: deque, sink: Sink, stats: EngineStats, arriving: list[Arrivals]) -> int:
    """Admit queued requests into free slots until none is free or the queue is empty, adding each group of
    arrivals to `arriving`; returns how many. Nothing here waits on the device, but for arrivals whose budget is
    their first token: they are read at once, so that they leave (and others enter) without a round for nobody."""
    admitted = 0
    while queue and slots.free():
        free = slots.free()[: len(queue)]
        requests = [queue.popleft() for _ in free]
        start, captured = time.perf_counter(), slots.prefill_warmup_s()
        first = slots.admit(free, requests)
        stats.admissions += 1
        admitted += len(requests)
        start += slots.prefill_warmup_s() - captured  # a prefill shape's first capture is warm-up, not latency
        arriving.append(Arrivals(HostCopy(first), free, requests, start))
        stats.admit_s += time.perf_counter() - start
        if any(r.limit <= 1 for r in requests):
            _first_tokens(slots, arriving, sink, stats)
    return admitted


def _wait(copy: HostCopy, stats: EngineStats) -> torch.Tensor:
    """copy.wait(), its blocked time added to stats.wait_s."""
    start = time.perf_counter()
    host = copy.wait()
    stats.wait_s += time.perf_counter() - start
    return host


def _first_tokens(slots: Slots, arriving: list[Arrivals], sink: Sink, stats: EngineStats) -> None:
    """Take the arrivals' first tokens (time to first token, stops, budgets), then forget them. Runs before a
    round that holds them is committed: a request that stopped at its first token then commits none of it."""
    for group in arriving:
        table = _wait(group.copy, stats).tolist()
        now = time.perf_counter()
        bad = [r.index for r, (_, finite) in zip(group.requests, table) if not finite]
        if bad:
            raise FloatingPointError(f"non-finite values (NaN/Inf) in host logits at prefill (before round 0) for "
                                     f"request(s) {bad}")
        done = []
        for s, r, (token, _) in zip(group.slots, group.requests, table):
            sink.ttft[r.index] = now - group.start
            sink.latency[r.index] = group.start  # admission time until the request finishes (see _finish)
            _, live, slots.remaining_cpu[s] = sink.take(r, [token], slots.remaining_cpu[s])
            if not live:
                done.append(s)
        _finish(slots, done, sink)
    arriving.clear()


def _finish(slots: Slots, done: list[int], sink: Sink) -> None:
    now = time.perf_counter()
    for r in slots.retire(done):
        sink.latency[r.index] = now - sink.latency[r.index]


def _commit_round(slots: Slots, packed: torch.Tensor, launched: Launched, sink: Sink, round_index: int,
                  K: int) -> tuple[list[int], int, int, float | None]:
    """Commit each live slot's tokens from the packed round output (C, K+1+COLUMNS); returns the slots that stopped,
    the tokens the live slots committed before budgets and stops cut them (accepted + 1 each), how many they were,
    and the drafts they expected to have accepted by their confidences (None: a drafter without confidences).
    A slot's row is its request's only if that request held the slot when the round was launched (`launched.
    requests`): under overlap a request that stopped in the round before, or one admitted since, is not in it.

    why plain Python lists here: per-element tensor indexing costs microseconds each, C of them per round, which
    on a GPU is the time of a whole captured round; the log's tensors are built once at the end (Sink.close)."""
    live_slots = [s for s, r in enumerate(slots.request) if r is not None and r is launched.requests[s]]
    table = packed.tolist()
    bad = [slots.request[s].index for s in live_slots if not table[s][K + 1 + FINITE]]
    if bad:
        raise FloatingPointError(f"non-finite (NaN/Inf) host or draft logits, or draft confidences outside [0, 1], "
                                 f"in round {round_index} for request(s) {bad}; no token of that round was accepted")
    rows, done, committed, expected = sink.rows, [], 0, 0
    for s in live_slots:
        row, request = table[s], slots.request[s]
        accepted = row[K + 1 + N_ACCEPTED]
        committed += accepted + 1
        expected = None if expected is None or row[K + 1 + EXPECTED] < 0 else expected + row[K + 1 + EXPECTED]
        before = slots.remaining_cpu[s]
        _, live, slots.remaining_cpu[s] = sink.take(request, row[: accepted + 1], before)
        slots.cache_len[s] += accepted + 1
        if row[K + 1 + SEQ_LEN] != slots.cache_len[s] + 1:  # the anchor is committed but not yet in the cache
            raise RuntimeError(
                f"round {round_index}: slot {s} (request {request.index}) holds {row[K + 1 + SEQ_LEN]} tokens on "
                f"the device but {slots.cache_len[s] + 1} by the round's output: the output was overwritten before "
                f"it was read (a graph replayed in between?) or a stage committed other counts than it reported")
        rows.append((request.index, slots.rounds_cpu[s], row[K + 1 + PROPOSED], row[K + 1 + VERIFIED], accepted,
                     before - slots.remaining_cpu[s]))
        slots.rounds_cpu[s] += 1
        if not live:
            done.append(s)
    if not launched.drafting:  # a plain round: no confidences (zeros in the log, see RoundLog.confidences)
        sink.confidence.append((None, live_slots))
    elif launched.confidence is not None:  # a device-side copy of the round's buffer, read back once at the end
        sink.confidence.append((launched.confidence, live_slots))
    sink.log.batch.append(len(live_slots))
    sink.log.time.append(time.perf_counter() - sink.t0)
    return done, committed, len(live_slots), None if expected is None else expected / EXPECTED_SCALE
