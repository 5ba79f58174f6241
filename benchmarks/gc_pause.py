"""Python's garbage collector inside the decode loop, with and without `dspark.engine.serve.quiet_gc`'s freeze.

    python benchmarks/gc_pause.py --out-dir DIR [--host random:smollm2] [--compile on] [--new-tokens 6 24]
                                  [--repeats 2]

Why it exists: a collection of Python's oldest generation scans every object the process tracks, and after
torch.compile and graph capture that is hundreds of thousands of them; inside the decode loop such a pause lands in
whichever round triggers it. quiet_gc freezes the objects alive when the loop starts (and again after a capture
inside it), so that a collection there scans only what the loop allocated since.

Each setting (freeze on, off) runs in a fresh Python process, since compiled code, the on-disk inductor cache and the
collector's own counters make a process's first decodes unlike its later ones; the settings alternate between
repeats so that neither always runs first. In each process: the host loaded (compiled layers with --compile on), then
one decode per --new-tokens value (8 prompts of 40 tokens, 4 in flight; its first compiles and captures inside the
loop, as a timed run's new shapes do), each reporting the engine's garbage-collection seconds and collections per
generation (EngineStats.gc_s, gc_collections), its seconds (warm-up excluded) and warm-up, and the objects the
process tracks after it; then the wall time of one full gc.collect(). Writes DIR/gc_pause.json and DIR/gc_pause.md
with the machine, versions, command and date.
"""
from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dspark.metrics import markdown_table  # noqa: E402
from dspark.quickstart import environment  # noqa: E402


def child(args) -> list[dict]:
    """One process's decodes under one setting (--child on|off), as rows."""
    import dspark
    import dspark.engine.serve as serve
    from dspark.engine.decode import generate

    serve.FREEZE_GC = args.child == "on"
    host = dspark.load_host(args.host, device=args.device, compile=args.compile == "on")
    prompts = [[1 + (i * 7 + j) % 500 for j in range(40)] for i in range(8)]
    graphs = None if host.device.type == "cuda" else "static"  # the CPU runs the graph path without capture
    rows = []
    for new in args.new_tokens:
        out = generate(host, prompts, max_new_tokens=new, concurrency=4, graphs=graphs)
        e = out.engine
        rows.append({"freeze": args.child, "new_tokens": new, "gc_ms": 1000 * e["gc_s"],
                     "gen0": e["gc_collections"][0], "gen1": e["gc_collections"][1], "gen2": e["gc_collections"][2],
                     "seconds": out.seconds, "warmup_s": e["warmup_s"], "objects": len(gc.get_objects())})
    start = time.perf_counter()
    gc.collect()
    full = 1000 * (time.perf_counter() - start)
    for row in rows:
        row["full_collect_ms"] = full
    return rows


def main(argv: list[str] | None = None) -> Path | None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path)
    parser.add_argument("--host", default="random:smollm2")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--compile", choices=["on", "off"], default="on")
    parser.add_argument("--new-tokens", type=int, nargs="+", default=[6, 24])
    parser.add_argument("--repeats", type=int, default=2, help="processes per setting, alternating on / off")
    parser.add_argument("--child", choices=["on", "off"], help=argparse.SUPPRESS)  # one setting's process
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return None
    if args.out_dir is None:
        parser.error("--out-dir is required")
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    own = ["--host", args.host, "--device", args.device, "--compile", args.compile, "--new-tokens",
           *map(str, args.new_tokens)]
    rows = []
    for repeat in range(args.repeats):
        for setting in (("off", "on") if repeat % 2 == 0 else ("on", "off")):
            done = subprocess.run([sys.executable, __file__, *own, "--child", setting], capture_output=True,
                                  text=True, cwd=ROOT)
            if done.returncode != 0:
                raise SystemExit(f"the --child {setting} process failed (exit {done.returncode}):\n"
                                 f"{done.stderr[-3000:]}")
            for row in json.loads(done.stdout.strip().splitlines()[-1]):
                rows.append({"repeat": repeat, **row})
                print({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    command = "python benchmarks/gc_pause.py " + " ".join(sys.argv[1:] if argv is None else argv)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          "cpu" if args.device == "auto" else args.device)
    doc = {"command": command, "environment": environment(device), "host": args.host, "compile": args.compile,
           "rows": rows}
    path = args.out_dir / "gc_pause.json"
    path.write_text(json.dumps(doc, indent=1) + "\n")
    table = markdown_table(rows, [("repeat", "repeat"), ("freeze", "freeze"), ("new_tokens", "new tokens"),
                                  ("gc_ms", "GC ms in loop"), ("gen0", "gen 0"), ("gen1", "gen 1"), ("gen2", "gen 2"),
                                  ("seconds", "decode s"), ("warmup_s", "warm-up s"), ("objects", "objects after"),
                                  ("full_collect_ms", "full collect ms")])
    env = doc["environment"]
    (args.out_dir / "gc_pause.md").write_text(
        f"# Garbage collections inside the decode loop\n\n`{command}` on {env['gpu'] or env['processor']} "
        f"({env['date']}, torch {env['torch']}, Python {env['python']}), host {args.host}, compiled layers: "
        f"{args.compile}\n\n{table}\n")
    return path


if __name__ == "__main__":
    main()
