"""Round runners: the three stages of dspark.engine.round run eagerly, or captured as CUDA graphs and replayed.

On CUDA the verify and accept stages are always captured, one pair per verify width (`width_bucket`), each
captured lazily the first time a round needs that width; the propose stage too (once, at the start, while every
slot is idle) when the drafter and the verifier are tensor-only (`capturable`), else it runs eagerly and its output
is copied into the captured graphs' inputs. A width captured mid-run is warmed up and captured with every slot
paused (`active` cleared for the capture): paused slots commit nothing, exactly as idle ones, and what the warm-up
writes past a slot's committed end (host and drafter cache rows, seq) is rewritten by the real round before
anything reads it. Verify and accept share one memory pool: every graph's outputs stay referenced, so a later
capture never places its temporaries in them, but a graph captured later may place its outputs in an earlier one's
temporaries; that is safe while no graph replays between a graph and the reading of its outputs. A round replays
verify, then accept, and its packed output is read after the lookahead's propose: so the propose graph has a pool
of its own (sharing one, its replay can overwrite the packed output before the copy reads it: the CPU then commits
other counts than the device did). With `timing`, CUDA events between the stages
split each round's time on the device into draft / verify / accept (read once at the end, no sync per round).

Lookahead (`lookahead_allowed`): where the verify width depends on device values, a round ends by proposing the
next round's draft (the propose graph replayed once more) and writes its longest length into the round's copy.

Backlog (`defers_observe`): under a draft gate, a plain round of a drafter that may observe positions later keeps
its features in the slots' backlog (its own width-0 accept graph), and the drafter observes them before the next
drafted round or when the backlog is full (a flush graph per number of verify widths it spans).

Fixed shapes: every warm-up of a graph, its recording and (capture off) every re-run of it run inside
protocol.graph_shapes, so a drafter with an eager path and a capturable one (protocol.fixed_shapes) runs its
capturable one there: a warm-up must compile and touch exactly what the capture will (a torch.compile recompile
inside a capture fails). The context lives in the engine core (protocol.py), which drafters import: the engine
never imports a drafter.
"""
from __future__ import annotations

import contextlib
import time

import torch

from dspark.engine.protocol import graph_shapes
from dspark.engine.round import AHEAD, Draft, accept, backlog_rounds, drafts_to_verify, \
    flush_observe, no_draft, propose, verify, width_bucket, width_on_cpu


#: devices where runners propose ahead: where a device read stalls the host (CUDA). On the CPU a read costs
#: nothing, while a draft proposed ahead is wasted whenever an admission follows (the arrivals need a fresh one)
LOOKAHEAD_DEVICES = ("cuda",)


def lookahead_allowed(verifier) -> bool:
    """Whether a runner may propose the next round's draft at the end of a drafted round, after its commit: the
    verifier's lengths depend on the draft alone (`capturable`: no Python state), so that draft is exactly the one
    the next round would make at its start. Nothing happens in between but the CPU's commit, retirements and
    admissions (after which the runner proposes afresh). A retired slot's row can only widen the forward of a
    verifier that decides each row alone (verify-all, the threshold), never change a token; the scheduler picks one
    width over all rows, so a row retired since may change that width, and so which drafts of the other rows are
    verified: still decided from the drafts alone, never from their verification (lossless), though not the width a
    fresh propose would pick (greedy tokens are the same either way). A verifier with a draft gate (`draft_next`,
    the schedulers) may make the next round a plain one: that round overwrites the draft unused (no_draft) and its
    copy carries AHEAD = -1, so the next drafted round proposes afresh; a gate that stops drafting wastes one
    propose. why: when the verify width depends on device values (n-gram lengths, the threshold, the scheduler's
    widths), the draft's longest length then rides in this round's copy, and the next round needs no device read of
    its own: one device-to-host copy per round."""
    return getattr(verifier, "capturable", False)


