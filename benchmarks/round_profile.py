"""Where a speculative round's GPU time goes, stage by stage: kernels launched and their time, eager vs compiled.

    python benchmarks/round_profile.py --out-dir DIR [--host random:smollm2] [--concurrency 1 8]

For each method (plain, n-gram, DFlash, DSpark, EAGLE-3; the drafters random-initialised in the shapes of
experiments/recipes/smollm2-*.yaml unless --checkpoints holds trained ones: --backbone-layers 5, the Markov head of
rank 256 with confidences, EAGLE-3 with 7 draft steps; the census in benchmarks/results/round-profile/ ran 3
backbone layers) and each of
--compile off / on (the host's decode steps and, greedy, the drafter's propose and observe and the round's commit
through torch.compile: dspark.engine.compiled):
  - a closed-loop engine run (CUDA graphs, bf16, greedy, --new tokens per request): tokens/s, tau, rounds per
    second and the CUDA-event split of a round into draft / verify / accept;
  - a kernel census of one round's stages run eagerly under torch.profiler at concurrency 1: the number of device
    kernels of propose, verify (at widths 1 and K + 1) and accept, their summed kernel time, and the costliest.
Random weights: tau is ~1 for the model drafters, so what matters here is the cost of a round (ratio to plain ÷ tau
is plain round time ÷ speculative round time), which does not depend on the weights. Writes DIR/round_profile.json
and prints a markdown table. Diagnostic: the engine's speed figures come from benchmarks/speed.py
(benchmarks/results/engine-speed/).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dspark.api import load_host  # noqa: E402
from dspark.engine import round as round_module  # noqa: E402
from dspark.engine.attention import SDPA_BACKENDS, restrict_sdpa  # noqa: E402
from dspark.engine.compiled import set_inductor  # noqa: E402
from dspark.engine.decode import generate  # noqa: E402
from dspark.engine.kv_cache import aligned_length  # noqa: E402
from dspark.engine.protocol import NoDrafter, VerifyAll  # noqa: E402
from dspark.engine.sampling import SamplingConfig  # noqa: E402
from dspark.engine.slots import Request, Slots  # noqa: E402
from dspark.engine.workload import warm_up_prompts  # noqa: E402
from dspark.metrics import summarize  # noqa: E402

K = 7
METHODS = ("plain", "ngram", "dflash", "dspark", "eagle3")


def build(name: str, host, backbone_layers: int, checkpoints: Path | None):
    """The drafter `name`: trained from checkpoints/<name> when that folder exists, else random-initialised in
    the recipe's shape (experiments/recipes/smollm2-*.yaml: DSpark and DFlash on `backbone_layers`, EAGLE-3 TTT K)."""
    if name == "plain":
        return None
    from drafters import build_drafter, for_inference
    from dspark.api import checkpoint_dir

    folder = None if checkpoints is None else checkpoints / name
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # random weights: intended
        if folder is not None and folder.is_dir():
            d = build_drafter(name, host, checkpoint=checkpoint_dir(folder))
        else:
            layers = dict(num_layers=backbone_layers)
            d = build_drafter(name, host, **{"eagle3": dict(ttt_length=K), "dspark": layers,
                                             "dflash": layers}.get(name, {}))
    return for_inference(d, host)  # the host's dtype, as `dspark` decodes with it


def prompts(host, n: int, length: int = 120) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(10, host.vocab_size, (length + 7 * (i % 6),), generator=g).tolist() for i in range(n)]


def engine_row(host, drafter, C: int, new: int, prompt_length: int = 120) -> dict:
    ids = prompts(host, 6 if C == 1 else 4 * C, prompt_length)
    kw = dict(drafter=drafter, draft_length=K, concurrency=C)
    # warm-up (compilation and capture) over the timed decode's cache: its longest prompt, the same budget
    generate(host, warm_up_prompts(ids, C), max_new_tokens=new, **kw)
    sync()
    out = generate(host, ids, max_new_tokens=new, timing=True, **kw)
    s = summarize(out, draft_length=K if drafter is not None else 0)
    rounds = max(1, out.rounds)
    return {"tok_s": s["tokens_per_s"], "tau": s["tau"], "rounds_per_s": out.rounds / out.seconds,
            "stage_ms": {k: 1000 * v / rounds for k, v in out.engine["stage_s"].items()},
            "graphs": out.engine["graphs"], "warmup_s": out.engine["warmup_s"]}


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def census(fn) -> dict:
    """Run fn once under torch.profiler: device kernels, their summed time (ms) and the five costliest (on a
    machine without CUDA, for a smoke test: the aten operators and their CPU time)."""
    cuda = torch.cuda.is_available()
    fn()  # warm-up (compilation, lazy init)
    sync()
    activity = torch.profiler.ProfilerActivity.CUDA if cuda else torch.profiler.ProfilerActivity.CPU
    with torch.profiler.profile(activities=[activity]) as prof:
        fn()
        sync()
    if cuda:
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    else:
        kernels = [e for e in prof.events() if e.name.startswith("aten::") and e.cpu_parent is None]
    times: Counter = Counter()
    counts: Counter = Counter()
    for e in kernels:
        spent = getattr(e, "device_time", getattr(e, "cuda_time", 0.0)) if cuda else e.cpu_time_total
        times[e.name[:60]] += spent / 1000
        counts[e.name[:60]] += 1
    # every kernel name with its count and time: where two stages differ (e.g. verify at widths 1 and K + 1)
    return {"kernels": len(kernels), "device_ms": sum(times.values()),
            "top": [(name, round(ms, 4)) for name, ms in times.most_common(5)],
            "by_name": {name: [counts[name], round(times[name], 4)] for name, _ in times.most_common()}}


