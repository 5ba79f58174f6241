"""Prefill of arriving requests: one host forward over their prompts, run as called or replayed as a CUDA graph.

Shapes: n arrivals, N = n rounded up to a power of two (at most GRAPH_ROWS), P the prompt width (a multiple of the
slots' PREFILL_BUCKET), H hidden size, F host features, Tmax positions per slot.

why graphs here too: an eager SmolLM2 forward is launch-bound, several times slower than its replayed graph, and
under continuous batching every arrival is a prefill, so eager prefills would take a large share of a run's time at
moderate concurrency (benchmarks/results/engine-speed/ times the replayed admissions). Arrivals are padded
to N rows (dummy rows of one token, dropped after) so that a few (N, P) shapes serve every arrival; each shape is
captured the first time it is needed (its warm-up counted in `warmup_s`), into scratch buffers shared by all
shapes: a KV cache of GRAPH_ROWS rows, tokens and lengths. Prompts wider than GRAPH_PROMPT run as called.
The drafter's part of an admission (its begin, observe of the prompts' features, prefill) follows the same rule
where the drafter allows it (DrafterPrefill, Drafter.admit_capturable): scratch rows of its state per (N, P).

Modes: "eager" (a fresh cache, the step as called: the CPU and the oracle), "static" (the scratch buffers and padding
without capture: how the CPU tests check the graph path's bookkeeping) and "graph" (static, captured, replayed).
"""
from __future__ import annotations

import contextlib
import time

import torch

from dspark.engine.graphs import side_stream
from dspark.engine.kv_cache import KVCache
from dspark.engine.protocol import DraftState, graph_shapes

GRAPH_ROWS = 16  # arrivals per replay (more at once are prefilled as called, in one forward)
GRAPH_PROMPT = 1024  # widest prompt bucket that is captured


def _rows_bucket(n: int) -> int:
    return 1 << (n - 1).bit_length()


def capture(fn, device: torch.device, pool):
    """fn() run twice on a side stream (kernels' lazy initialisation stays out of the capture), then captured into
    a new CUDA graph sharing `pool` -> (the graph, fn's output: the tensors a replay rewrites)."""
    with side_stream(device):
        for _ in range(2):
            fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    torch.cuda.synchronize(device)
    return graph, out


class Prefill:
    """`__call__(tokens, plen)` -> (a cache holding the n prompts, the step's hidden (n, P, H), features or None)."""

    def __init__(self, host, *, max_len: int, taps: tuple[int, ...], mode: str = "eager") -> None:
        if mode not in ("eager", "static", "graph"):
            raise ValueError(f"prefill mode must be eager, static or graph, got {mode!r}")
        self.host, self.max_len, self.taps, self.mode = host, max_len, taps, mode
        # (N, P) -> (graph or None, tokens, lengths, scratch rows, captured output or None)
        self.shapes: dict[tuple[int, int], tuple] = {}
        self.scratch: KVCache | None = None
        self.pool = None
        self.graphs, self.warmup_s = 0, 0.0

    def __call__(self, tokens: torch.Tensor, plen: torch.Tensor):
        n, P = tokens.shape
        if self.mode == "eager" or n > GRAPH_ROWS or P > GRAPH_PROMPT:
            cache = self.host.new_cache(n, self.max_len)
            out = self.host.step(cache, tokens, plen, taps=self.taps, attend=P, compiled=False)
            cache.advance(plen)
            return cache, out.hidden, out.features
        N = _rows_bucket(n)
        if (N, P) not in self.shapes:
            self._prepare(N, P)
        graph, buf_tokens, buf_plen, cache, out = self.shapes[N, P]
        buf_tokens[:n].copy_(tokens)
        buf_tokens[n:].zero_()
        buf_plen[:n].copy_(plen)
        buf_plen[n:].fill_(1)  # dummy rows: one token each, never read
        cache.lengths.zero_()
        if graph is None:
            out = self._step(cache, buf_tokens, buf_plen, P)
        else:
            graph.replay()
        cache.advance(buf_plen)
        # the first n scratch rows (views: put_rows copies them out); clones: the next replay overwrites the outputs
        return cache.head(n), out.hidden[:n].clone(), None if out.features is None else out.features[:n].clone()

    def _step(self, cache, tokens, plen, P):
        return self.host.step(cache, tokens, plen, taps=self.taps, attend=P, compiled=False)

    def _prepare(self, N: int, P: int) -> None:
        """Static buffers for (N, P), captured as a CUDA graph in graph mode (warm-up on a side stream first). The
        warm-up clock starts once the device's queued work is done (a round launched before this admission): that
        work is the run's, not warm-up (graphs.GraphRound._clock)."""
        host, device = self.host, self.host.device
        if self.mode == "graph":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        if self.scratch is None:
            self.scratch = host.new_cache(GRAPH_ROWS, self.max_len)
        cache = self.scratch.head(N)  # views of the scratch rows this shape uses
        tokens = torch.zeros(N, P, dtype=torch.long, device=device)
        plen = torch.ones(N, dtype=torch.long, device=device)
        graph, out = None, None
        if self.mode == "graph":
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()

            def step():
                cache.lengths.zero_()
                return self._step(cache, tokens, plen, P)
            graph, out = capture(step, device, self.pool)
            self.graphs += 1
        self.shapes[N, P] = (graph, tokens, plen, cache, out)
        self.warmup_s += time.perf_counter() - start


def _rows(state, n: int):
    """The first n batch rows of a piece of drafter state (a KVCache or a batch-major tensor), as views."""
    return state.head(n) if isinstance(state, KVCache) else state[:n]


def _tensors(state) -> tuple[torch.Tensor, ...]:
    return (state.k, state.v, state.lengths) if isinstance(state, KVCache) else (state,)


