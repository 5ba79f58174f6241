"""Prefill of arriving requests: one host forward over their prompts, run as called or replayed as a CUDA graph.

Shapes: n arrivals, N = n rounded up to a power of two (at most GRAPH_ROWS), P the prompt width (a multiple of the
slots' PREFILL_BUCKET), H hidden size, F host features, Tmax positions per slot.

why graphs here too: on the H200 a SmolLM2 forward takes ~21 ms eagerly against ~3 ms replayed, and under continuous
batching every arrival is a prefill, so at concurrency 8 and 64 the eager prefills took a third of the run
(benchmarks/h200/speed.json: 1.0 and 2.4 ms of "bookkeeping" a round next to a 2.2 ms verify). Arrivals are padded
to N rows (dummy rows of one token, dropped after) so that a few (N, P) shapes serve every arrival; each shape is
captured the first time it is needed (its warm-up counted in `warmup_s`), into scratch buffers shared by all
shapes: a KV cache of GRAPH_ROWS rows, tokens and lengths. Prompts wider than GRAPH_PROMPT run as called.

Modes: "eager" (a fresh cache, the step as called: the CPU and the oracle), "static" (the scratch buffers and padding
without capture: how the CPU tests check the graph path's bookkeeping) and "graph" (static, captured, replayed).
"""
from __future__ import annotations

import time

import torch

from dspark.engine.kv_cache import KVCache

GRAPH_ROWS = 16  # arrivals per replay (more at once are prefilled as called, in one forward)
GRAPH_PROMPT = 1024  # widest prompt bucket that is captured


def _rows_bucket(n: int) -> int:
    return 1 << (n - 1).bit_length()


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
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):  # kernels' lazy initialisation stays out of the capture
                for _ in range(2):
                    cache.lengths.zero_()
                    self._step(cache, tokens, plen, P)
            torch.cuda.current_stream(device).wait_stream(side)
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            cache.lengths.zero_()
            with torch.cuda.graph(graph, pool=self.pool):
                out = self._step(cache, tokens, plen, P)
            torch.cuda.synchronize(device)
            self.graphs += 1
        self.shapes[N, P] = (graph, tokens, plen, cache, out)
        self.warmup_s += time.perf_counter() - start
