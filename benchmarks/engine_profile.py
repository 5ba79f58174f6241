"""Where a slot-engine round's wall time goes on the GPU: admission (prefill) vs round (replay, copy, commit).

    python benchmarks/engine_profile.py [--host random:smollm2] [--concurrency 1]

Times Slots.admit and each part of the serve loop with a device sync around it (so the parts add up), then prints
the top CUDA-time and CPU-time operators of one admission under torch.profiler. Diagnostic only.
"""
from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dspark.api import load_host  # noqa: E402
from dspark.engine import serve as serve_module  # noqa: E402
from dspark.engine.decode import generate  # noqa: E402
from dspark.engine.slots import Slots  # noqa: E402

TIMES: dict[str, float] = defaultdict(float)
COUNTS: dict[str, int] = defaultdict(int)


def timed(name, fn):
    def wrapper(*args, **kwargs):
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        torch.cuda.synchronize()
        TIMES[name] += time.perf_counter() - start
        COUNTS[name] += 1
        return out
    return wrapper


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--host", default="random:smollm2")
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--prompt-length", type=int, default=100)
    args = ap.parse_args()
    host = load_host(args.host, dtype="bfloat16", device="cuda")
    prompts = [list(range(3 + i, 3 + i + args.prompt_length + 7 * i)) for i in range(6)]
    generate(host, prompts, max_new_tokens=16, concurrency=args.concurrency)  # warm-up
    Slots.admit = timed("admit", Slots.admit)
    serve_module._commit_round = timed("commit", serve_module._commit_round)
    serve_module._fill = timed("fill (incl. admit)", serve_module._fill)
    out = generate(host, prompts, max_new_tokens=128, concurrency=args.concurrency, timing=True)
    rounds = out.rounds
    print(f"tok/s {out.stats['tokens_per_s']:.1f}  rounds {rounds}  seconds {out.seconds:.3f}")
    print("stage ms/round:", {k: round(1000 * v / rounds, 3) for k, v in out.engine["stage_s"].items()})
    for name, total in TIMES.items():
        print(f"{name:>20}: {COUNTS[name]:5d} calls, {1000 * total / max(1, COUNTS[name]):8.3f} ms each, "
              f"{total:.3f} s total")
    slots = Slots(host, __import__("dspark.engine.protocol", fromlist=["NoDrafter"]).NoDrafter(),
                  __import__("dspark.engine.protocol", fromlist=["VerifyAll"]).VerifyAll(), capacity=1,
                  max_len=400, sampling=out.log and __import__("dspark.engine.sampling", fromlist=["x"]).SamplingConfig())
    from dspark.engine.slots import Request

    req = [Request(index=0, prompt=prompts[0], limit=8, seed=0)]
    slots.admit([0], req)
    slots.retire([0])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        slots.admit([0], req)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=18, max_name_column_width=40))
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=10, max_name_column_width=40))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
