"""Round runners: the three stages of dspark.engine.round run eagerly, or captured once as CUDA graphs and replayed.

On CUDA the verify and accept stages are always captured; the propose stage too when the drafter and the verifier
are tensor-only (`capturable`), else it runs eagerly and its output is copied into the captured graphs' inputs.
Capture happens while every slot is idle, so the warm-up rounds commit nothing. The graphs share one memory pool
and are replayed in capture order. With `timing`, CUDA events between the stages split each round's device time
into draft / verify / accept (read once at the end, no sync per round).
"""
from __future__ import annotations

import time

import torch

from dspark.engine.round import Draft, accept, propose, verify


class EagerRound:
    """The stages as plain calls (the CPU path, and the oracle of the captured one)."""

    graphs = 0
    warmup_s = 0.0

    def __init__(self, slots, host, drafter, verifier, K: int, *, timing: bool = False) -> None:
        self.slots, self.host, self.drafter, self.verifier, self.K = slots, host, drafter, verifier, K
        self.timer = StageTimer(timing and host.device.type == "cuda")

    def __call__(self) -> tuple[torch.Tensor, Draft]:
        self.timer.mark()
        draft = propose(self.slots, self.drafter, self.verifier, self.K)
        self.timer.mark()
        attend = max(self.slots.cache_len) + self.K + 1
        verified = verify(self.slots, self.host, draft, self.drafter.feature_layers, attend)
        self.timer.mark()
        out = accept(self.slots, self.drafter, draft, verified)
        self.timer.mark()
        return out, draft


class GraphRound:
    """The stages captured as CUDA graphs (one set per slot count C and draft length K)."""

    def __init__(self, slots, host, drafter, verifier, K: int, *, timing: bool = False, warmup: int = 2) -> None:
        if slots.in_flight():
            raise RuntimeError("capture the round while every slot is idle (warm-up rounds must commit nothing)")
        self.slots, self.host, self.drafter, self.verifier, self.K = slots, host, drafter, verifier, K
        self.timer = StageTimer(timing)
        self.whole = drafter.capturable and getattr(verifier, "capturable", False)
        taps = drafter.feature_layers
        start = time.perf_counter()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # why a side stream: kernels' lazy init stays out of the captured streams
            for _ in range(warmup):
                draft = propose(slots, drafter, verifier, K)
                accept(slots, drafter, draft, verify(slots, host, draft, taps, None))
        torch.cuda.current_stream().wait_stream(side)
        pool = torch.cuda.graph_pool_handle()
        self.g_propose = torch.cuda.CUDAGraph() if self.whole else None
        if self.whole:
            with torch.cuda.graph(self.g_propose, pool=pool):
                self.draft = propose(slots, drafter, verifier, K)
        else:  # static input buffers filled from the eager propose each round
            eager = propose(slots, drafter, verifier, K)
            self.draft = Draft(**{k: None if v is None else v.clone() for k, v in vars(eager).items()})
        self.g_verify, self.g_accept = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.g_verify, pool=pool):
            self.verified = verify(slots, host, self.draft, taps, None)
        with torch.cuda.graph(self.g_accept, pool=pool):
            self.out = accept(slots, drafter, self.draft, self.verified)
        torch.cuda.synchronize()
        self.graphs = 3 if self.whole else 2
        self.warmup_s = time.perf_counter() - start

    def __call__(self) -> tuple[torch.Tensor, Draft]:
        self.timer.mark()
        if self.whole:
            self.g_propose.replay()
        else:
            fresh = propose(self.slots, self.drafter, self.verifier, self.K)
            for name, buffer in vars(self.draft).items():
                if buffer is not None:
                    buffer.copy_(getattr(fresh, name))
        self.timer.mark()
        self.g_verify.replay()
        self.timer.mark()
        self.g_accept.replay()
        self.timer.mark()
        return self.out, self.draft


class StageTimer:
    """CUDA events at the stage boundaries of every round; `seconds()` sums draft / verify / accept at the end."""

    STAGES = ("draft", "verify", "accept")

    def __init__(self, enabled: bool) -> None:
        self.enabled, self.events = enabled, []

    def mark(self) -> None:
        if self.enabled:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.events.append(event)

    def seconds(self) -> dict[str, float]:
        if not self.events:
            return {}
        torch.cuda.synchronize()
        total = dict.fromkeys(self.STAGES, 0.0)
        n = len(self.STAGES) + 1
        for i in range(0, len(self.events) - n + 1, n):
            for j, stage in enumerate(self.STAGES):
                total[stage] += self.events[i + j].elapsed_time(self.events[i + j + 1]) / 1000
        return total


def round_runner(slots, host, drafter, verifier, K: int, *, graphs: bool | None = None, timing: bool = False):
    """GraphRound on CUDA (unless graphs=False), EagerRound otherwise."""
    use = host.device.type == "cuda" if graphs is None else graphs
    if use and host.device.type != "cuda":
        raise ValueError("CUDA graphs need the host on a CUDA device")
    cls = GraphRound if use else EagerRound
    return cls(slots, host, drafter, verifier, K, timing=timing)
