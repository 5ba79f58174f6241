"""Where the CPU's time goes in one decode: the serve loop under cProfile and, on CUDA, the CUDA runtime calls the
CPU blocked in (torch.profiler), for plain decoding and one (drafter, policy) on the same prompts.

    python benchmarks/loop_profile.py --host smollm2 --drafter ngram --policy scheduler --cost-table cost.json \\
        --concurrency 512 --num-prompts 32 --new 128 --out-dir DIR
    python benchmarks/loop_profile.py --device cpu --host random:tiny-llama --drafter ngram --policy full \\
        --concurrency 2 --num-prompts 4 --new 4 --out-dir /tmp/lp      # CPU smoke

Per method: an untimed decode (first-use costs), then the same decode under cProfile (functions by their own
time), then, on CUDA, under torch.profiler (seconds in each blocking runtime call: cudaEventSynchronize,
cudaMemcpyAsync, cudaStreamSynchronize, cudaDeviceSynchronize, with counts). Each decode's seconds, rounds and
engine stats (dspark.sweep.engine_stats) come with them. Writes DIR/loop_profile.json and prints the tables.

why a script of its own next to round_profile.py (the device's kernels per stage): a difference in the loop's own
time or in where it waits does not show in a kernel census: work queued ahead of a read (an admission's prefill
before a probe round's width read, or before a capture: dspark.engine.graphs.GraphRound._clock) shows only as time
blocked in the runtime calls.
"""
from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dspark.api import load_host  # noqa: E402
from dspark.engine.decode import generate  # noqa: E402
from dspark.engine.workload import warm_up_prompts  # noqa: E402
from dspark.sweep import build_policy, engine_stats  # noqa: E402
from experiments.common import build_drafters, load_prompts, sampling_config  # noqa: E402

#: CUDA runtime calls in which the CPU waits for the device
BLOCKING = ("cudaEventSynchronize", "cudaMemcpyAsync", "cudaStreamSynchronize", "cudaDeviceSynchronize",
            "Command Buffer Full")


def top_functions(profile: cProfile.Profile, n: int) -> list[dict]:
    """The n functions with the most own time: name, calls, own and cumulative seconds."""
    stats = pstats.Stats(profile).stats  # {(file, line, name): (calls, primitive calls, own, cumulative, callers)}
    rows = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)[:n]
    return [{"function": f"{Path(file).name}:{line}({name})" if line else name, "calls": calls,
             "own_s": round(own, 4), "cumulative_s": round(cum, 4)}
            for (file, line, name), (_, calls, own, cum, _) in rows]


def blocking_calls(decode) -> dict:
    """{runtime call: [count, CPU seconds]} for the blocking CUDA runtime calls of one decode."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        decode()
    out = {}
    for event in prof.key_averages():
        if event.key in BLOCKING:
            out[event.key] = [event.count, round(event.cpu_time_total / 1e6, 4)]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="smollm2")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run (cProfile only)")
    ap.add_argument("--compile", choices=["on", "off"], default="off")
    ap.add_argument("--drafter", default="ngram")
    ap.add_argument("--drafter-path", default=None, help="a trained drafter's save_pretrained folder")
    ap.add_argument("--policy", default="scheduler", help="full, threshold, scheduler, lagged")
    ap.add_argument("--cost-table", default=None, help="SPS(B) JSON (dspark profile): scheduler and lagged need one")
    ap.add_argument("--draft-length", type=int, default=7)
    ap.add_argument("--concurrency", type=int, default=512)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--new", type=int, default=128, help="new tokens per request")
    ap.add_argument("--top", type=int, default=20, help="functions listed per method")
    ap.add_argument("--out-dir", type=Path, required=True)
    args = ap.parse_args(argv)
    if args.policy in ("scheduler", "lagged") and args.cost_table is None:
        ap.error(f"--policy {args.policy} needs --cost-table (an SPS(B) table from `dspark profile`)")
    from verifiers.cost_model import CostModel

    dtype = "bfloat16" if args.device == "cuda" else "float32"
    host = load_host(args.host, dtype=dtype, device=args.device, compile=args.compile == "on")
    prompts = load_prompts(host, "sharegpt", args.num_prompts, seed=0)
    batch = [prompts[i % len(prompts)] for i in range(max(args.concurrency, len(prompts)))]
    cost = None if args.cost_table is None else CostModel.load(args.cost_table)
    paths = {} if args.drafter_path is None else {args.drafter: args.drafter_path}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # a drafter without a checkpoint is random by intent
        drafter = build_drafters(host, [args.drafter], paths, [args.draft_length])[(args.drafter, args.draft_length)]
    methods = {"plain": (None, lambda: None, 0),
               f"{args.drafter}/{args.policy}": (drafter, lambda: build_policy(
                   host, args.policy, draft_length=args.draft_length, path=args.drafter_path, cost=cost),
                   args.draft_length)}
    result = {"command": "python benchmarks/loop_profile.py " + " ".join(argv or sys.argv[1:]),
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__,
              "gpu": torch.cuda.get_device_name() if args.device == "cuda" else "none", "rows": []}
    for name, (d, verifier, K) in methods.items():
        def decode(prompts=batch, new=args.new):
            return generate(host, prompts, drafter=d, verifier=verifier(), draft_length=K, max_new_tokens=new,
                            sampling=sampling_config(0.0), seed=0, concurrency=args.concurrency)
        decode(warm_up_prompts(batch, args.concurrency))  # first-use costs (and the cache's growth) out of the profile
        profile = cProfile.Profile()
        profile.enable()
        out = decode()
        profile.disable()
        row = {"method": name, "seconds": out.seconds, "rounds": out.rounds, "engine_stats": engine_stats(out),
               "top": top_functions(profile, args.top),
               "blocking": blocking_calls(decode) if args.device == "cuda" else {}}
        result["rows"].append(row)
        print(f"== {name}: {out.seconds:.3f} s, {out.rounds} rounds, blocked {row['blocking']}")
        for f in row["top"][:10]:
            print(f"   {f['own_s']:8.4f} s own {f['cumulative_s']:8.4f} s cum {f['calls']:7d}x {f['function']}")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "loop_profile.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