def stage_census(host, drafter, prompt_length: int = 120) -> dict:
    drafter = drafter or NoDrafter()
    K_ = 0 if isinstance(drafter, NoDrafter) else K
    verifier = VerifyAll()
    verifier.bind(drafter=drafter, K=K_)
    slots = Slots(host, drafter, verifier, capacity=1, max_len=aligned_length(prompt_length + 200),
                  sampling=SamplingConfig())
    slots.admit([0], [Request(index=0, prompt=prompts(host, 1, prompt_length)[0], limit=150, seed=0)])
    taps = drafter.feature_layers
    out = {}
    if K_:
        out["propose"] = census(lambda: round_module.propose(slots, drafter, verifier, K_))
    draft = round_module.propose(slots, drafter, verifier, K_) if K_ else round_module.no_draft(slots, K_)
    for L in sorted({0, min(K_, draft.tokens.shape[1])}):
        out[f"verify_w{L + 1}"] = census(lambda: round_module.verify(slots, host, draft, L, taps, None))
    verified = round_module.verify(slots, host, draft, K_, taps, None)
    out["accept"] = census(lambda: round_module.accept(slots, drafter, draft, verified))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="random:smollm2")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument("--compile", nargs="+", default=["off", "on"], choices=["off", "on"])
    ap.add_argument("--new", type=int, default=64, help="new tokens per request")
    ap.add_argument("--prompt-length", type=int, default=120, help="tokens per (random) prompt, +0..35: the context "
                    "a round attends (ShareGPT's held-out prompts run to 512)")
    ap.add_argument("--out-dir", type=Path, required=True)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test of the script (float32, no CUDA events)")
    ap.add_argument("--backbone-layers", type=int, default=5, help="DSpark / DFlash depth (the recipe's 5)")
    ap.add_argument("--checkpoints", type=Path, default=None, help="DIR/<drafter>: trained drafters where present")
    ap.add_argument("--sdpa", nargs="+", default=None, choices=sorted(SDPA_BACKENDS),
                    help="the SDPA backends allowed (default: all, SDPA's own choice); writes round_profile_sdpa-"
                         "<names>.json (with --inductor, its settings join the name too)")
    ap.add_argument("--inductor", nargs="+", default=[], metavar="KEY=VALUE",
                    help="torch._inductor.config options for the compiled pieces, e.g. combo_kernels=True")
    args = ap.parse_args(argv)
    if args.sdpa:
        restrict_sdpa(args.sdpa)
    inductor = set_inductor(args.inductor)
    host = load_host(args.host, dtype="bfloat16" if args.device == "cuda" else "float32", device=args.device)
    drafters = {name: build(name, host, args.backbone_layers, args.checkpoints) for name in args.methods}
    result = {"host": args.host, "K": K, "new": args.new, "prompt_length": args.prompt_length,
              "torch": torch.__version__,
              "gpu": torch.cuda.get_device_name() if args.device == "cuda" else "none",
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "command": "python benchmarks/round_profile.py " + " ".join(argv or sys.argv[1:]),
              "sdpa": args.sdpa or "default", "inductor": inductor, "rows": []}
    tag = "".join([f"_sdpa-{'-'.join(args.sdpa)}" if args.sdpa else "",
                   "".join(f"_{k}-{v}" for k, v in inductor.items())])
    out_file = f"round_profile{tag}.json"
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for mode in args.compile:
        host.compile = mode == "on"
        for name in args.methods:
            row = {"compile": mode, "method": name, "census": stage_census(host, drafters[name], args.prompt_length)}
            row["engine"] = {C: engine_row(host, drafters[name], C, args.new, args.prompt_length)
                             for C in args.concurrency}
            result["rows"].append(row)
            print(json.dumps(row), flush=True)
            (args.out_dir / out_file).write_text(json.dumps(result, indent=1))
    print(table(result))
    return 0


def table(result: dict) -> str:
    lines = ["| compile | method | C | tok/s | tau | ratio/tau | ms draft / verify / accept | kernels propose / "
             "verify (w1, wK+1) / accept |", "|---|---|---|---|---|---|---|---|"]
    plain = {(r["compile"], C): e["tok_s"] for r in result["rows"] if r["method"] == "plain"
             for C, e in r["engine"].items()}
    for r in result["rows"]:
        c = r["census"]
        kern = " / ".join(str(c[k]["kernels"]) for k in ("propose", "verify_w1", f"verify_w{K + 1}", "accept")
                          if k in c)
        for C, e in r["engine"].items():
            base = plain.get((r["compile"], C))
            conv = f"{e['tok_s'] / base / e['tau']:.2f}" if base and r["method"] != "plain" else ""
            st = " / ".join(f"{e['stage_ms'].get(k, 0):.2f}" for k in ("draft", "verify", "accept"))
            lines.append(f"| {r['compile']} | {r['method']} | {C} | {e['tok_s']:.1f} | {e['tau']:.2f} | {conv} | "
                         f"{st} | {kern} |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