def defers_observe(drafter, verifier, K: int) -> bool:
    """Whether the plain rounds of a gated verifier (`Verifier.gates_drafts`) leave the drafter's observe to the
    next drafted round (round.accept(defer=True), round.flush_observe), for a drafter that may observe positions
    later and many at once (`Drafter.observe_batched`). why: a gate that stops drafting keeps the drafter's cache
    up to date every plain round, which makes its accept stage several times plain decoding's (a visible share of
    a plain round at low load; benchmarks/results/engine-speed/ splits a round by stage); one observe of the
    backlog reads the drafter's weights once for up to BACKLOG_CHUNKS x (K + 1) rounds. Greedy tokens are those of
    per-round observes (the same positions from the same features; the drafts may differ by the rounding of a wider
    matrix product)."""
    return K > 0 and getattr(drafter, "observe_batched", False) and getattr(verifier, "gates_drafts", False)


class Backlog:
    """A runner's count of the plain rounds whose features wait in the slots' backlog (defers_observe)."""

    def __init__(self, slots, drafter, verifier, K: int) -> None:
        self.on, self.rounds, self.full, self.K = defers_observe(drafter, verifier, K), 0, backlog_rounds(K), K
        if self.on:
            slots.keep_backlog(self.full)

    def due(self, drafting: bool) -> bool:
        """Whether the backlog is observed before this round: a drafted round proposes from the drafter's whole
        context, and a plain round needs a free backlog row."""
        return self.rounds > 0 and (drafting or self.rounds == self.full)

    def take(self) -> int:
        """The verify widths (K + 1 positions) the pending rounds span, for flush_observe; the count starts over."""
        chunks, self.rounds = -(-self.rounds // (self.K + 1)), 0
        return chunks


class EagerRound:
    """The stages as plain calls (the CPU path, and the oracle of the captured one)."""

    graphs = 0
    warmup_s = 0.0

    def __init__(self, slots, host, drafter, verifier, K: int, *, timing: bool = False) -> None:
        self.slots, self.host, self.drafter, self.verifier, self.K = slots, host, drafter, verifier, K
        self.timer = StageTimer(timing and host.device.type == "cuda")
        self.lookahead = lookahead_allowed(verifier) and host.device.type in LOOKAHEAD_DEVICES
        self.ahead: Draft | None = None  # the next round's draft, proposed at the end of the last round
        self.slack = 0  # positions the caches may hold beyond the CPU's lengths (serve.overlap_allowed: K + 1)
        self.backlog = Backlog(slots, drafter, verifier, K)

    def known_width(self) -> int | None:
        """The drafter's longest proposal as the CPU knows it without a device read (Draft.width), None = only the
        device knows; from a propose on the idle slots (which commits nothing, as GraphRound's warm-ups)."""
        return propose(self.slots, self.drafter, self.verifier, self.K).width

    def __call__(self, drafting: bool = True, ahead: int | None = None) -> tuple[torch.Tensor, Draft, int]:
        """One round: (packed output, draft, L the drafts per row of its verify forward); drafting False is a plain
        round (no draft forward, nothing verified). `ahead`: the longest length of the draft proposed at the end of
        the last round (its copy's AHEAD column), which this round then verifies; None = propose now."""
        self.timer.mark(start=True)
        if self.backlog.due(drafting):
            flush_observe(self.slots, self.drafter, self.K, self.backlog.take())
        defer = self.backlog.on and not drafting
        if not drafting:
            draft, L = no_draft(self.slots, self.K), 0
        elif ahead is not None:
            draft, L = self.ahead, width_bucket(ahead, self.K)
        else:
            draft = propose(self.slots, self.drafter, self.verifier, self.K)
            L = drafts_to_verify(self.slots, self.verifier, draft, self.K)
        self.timer.mark()
        attend = max(self.slots.cache_len) + L + 1 + self.slack
        verified = verify(self.slots, self.host, draft, L, self.drafter.feature_layers, attend)
        self.timer.mark()
        out = accept(self.slots, self.drafter, draft, verified, defer=defer)
        self.backlog.rounds += defer
        self.timer.mark()
        if drafting and self.lookahead and width_on_cpu(self.slots, self.verifier, draft, self.K) is None:
            self.ahead = propose(self.slots, self.drafter, self.verifier, self.K)
            out[:, self.K + 1 + AHEAD] = self.ahead.ell.max()
        self.timer.mark()
        return out, draft, L


class GraphRound:
    """The stages captured as CUDA graphs: propose once (or eager), verify and accept once per width bucket L."""

    def __init__(self, slots, host, drafter, verifier, K: int, *, timing: bool = False, warmup: int = 2,
                 capture: bool = True) -> None:
        """capture False ("static" rounds): the same buffers, warm-ups, mid-run captures and lookahead, but every
        graph is its function run again and its outputs copied into the first run's buffers: the CPU tests' view
        of this class (a replay and a re-run differ only where a value was frozen at capture)."""
        if slots.in_flight():
            raise RuntimeError("capture the round while every slot is idle (warm-up rounds must commit nothing)")
        self.slots, self.host, self.drafter, self.verifier, self.K = slots, host, drafter, verifier, K
        self.capture = capture
        self.timer, self.warmup = StageTimer(timing and capture), warmup
        # plain decoding (K = 0) never proposes: nothing to capture there
        self.whole = K > 0 and drafter.capturable and getattr(verifier, "capturable", False)
        start = self._clock()
        # fixed shapes for a captured propose only: otherwise it runs eagerly every round, as it does here
        self._warm_up(lambda: propose(slots, drafter, verifier, K), fixed=self.whole)
        self.pool = torch.cuda.graph_pool_handle() if capture else None  # verify and accept (module docstring)
        if self.whole:  # a capturable drafter has no Python branching on values: its `width` is the same every round
            own = torch.cuda.graph_pool_handle() if capture else None
            self.g_propose, self.draft = self._record(lambda: propose(slots, drafter, verifier, K), pool=own)
        else:  # static input buffers filled from the eager propose each round
            self.g_propose = None
            eager = propose(slots, drafter, verifier, K)
            self.draft = Draft(**{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in vars(eager).items()})
        self.captured_width = self.draft.width
        self._synchronize()
        verifier.begin(batch_size=slots.capacity)  # the idle warm-up rounds leave no history (lagged scheduler)
        # (L, deferring) -> (verify graph, accept graph, packed output, its input); deferring: a plain round that
        # leaves the drafter's observe to the backlog (defers_observe)
        self.widths: dict[tuple[int, bool], tuple] = {}
        self.backlog = Backlog(slots, drafter, verifier, K)
        self.g_flush: dict[int, object] = {}  # verify widths of backlog observed -> its graph (_flush)
        self.graphs = 1 if self.whole else 0
        self.warmup_s = time.perf_counter() - start
        self.lookahead = lookahead_allowed(verifier)

    def known_width(self) -> int | None:
        """As EagerRound.known_width: the width of the draft proposed at capture (a capturable drafter's is the
        same every round; another's, from its propose before the first round)."""
        return self.captured_width

    def _record(self, fn, pool=None):
        """(replay, outputs): fn captured as a CUDA graph in `pool` (default: the verify and accept pool), or
        (static) fn itself, re-run on replay with its fresh outputs copied into the first run's. Either way fn runs
        inside graph_shapes, as a replay replays what the capture ran."""
        fn = graph_shapes()(fn)  # a contextmanager is also a decorator: every call runs in a fresh block
        if not self.capture:
            out = fn()
            return (lambda: _copy_into(out, fn())), out
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool if pool is None else pool):
            out = fn()
        return graph, out

    def _warm_up(self, fn, *, fixed: bool = True) -> None:
        """fn run `warmup` times before its capture: on a side stream (kernels' lazy initialisation stays out of
        the captured streams) and, `fixed`, inside graph_shapes (the shapes the capture will run: module docstring,
        Fixed shapes)."""
        with self._side_stream(), (graph_shapes() if fixed else contextlib.nullcontext()):
            for _ in range(self.warmup):
                fn()

    def _side_stream(self):
        return side_stream() if self.capture else contextlib.nullcontext()

    def _synchronize(self) -> None:
        if self.capture:
            torch.cuda.synchronize()

    def _clock(self) -> float:
        """The clock at the start of a warm-up or capture, once the device's queued work is done. why: that work
        (an admission's prefill, the last round) is the run's, and the capture's closing synchronize would wait for
        it inside the warm-up window, which the run's seconds leave out: at a high concurrency plain decoding's
        first capture would absorb every prompt's prefill as warm-up, and every setting whose first round reads
        the device before capturing would look slower by it."""
        self._synchronize()
        return time.perf_counter()

    def _propose(self) -> None:
        """This round's draft into the static buffers: the propose graph replayed, or run eagerly and copied."""
        if self.whole:
            _replay(self.g_propose)
            self.draft.width = self.captured_width  # a plain round set it to 0
        else:
            fresh = propose(self.slots, self.drafter, self.verifier, self.K)
            for name, buffer in vars(self.draft).items():
                if isinstance(buffer, torch.Tensor):
                    buffer.copy_(getattr(fresh, name))
            self.draft.width = fresh.width

    def __call__(self, drafting: bool = True, ahead: int | None = None) -> tuple[torch.Tensor, Draft, int]:
        """As EagerRound.__call__; with `ahead` the buffers already hold this round's draft (lookahead)."""
        self.timer.mark(start=True)
        if self.backlog.due(drafting):
            self._flush()
        defer = self.backlog.on and not drafting
        if not drafting:  # a plain round: the width-0 graphs over a draft that proposes nothing
            no_draft(self.slots, self.K, self.draft)
            L = 0
        elif ahead is not None:
            L = width_bucket(ahead, self.K)
        else:
            self._propose()
            L = drafts_to_verify(self.slots, self.verifier, self.draft, self.K)
        if (L, defer) not in self.widths:
            self._capture(L, defer)
            self.timer.discard()
        g_verify, g_accept, out, _ = self.widths[L, defer]
        self.timer.mark()
        _replay(g_verify)
        self.timer.mark()
        _replay(g_accept)
        self.backlog.rounds += defer
        self.timer.mark()
        used = self.draft
        if drafting and self.lookahead and width_on_cpu(self.slots, self.verifier, self.draft, self.K) is None:
            if self.draft.confidence is not None:  # the round log reads this round's confidences after the copy
                used = Draft(**{**vars(self.draft), "confidence": self.draft.confidence.clone()})
            self._propose()
            out[:, self.K + 1 + AHEAD] = self.draft.ell.max()
        self.timer.mark()
        return out, used, L

    def _capture(self, L: int, defer: bool) -> None:
        """Warm up and capture verify and accept at L drafts per row, every slot paused (they commit nothing)."""
        start, slots, taps = self._clock(), self.slots, self.drafter.feature_layers
        active = slots.active.clone()
        slots.active.zero_()
        try:
            self._warm_up(lambda: accept(slots, self.drafter, self.draft,
                                         verify(slots, self.host, self.draft, L, taps, None), defer=defer))
            g_verify, verified = self._record(lambda: verify(slots, self.host, self.draft, L, taps, None))
            g_accept, out = self._record(lambda: accept(slots, self.drafter, self.draft, verified, defer=defer))
        finally:
            slots.active.copy_(active)
        self._synchronize()
        self.widths[L, defer] = (g_verify, g_accept, out, verified)  # verified: kept alive, accept reads it
        self.graphs += 2
        self.warmup_s += time.perf_counter() - start

    def _flush(self) -> None:
        """The backlog observed (round.flush_observe: one observe over the verify widths the pending rounds span,
        one graph per count up to BACKLOG_CHUNKS), each captured at its first use with every slot paused as _capture
        does: a paused slot observes nothing at its end, and its pending count is restored before the real replay."""
        slots, chunks = self.slots, self.backlog.take()
        if chunks not in self.g_flush:
            start, active, pending = self._clock(), slots.active.clone(), slots.backlog_n.clone()
            slots.active.zero_()

            def flush():
                flush_observe(slots, self.drafter, self.K, chunks)
                return slots.backlog_n
            try:
                self._warm_up(flush)
                self.g_flush[chunks], _ = self._record(flush)
            finally:
                slots.active.copy_(active)
                slots.backlog_n.copy_(pending)
            self._synchronize()
            self.graphs += 1
            self.warmup_s += time.perf_counter() - start
            self.timer.discard()
        _replay(self.g_flush[chunks])


