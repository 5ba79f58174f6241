"""How a timed decode feeds its requests to the slot engine, and the prompts it can take without a data set.

Two ways of loading the engine with C requests (DECODE_BACKENDS, by name): "continuous" keeps C in flight, a queued
request entering as soon as one stops (a closed loop, as serving benchmarks run with a maximum concurrency);
"static-batch" runs the prompts in successive static batches of C (a batch's finished requests are not replaced,
so the load falls inside a batch). `warmed` puts an untimed decode of the same cache in front of either on CUDA.
PROMPTS: six MT-Bench first turns, the built-in prompt set of `dspark bench`.

Shapes: n requests, C concurrency.
"""
from __future__ import annotations

from typing import Callable, TypeVar

import torch

from dspark.engine.decode import generate
from dspark.engine.results import GenerationResult
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


def continuous_decode(host, prompts, *, drafter, verifier, draft_length: int, concurrency: int,
                      max_new_tokens: int, sampling: SamplingConfig, seed: int,
                      timing: bool = False) -> GenerationResult:
    """Closed loop on the slot engine: `concurrency` requests in flight, a queued one entering as soon as one
    stops. `timing`: the device seconds of each round stage (CUDA events)."""
    return generate(host, prompts, drafter=drafter, verifier=verifier, draft_length=draft_length,
                    max_new_tokens=max_new_tokens, sampling=sampling, seed=seed, concurrency=concurrency,
                    timing=timing)


def static_batch_decode(host, prompts, *, drafter, verifier, draft_length: int, concurrency: int,
                        max_new_tokens: int, sampling: SamplingConfig, seed: int,
                        timing: bool = False) -> GenerationResult:
    """Static batches of `concurrency` requests: each batch is admitted at once and a request that stops early is
    not replaced (not continuous batching)."""
    return generate(host, prompts, drafter=drafter, verifier=verifier, draft_length=draft_length,
                    max_new_tokens=max_new_tokens, sampling=sampling, seed=seed, batch_size=concurrency,
                    timing=timing)


#: engine name -> decode function
DECODE_BACKENDS: dict[str, Callable[..., GenerationResult]] = {"continuous": continuous_decode,
                                                               "static-batch": static_batch_decode}


def backend(name: str) -> Callable[..., GenerationResult]:
    """The decode function of DECODE_BACKENDS named `name`."""
    if name not in DECODE_BACKENDS:
        raise ValueError(f"unknown engine {name!r}; choose one of {sorted(DECODE_BACKENDS)}")
    return DECODE_BACKENDS[name]


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
    decode to grow the allocator at its first admission, and whichever setting is timed first at a C pays for it.
    The CUDA graphs it captures are per decode and already left out of the timing (their warm-up is subtracted).
    dspark.sweep times every row through it."""
    def run(host, prompts, *, concurrency: int, max_new_tokens: int, **kw) -> T:
        if torch.device(host.device).type == "cuda" and prompts:
            decode(host, warm_up_prompts(prompts, concurrency), concurrency=concurrency,
                   max_new_tokens=max_new_tokens, **kw)
        return decode(host, prompts, concurrency=concurrency, max_new_tokens=max_new_tokens, **kw)
    return run
