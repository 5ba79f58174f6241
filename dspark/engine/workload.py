"""The closed-loop workload runner: C requests in flight from a prompt list, as serving benchmarks run with a
maximum concurrency. A request enters as soon as one leaves (dspark.engine.serve); per request it records the time
to first token, the end-to-end latency and tokens/s, per round the number of requests in flight.

Shapes: n requests, C concurrency.
"""
from __future__ import annotations

from typing import Callable, TypeVar

import torch

from dspark.engine.sampling import SamplingConfig

T = TypeVar("T")

PROMPTS = [  # first turns of six MT-Bench questions (writing, roleplay, reasoning, math, coding, extraction)
    "Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural experiences and "
    "must-see attractions.",
    "Pretend yourself to be Elon Musk in all the following conversations. Speak like Elon Musk as much as possible. "
    "Why do we need to go to Mars?",
    "Imagine you are participating in a race with a group of people. If you have just overtaken the second person, "
    "what's your current position? Where is the person you just overtook?",
    "The vertices of a triangle are at points (0, 0), (-1, 1), and (3, 3). What is the area of the triangle?",
    "Implement a program to find the common elements in two arrays without using any extra data structures.",
    "Extract the following information from the presented texts: The name of the book, the author, the main "
    "character, the year of publication. Output in the format of \"main character, book, author, year of "
    "publication\", one book per line. a) In the realm of wizarding literature, a true standout is the work of "
    "J.K. Rowling. One of her books that left an indelible mark is 'Harry Potter and the Philosopher's Stone'.",
]


def run_workload(host, prompts: list[list[int]], *, concurrency: int, drafter=None, verifier=None,
                 draft_length: int = 7, max_new_tokens: int = 128, sampling: SamplingConfig = SamplingConfig(),
                 seed: int = 0, graphs: bool | None = None, timing: bool = False) -> dict:
    """Decode `prompts` keeping `concurrency` in flight; a JSON-ready summary with per-request rows."""
    from dspark.engine.decode import generate

    out = generate(host, prompts, drafter=drafter, verifier=verifier, draft_length=draft_length,
                   max_new_tokens=max_new_tokens, sampling=sampling, seed=seed, concurrency=concurrency,
                   graphs=graphs, timing=timing)
    accepted = out.log.column("accepted").float()
    in_flight = out.engine["in_flight"]
    C = max(1, min(concurrency, len(prompts)))
    # the queue runs dry at the last round that still had every slot busy
    dry = max((i for i, c in enumerate(in_flight) if c == C), default=-1) + 1
    requests = [{"ttft_s": t, "latency_s": s, "new_tokens": len(ids), "tokens_per_s": len(ids) / s if s > 0 else None}
                for t, s, ids in zip(out.ttft, out.latency, out.token_ids)]
    return {
        "concurrency": concurrency,
        "requests": len(prompts),
        "new_tokens": sum(len(t) for t in out.token_ids),
        "seconds": out.seconds,
        "tokens_per_s": sum(len(t) for t in out.token_ids) / out.seconds if out.seconds > 0 else None,
        "tau": float((accepted + 1).mean()) if len(accepted) else None,
        "rounds": out.rounds,
        "admissions": out.batches,
        "mean_in_flight": sum(in_flight) / len(in_flight) if in_flight else 0.0,
        "in_flight_until_dry": sum(in_flight[:dry]) / (C * dry) if dry else None,
        "ttft_s_mean": sum(out.ttft) / len(out.ttft),
        "latency_s_mean": sum(out.latency) / len(out.latency),
        "graphs": out.engine["graphs"],
        "prefill_graphs": out.engine["prefill_graphs"],
        "admit_s": out.engine["admit_s"],
        "gc_s": out.engine["gc_s"],  # Python's garbage collections inside the loop (dspark.engine.serve.quiet_gc)
        "gc_collections": out.engine["gc_collections"],
        "warmup_s": out.engine["warmup_s"],
        "stage_s": out.engine["stage_s"],
        "overlapped": out.engine["overlapped"],  # rounds launched before the last one was committed (CUDA)
        "in_flight": in_flight,
        "per_request": requests,
    }


def warm_up_prompts(prompts: list[list[int]], concurrency: int) -> list[list[int]]:
    """C of `prompts` for an untimed warm-up decode whose cache is the timed decode's: the longest first (the slot
    engine sizes its cache by the longest prompt plus the budget, so a warm-up on shorter prompts or a smaller
    budget leaves the timed decode to grow the allocator inside its window), then the first others."""
    longest = max(range(len(prompts)), key=lambda i: len(prompts[i]))
    return [prompts[longest]] + [p for i, p in enumerate(prompts) if i != longest][: concurrency - 1]


def warmed(decode: Callable[..., T]) -> Callable[..., T]:
    """`decode` (host, prompts, *, concurrency, max_new_tokens, ...) preceded, on CUDA, by an untimed decode of the
    same setting and cache: C requests (warm_up_prompts) with the same new-token budget. The first decode of a
    setting at a new C otherwise pays first-use costs (kernel selection, allocator growth, lazy inits) inside its
    timed window; the cache is sized by the longest prompt plus the budget, so a shorter warm-up leaves the timed
    decode to grow the allocator at its first admission (on the H100, 2026-12-07: plain decoding at C = 64 spent
    0.11 s admitting against 0.02 s for the setting timed after it, with an 8-token warm-up). The CUDA graphs it
    captures are per decode and already left out of the timing (their warm-up is subtracted). `dspark bench` and
    the experiment runners time their rows through it."""
    def run(host, prompts, *, concurrency: int, max_new_tokens: int, **kw) -> T:
        if torch.device(host.device).type == "cuda" and prompts:
            decode(host, warm_up_prompts(prompts, concurrency), concurrency=concurrency,
                   max_new_tokens=max_new_tokens, **kw)
        return decode(host, prompts, concurrency=concurrency, max_new_tokens=max_new_tokens, **kw)
    return run


def bench(host, prompts: list[list[int]], methods: dict, concurrencies: list[int], *, max_new_tokens: int = 128,
          **kwargs) -> list[dict]:
    """One run_workload row per (method, concurrency); methods maps a name to a drafter (None = plain); each row
    `warmed`."""
    rows = []
    for name, drafter in methods.items():
        for C in concurrencies:
            row = warmed(run_workload)(host, prompts, concurrency=C, drafter=drafter, max_new_tokens=max_new_tokens,
                                       **kwargs)
            rows.append({"method": name, **row})
    return rows
