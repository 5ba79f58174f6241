"""The split argmax against torch's, compiled and replayed as CUDA graphs: why `dspark.engine.sampling.argmax` exists.

    python benchmarks/argmax_split.py --out-dir DIR [--vocab 151936 49152 32000] [--rows 1 8 64 512] [--dtype bfloat16]

For each vocabulary size V and number of rows B, on one tensor (B, V) and a bias of the same shape (float32, as the
engine's logits, unless --dtype says otherwise): torch's `x.argmax(-1)` and the engine's two-stage `argmax(x)`,
alone and fused behind an add (`argmax(u + bias)`, DSpark's Markov step), each through torch.compile and, on CUDA,
captured in a CUDA graph of --calls calls and replayed: microseconds per call (the median over --repeats replays)
and whether both gave the same indices. On the CPU (`--device cpu`, a smoke test) the calls run eagerly, timed with
perf_counter. Writes DIR/argmax_split.json and DIR/argmax_split.md with the machine, versions, command and date.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dspark.engine.sampling import argmax  # noqa: E402
from dspark.metrics import markdown_table  # noqa: E402
from dspark.quickstart import environment  # noqa: E402
from verifiers.cost_model import _runner, _timed  # noqa: E402

VARIANTS = {
    "argmax": (lambda x, b: x.argmax(-1), lambda x, b: argmax(x)),
    "add+argmax": (lambda x, b: (x + b).argmax(-1), lambda x, b: argmax(x + b)),
}


def time_calls(fn, x, bias, *, calls: int, repeats: int) -> tuple[float, torch.Tensor]:
    """Microseconds per call of fn(x, bias) (the median over repeats) and its result. The calls run `calls` in a row,
    so that one replay's launch (or one timing's overhead) is spread over them; on CUDA they are captured once as a
    CUDA graph (verifiers.cost_model's capture, as `dspark profile` times steps) and timed with CUDA events."""
    out = fn(x, bias)

    def run() -> None:
        for _ in range(calls):
            fn(x, bias)

    if x.device.type != "cuda":
        return 1e6 * statistics.median(_timed(run, x.device, warmup=0, repeats=repeats)) / calls, out
    replay = _runner(run, x.device, "graph", warmup=3)
    replay()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ms = []
    for _ in range(repeats):
        begin.record()
        replay()
        end.record()
        end.synchronize()
        ms.append(begin.elapsed_time(end) / calls)
    return 1e3 * statistics.median(ms), out


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("--vocab", type=int, nargs="+", default=[151936, 49152, 32000])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 512])
    parser.add_argument("--calls", type=int, default=20, help="calls per captured graph (per timing on the CPU)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="of the logits: the engine's are float32 (host and drafters cast theirs)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    for limit in ("recompile_limit", "cache_size_limit"):  # one compile per (variant, shape): above dynamo's 8
        if hasattr(torch._dynamo.config, limit):
            setattr(torch._dynamo.config, limit, 1024)
    dtype = getattr(torch, args.dtype)
    compiled = {name: tuple(torch.compile(f, dynamic=False) if device.type == "cuda" else f for f in pair)
                for name, pair in VARIANTS.items()}
    rows = []
    for vocab in args.vocab:
        for batch in args.rows:
            g = torch.Generator(device=device).manual_seed(vocab + batch)
            x = torch.randn(batch, vocab, generator=g, device=device).to(dtype)
            bias = torch.randn(batch, vocab, generator=g, device=device).to(dtype)
            for name, (torch_fn, split_fn) in compiled.items():
                torch_us, a = time_calls(torch_fn, x, bias, calls=args.calls, repeats=args.repeats)
                split_us, b = time_calls(split_fn, x, bias, calls=args.calls, repeats=args.repeats)
                rows.append({"variant": name, "vocab": vocab, "rows": batch, "torch_us": torch_us,
                             "split_us": split_us, "speedup": torch_us / split_us, "same": bool(torch.equal(a, b))})
                print(f"{name} V={vocab} B={batch}: torch {torch_us:.1f} us, split {split_us:.1f} us", flush=True)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    command = "python benchmarks/argmax_split.py " + " ".join(sys.argv[1:] if argv is None else argv)
    doc = {"command": command, "environment": environment(device), "dtype": str(dtype).removeprefix("torch."),
           "compiled": device.type == "cuda", "cuda_graphs": device.type == "cuda", "rows": rows}
    path = args.out_dir / "argmax_split.json"
    path.write_text(json.dumps(doc, indent=1))
    table = markdown_table(rows, [("variant", "variant"), ("vocab", "V"), ("rows", "rows"), ("torch_us", "torch us"),
                                  ("split_us", "split us"), ("speedup", "speed-up"), ("same", "same indices")])
    env = doc["environment"]
    (args.out_dir / "argmax_split.md").write_text(
        f"# Split argmax vs torch.argmax\n\n`{command}` on {env['gpu'] or env['processor']} ({env['date']}, torch "
        f"{env['torch']}), {doc['dtype']}, compiled and CUDA-graph replayed: {doc['compiled']}\n\n{table}\n")
    return path


if __name__ == "__main__":
    main()