@contextlib.contextmanager
def _borrowed(drafter):
    """The drafter with its per-batch state (`slot_state`) put back as it was on leaving: the very objects a
    captured round reads."""
    full = {name: getattr(drafter, name) for name in drafter.slot_state}
    try:
        yield drafter
    finally:
        for name, state in full.items():
            setattr(drafter, name, state)


class DrafterPrefill:
    """`__call__(features, plen, sub)` -> {name in `slot_state`: the n arrivals' rows of that state}: the drafter's
    part of an admission (begin, observe of the prompts, prefill) on the arrivals alone, which the slots then write
    into their rows. As called ("eager"), or, where the drafter allows it (`Drafter.admit_capturable`), on the
    first N rows of scratch state per (N, P) like the host's prefill: run so ("static", the CPU tests' check of the
    bookkeeping) or replayed as a CUDA graph ("graph").

    why: as called, every admission launches the drafter's kernels one by one, and an attention at a shape it has
    not run before pays its plan selection there (EAGLE-3's observe runs its layer over the prompts, so an
    admission as called costs it several times DSpark's); replayed, the
    arrivals' shapes are the host prefill's, each captured once and counted as warm-up. The scratch rows are zeroed
    before each use instead of begin's fresh allocation: the same state, which __init__ checks (begin's is zeros)."""

    def __init__(self, drafter, host, *, max_len: int, mode: str = "eager") -> None:
        if mode not in ("eager", "static", "graph"):
            raise ValueError(f"prefill mode must be eager, static or graph, got {mode!r}")
        self.drafter, self.host, self.max_len = drafter, host, max_len
        fast = bool(drafter.slot_state) and getattr(drafter, "admit_capturable", False)
        self.mode = mode if fast else "eager"
        # (N, P) -> (graph or None, features, n_valid, start, draft state: the static inputs, the scratch rows)
        self.shapes: dict[tuple[int, int], tuple] = {}
        self.scratch: dict | None = None
        self.pool = None
        self.graphs, self.warmup_s = 0, 0.0
        if self.mode != "eager":
            with _borrowed(drafter):
                drafter.begin(host=host, batch_size=GRAPH_ROWS, max_len=max_len)
                self.scratch = {name: getattr(drafter, name) for name in drafter.slot_state}
            if any(t.any() for state in self.scratch.values() for t in _tensors(state)):
                raise ValueError(f"drafter {drafter.name!r} declares admit_capturable, but its begin() state is not "
                                 "all zeros: its admission cannot zero scratch rows in place of begin")

    def __call__(self, features: torch.Tensor | None, plen: torch.Tensor, sub: DraftState) -> dict:
        n = len(plen)
        if self.mode == "eager" or features is None or n > GRAPH_ROWS or features.shape[1] > GRAPH_PROMPT:
            with _borrowed(self.drafter) as drafter:
                drafter.begin(host=self.host, batch_size=n, max_len=self.max_len)
                drafter.observe(features=features, start=torch.zeros_like(plen), n_valid=plen, state=sub)
                drafter.prefill(state=sub)
                return {name: getattr(drafter, name) for name in drafter.slot_state}
        N, P = _rows_bucket(n), features.shape[1]
        if (N, P) not in self.shapes:
            self._prepare(N, P, features, sub)
        graph, feats, n_valid, start, state, rows = self.shapes[N, P]
        # dummy rows (n..N): a one-token prompt of token 0 each, never read
        for buf, value, pad in ((feats, features, 0), (n_valid, plen, 1), (state.seq, sub.seq, 0),
                                (state.seq_len, sub.seq_len, 2), (state.seeds, sub.seeds, 0),
                                (state.rounds, sub.rounds, 0)):
            buf[:n].copy_(value)
            buf[n:].fill_(pad)
        if graph is None:
            self._run(rows, feats, n_valid, start, state)
        else:
            graph.replay()
        return {name: _rows(part, n) for name, part in rows.items()}

    def _run(self, rows: dict, feats, n_valid, start, state: DraftState) -> None:
        """begin (zeroed scratch rows), observe and prefill on the static inputs: what the graph captures."""
        with _borrowed(self.drafter) as drafter, graph_shapes():
            for name, part in rows.items():
                for t in _tensors(part):
                    t.zero_()
                setattr(drafter, name, part)
            drafter.observe(features=feats, start=start, n_valid=n_valid, state=state)
            drafter.prefill(state=state)

    def _prepare(self, N: int, P: int, features: torch.Tensor, sub: DraftState) -> None:
        """Static inputs for (N, P) and the scratch rows it uses, captured as a CUDA graph in graph mode (the
        clock as Prefill._prepare's)."""
        device = self.host.device
        if self.mode == "graph":
            torch.cuda.synchronize(device)
        clock = time.perf_counter()
        rows = {name: _rows(part, N) for name, part in self.scratch.items()}
        feats = torch.zeros(N, P, features.shape[2], dtype=features.dtype, device=device)
        n_valid = torch.ones(N, dtype=torch.long, device=device)
        start = torch.zeros(N, dtype=torch.long, device=device)
        state = DraftState(seq=torch.zeros(N, sub.seq.shape[1], dtype=torch.long, device=device),
                           seq_len=torch.full((N,), 2, dtype=torch.long, device=device),
                           seeds=torch.zeros(N, dtype=torch.long, device=device),
                           rounds=torch.zeros(N, dtype=torch.long, device=device), sampling=sub.sampling)
        graph = None
        if self.mode == "graph":
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            graph, _ = capture(lambda: self._run(rows, feats, n_valid, start, state), device, self.pool)
            self.graphs += 1
        self.shapes[N, P] = (graph, feats, n_valid, start, state, rows)
        self.warmup_s += time.perf_counter() - clock