def _replay(graph) -> None:
    """A captured graph's replay, or a static round's re-run (GraphRound._record)."""
    if isinstance(graph, torch.cuda.CUDAGraph):
        graph.replay()
    else:
        graph()


def _copy_into(buffers, fresh) -> None:
    """Copy a re-run's outputs (a tensor, Draft or Verified) into the first run's, as a replay would leave them."""
    if isinstance(buffers, torch.Tensor):
        buffers.copy_(fresh)
        return
    for name, buffer in vars(buffers).items():
        if isinstance(buffer, torch.Tensor):
            buffer.copy_(getattr(fresh, name))


@contextlib.contextmanager
def side_stream(device: torch.device | None = None):
    """Run a block on a fresh side stream of `device` (None: the current one), ordered after and before its current
    stream's work (the warm-ups before a capture: here and dspark.engine.prefill.capture)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        yield
    torch.cuda.current_stream(device).wait_stream(side)


class StageTimer:
    """CUDA events at the stage boundaries of every round; `seconds()` sums draft / verify / accept at the end (the
    next round's draft made at the end of a round, lookahead, counts as draft) over the `rounds` it timed: a round
    that captured a graph is left out (`discard`), its capture is warm-up, not a stage."""

    STAGES = ("draft", "verify", "accept", "lookahead")

    def __init__(self, enabled: bool) -> None:
        self.enabled, self.events, self.skipping = enabled, [], False

    @property
    def rounds(self) -> int:
        return len(self.events) // (len(self.STAGES) + 1)

    def mark(self, start: bool = False) -> None:
        """An event at a stage boundary; `start` opens a round (and ends the skipping of a discarded one)."""
        if start:
            self.skipping = False
        if self.enabled and not self.skipping:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.events.append(event)

    def discard(self) -> None:
        """Leave this round out: drop its events so far and record none until the next round starts."""
        if self.enabled and not self.skipping:
            del self.events[len(self.events) - len(self.events) % (len(self.STAGES) + 1):]
        self.skipping = True

    def seconds(self) -> dict[str, float]:
        if not self.events:
            return {}
        torch.cuda.synchronize()
        total = dict.fromkeys(self.STAGES, 0.0)
        n = len(self.STAGES) + 1
        for i in range(0, len(self.events) - n + 1, n):
            for j, stage in enumerate(self.STAGES):
                total[stage] += self.events[i + j].elapsed_time(self.events[i + j + 1]) / 1000
        total["draft"] += total.pop("lookahead")
        return total


def round_runner(slots, host, drafter, verifier, K: int, *, graphs: bool | str | None = None, timing: bool = False):
    """GraphRound on CUDA (unless graphs=False), EagerRound otherwise; graphs="static" is GraphRound without
    capture, on any device (its re-run rounds: how the CPU tests check the captured path's bookkeeping)."""
    if graphs == "static":
        return GraphRound(slots, host, drafter, verifier, K, timing=timing, capture=False)
    use = host.device.type == "cuda" if graphs is None else graphs
    if use and host.device.type != "cuda":
        raise ValueError("CUDA graphs need the host on a CUDA device")
    cls = GraphRound if use else EagerRound
    return cls(slots, host, drafter, verifier, K, timing=timing)
