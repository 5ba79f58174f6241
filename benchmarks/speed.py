"""Decoding speed on one GPU: transformers generate() against the slot engine, plain and speculative.

    python benchmarks/speed.py --out-dir benchmarks/h200            # SmolLM2 bf16 greedy, C = 1 8 64 256

Writes OUT/speed.json (keys: hf_generate_tok_s, hf_prompt_lookup_tok_s, hf_custom_generate_tok_s, plain_tok_s,
speculative, stages, graphs, in_flight, divergence, llama8b_step_ms, llama8b_floor_ms, environment) and prints a
markdown table. Every run uses the same prompts (six MT-Bench first turns, repeated to fill the larger runs),
128 new tokens, greedy; a run at concurrency C keeps C requests in flight (closed loop, dspark.engine). Each row
is the median of --repeats timed decodes (default 3) after one warm-up decode; tok_s_repeats holds all of them.

--overlap on|off|both: rounds launched before the last one is committed (dspark.engine.serve.overlap_allowed);
`both` (the default) also runs plain decoding in order (runs key plain_in_order).

--compile on|off|both: the host's decode steps through torch.compile'd layers (dspark.engine.compiled) or its eager
layers; `both` (the default) runs plain decoding and the llama-8b step both ways in this run (keys with the suffix
`_eager_layers` hold the eager-layer numbers) and everything else compiled. Compilation is part of each run's
warm-up (its `warmup_s`), which the tokens/s exclude.

Drafters: n-gram (model-free; "ngram-full" the same lookups stated K wide: full_width); EAGLE-3, DFlash and DSpark
are random-initialised unless --checkpoints DIR holds
trained ones (DIR/<name>): their tau is then ~1 and the speculative rows measure the engine's overhead at that tau,
not a trained drafter's speed-up. Never imported by the package.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import warnings
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dspark.api import encode_prompts, load_host  # noqa: E402
from dspark.engine.attention import SDPA_BACKENDS, restrict_sdpa  # noqa: E402
from dspark.engine.compiled import set_inductor  # noqa: E402
from dspark.engine.decode import generate  # noqa: E402
from dspark.engine import serve as serve_module  # noqa: E402
from dspark.engine.workload import PROMPTS as MT_BENCH  # noqa: E402
from dspark.metrics import summarize  # noqa: E402

NEW = 128
OVERLAP: bool | None = None  # generate's `overlap` for every engine run (--overlap off: False)
REPEATS = 3  # timed decodes per row (--repeats); the row reports the median one


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def prompts_for(ids: list[list[int]], n: int) -> list[list[int]]:
    return [ids[i % len(ids)] for i in range(n)]


def n_prompts(C: int, cap: int) -> int:
    """Enough requests that the closed loop refills slots: 6 at C = 1, 4 C otherwise (at most `cap`)."""
    return 6 if C == 1 else min(cap, max(4 * C, 16))


def hf_tok_s(host, ids: list[list[int]], **kwargs) -> float:
    """transformers generate() one prompt at a time (concurrency 1), greedy."""
    model, tokens, seconds = host.model, 0, 0.0
    for i, p in enumerate(ids):
        x = torch.tensor([p], device=host.device)
        sync()
        start = time.perf_counter()
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW, do_sample=False,
                             pad_token_id=0, **kwargs)
        sync()
        if i:  # the first call warms up
            seconds += time.perf_counter() - start
            tokens += out.shape[1] - x.shape[1]
    return tokens / seconds


def engine_run(host, ids, C: int, drafter=None, K: int = 7, overlap: bool | None = None) -> dict:
    """One row: a warm-up decode (every distinct prompt), then REPEATS timed decodes of `ids`; the row is the median
    one by tokens/s (its stage split, CPU split and warm-up), with every repeat's tokens/s in tok_s_repeats. why a
    median: a timed decode lasts 0.4-1.5 s, and with one decode a row the H100 run of 2026-12-06 (eighth session,
    RESULTS) had a plain row 40 % below its in-order twin, cause unmeasured."""
    kw = dict(drafter=drafter, draft_length=K, concurrency=C, overlap=OVERLAP if overlap is None else overlap)
    # warm-up: C requests, then every other distinct prompt of the row, so that each prompt's shapes (prefill
    # buckets, a drafter's eager admission) have run once before the timing; with ids[:C] alone a row at C = 1 met
    # five of its six prompts first in the timed decodes (changed 2026-12-06, eighth session, after EAGLE-3's
    # admissions were seen to cost 19 ms each at C = 1 against 3 ms for DSpark's: RESULTS). With the timed budget:
    # the cache is sized by the longest prompt plus the budget, and an 8-token warm-up left the first timed decode
    # to grow the allocator in its window (seen in the experiments' rows at C = 64 on 2026-12-07, thirteenth
    # session: plain's one admission 0.11 s against 0.02 s for the row after it; perhaps the 40 % above, unchecked)
    warm = list(ids[:C]) + [p for p in {tuple(p): list(p) for p in ids}.values() if p not in ids[:C]]
    generate(host, warm, max_new_tokens=NEW, **kw)
    sync()
    outs = []
    for _ in range(REPEATS):
        outs.append(generate(host, ids, max_new_tokens=NEW, timing=True, **kw))
        sync()
    speeds = [sum(map(len, o.token_ids)) / o.seconds for o in outs]
    out = outs[sorted(range(len(outs)), key=speeds.__getitem__)[len(outs) // 2]]
    s = summarize(out, draft_length=K if drafter is not None else 0)
    e = out.engine
    flight = e["in_flight"]
    # rounds before the queue ran dry: up to the last round that still ran with C in flight
    full = max((i for i, c in enumerate(flight) if c == C), default=-1) + 1
    return {"tok_s": s["tokens_per_s"], "tau": s["tau"], "rounds": out.rounds, "seconds": out.seconds,
            "requests": len(ids), "graphs": e["graphs"], "warmup_s": e["warmup_s"],
            "stage_ms_per_round": {k: 1000 * v / max(1, out.rounds) for k, v in e["stage_s"].items()},
            **cpu_split(out),
            "in_flight_fraction_until_dry": (sum(flight[:full]) / (C * full)) if full else float("nan"),
            "overlapped": e["overlapped"], "ttft_s_mean": sum(out.ttft) / len(out.ttft),
            "latency_s_mean": sum(out.latency) / len(out.latency), "tok_s_repeats": speeds,
            "tokens": out.token_ids}


def cpu_split(out) -> dict:
    """The CPU's side of a round (ms): its own work (the loop's wall time outside waits for the device's copies:
    launches, commits, admissions), of which launching admissions, and its waits. Where its own work exceeds the
    device's round (the stage split), the round is bound by the CPU, and the bookkeeping column is that excess."""
    e, rounds = out.engine, max(1, out.rounds)
    wait = e.get("wait_s", 0.0)
    return {"cpu_ms_per_round": 1000 * (out.seconds - wait) / rounds, "wait_ms_per_round": 1000 * wait / rounds,
            "admit_ms_per_round": 1000 * e.get("admit_s", 0.0) / rounds, "admissions": e.get("admissions", 0),
            "admit_ms_each": 1000 * e.get("admit_s", 0.0) / max(1, e.get("admissions", 0)),
            "gc_ms": 1000 * e.get("gc_s", 0.0), "gc_collections": e.get("gc_collections")}


def drafters_for(host, names, checkpoints: Path | None, K: int):
    from drafters import build_drafter, for_inference
    from dspark.api import checkpoint_dir

    out = {}
    for name in names:  # DIR/<name>: a save_pretrained folder or a `dspark train --output` one (its newest checkpoint)
        path = None if checkpoints is None else checkpoint_dir(checkpoints / name)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            if name in ("ngram", "ngram-full"):  # ngram-full: every verify K + 1 wide, rounds fully overlapped
                d = build_drafter("ngram", host, full_width=name == "ngram-full")
            elif path is not None and path.is_dir():
                d = build_drafter(name, host, checkpoint=path)
            else:
                overrides = {"eagle3": dict(ttt_length=K)}.get(name, {})
                torch.manual_seed(0)
                d = build_drafter(name, host, **overrides)
        d = for_inference(d, host)  # the host's dtype, as `dspark` decodes with it
        out[name] = (d, "trained" if path is not None and path.is_dir() else ("model-free" if name.startswith("ngram")
                                                                              else "random-init"))
    return out


def llama8b_keys(compile_mode: str) -> dict:
    """speed.json's llama-8b keys for --compile on, off or both (both: the eager layers' under *_eager_layers too)."""
    keys = {}
    if compile_mode == "both":
        keys.update({f"{k}_eager_layers": v for k, v in llama8b(False).items()
                     if k not in ("llama8b_weight_bytes", "copy_bandwidth_GBps")})
    keys.update(llama8b(compile_mode != "off"))
    return keys


def llama8b(compile: bool, new: int = 32) -> dict:
    """Random llama-8b host, bf16, concurrency 1: the plain step against its weight-read floor."""
    host = load_host("random:llama-8b", dtype="bfloat16", device="cuda", compile=compile)
    ids = [list(range(1, 65))]
    out = engine_run(host, ids, 1)
    step_ms = 1000 * out["seconds"] / max(1, out["rounds"] + 1)
    verify_ms = out["stage_ms_per_round"].get("verify", float("nan"))
    weight_bytes = sum(p.numel() * p.element_size() for p in host.model.parameters())
    # a step reads one row of the input embedding, not all of it (llama-8b's is not tied to the LM head)
    embedding = host.model.get_input_embeddings().weight
    tied = embedding.data_ptr() == host.model.get_output_embeddings().weight.data_ptr()
    read_bytes = weight_bytes - (0 if tied else embedding.numel() * embedding.element_size())
    x = torch.empty(2 * 1024 ** 3, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    start, reps = time.perf_counter(), 10
    for _ in range(reps):
        y.copy_(x)
    torch.cuda.synchronize()
    bandwidth = 2 * x.numel() * reps / (time.perf_counter() - start)  # bytes read + written per second
    del x, y, host
    torch.cuda.empty_cache()
    return {"llama8b_step_ms": step_ms, "llama8b_verify_ms": verify_ms, "llama8b_floor_ms": 1000 * weight_bytes / bandwidth,
            "llama8b_read_floor_ms": 1000 * read_bytes / bandwidth,  # the weights a step reads: a stricter floor
            "llama8b_weight_bytes": weight_bytes, "copy_bandwidth_GBps": bandwidth / 1e9,
            "llama8b_graphs": out["graphs"], "llama8b_warmup_s": out["warmup_s"]}


def divergence(plain: list[list[int]], spec: list[list[int]]) -> dict:
    """bf16 greedy speculative vs plain: requests identical, and the mean length of the common prefix."""
    same, prefix = 0, []
    for a, b in zip(plain, spec):
        same += a == b
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefix.append(n / max(1, len(a)))
    return {"identical_requests": same / len(plain), "mean_common_prefix_fraction": sum(prefix) / len(prefix)}


def main(argv=None) -> int:
    global NEW, OVERLAP, REPEATS
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", type=Path, default=Path(os.environ.get("OUT", "benchmarks/h200")))
    ap.add_argument("--host", default="smollm2")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 64, 256])
    ap.add_argument("--spec-concurrency", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--drafters", nargs="+", default=["ngram", "ngram-full", "eagle3", "dflash", "dspark"],
                    help="ngram-full: the n-gram drafter with full_width (verify K + 1 wide, no wait for the width)")
    ap.add_argument("--checkpoints", type=Path, default=None)
    ap.add_argument("--max-prompts", type=int, default=256)
    ap.add_argument("--draft-length", type=int, default=7)
    ap.add_argument("--max-new-tokens", type=int, default=NEW)
    ap.add_argument("--skip-llama8b", action="store_true")
    ap.add_argument("--only-llama8b", action="store_true",
                    help="run only the llama-8b step and add its keys to OUT/speed.json (a second device call)")
    ap.add_argument("--compile", choices=["on", "off", "both"], default="both",
                    help="decode steps through torch.compile'd host layers; both: plain and llama-8b both ways")
    ap.add_argument("--overlap", choices=["on", "off", "both"], default="both",
                    help="rounds launched before the last one is committed (dspark.engine.serve.overlap_allowed); "
                         "both: plain decoding also in order (runs key plain_in_order)")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of this script, no timings worth keeping")
    ap.add_argument("--sdpa", nargs="+", default=None, choices=sorted(SDPA_BACKENDS),
                    help="the SDPA backends allowed (default: all, SDPA's own choice: cuDNN on Hopper)")
    ap.add_argument("--repeats", type=int, default=REPEATS,
                    help="timed decodes per row (after its warm-up); the row is the median one by tokens/s")
    ap.add_argument("--gc-freeze", choices=["on", "off"], default="on",
                    help="freeze the objects alive when a decode starts for its loop (dspark.engine.serve.quiet_gc); "
                         "off: an A/B of that")
    ap.add_argument("--drafter-admission", choices=["captured", "eager"], default="captured",
                    help="the drafter's part of each admission replayed as CUDA graphs per arrival shape "
                         "(dspark.engine.prefill.DrafterPrefill) or, for an A/B, run as called")
    ap.add_argument("--inductor", nargs="+", default=[], metavar="KEY=VALUE",
                    help="torch._inductor.config options for the compiled pieces, e.g. combo_kernels=True")
    args = ap.parse_args(argv)
    if args.sdpa:
        restrict_sdpa(args.sdpa)
    inductor = set_inductor(args.inductor)
    serve_module.FREEZE_GC = args.gc_freeze == "on"
    serve_module.CAPTURE_DRAFTER_ADMISSION = args.drafter_admission == "captured"
    K = args.draft_length
    NEW = args.max_new_tokens
    if args.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {args.repeats}")
    REPEATS = args.repeats
    command = "python benchmarks/speed.py " + " ".join(argv if argv is not None else sys.argv[1:])
    env = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "gpu": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
           "torch": torch.__version__, "python": platform.python_version(), "host": args.host, "command": command,
           "sdpa": args.sdpa or "default", "inductor": inductor, "gc_freeze": args.gc_freeze, "repeats": REPEATS,
           "drafter_admission": args.drafter_admission}
    import transformers

    env["transformers"] = transformers.__version__
    if args.only_llama8b:  # a device call lasts at most 10 minutes: the 8B host can come in a call of its own
        path = args.out_dir / "speed.json"
        result = json.loads(path.read_text()) if path.is_file() else {"environment": env}
        result.update(llama8b_keys(args.compile))
        result["environment"]["command_llama8b"] = command
        args.out_dir.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1) + "\n")
        print(table(result) if "runs" in result else json.dumps(result, indent=1))
        return 0
    host = load_host(args.host, dtype="bfloat16" if args.device == "cuda" else "float32", device=args.device)
    ids = encode_prompts(host, MT_BENCH, chat=True) if host.tokenizer is not None else \
        [list(range(5 + 3 * i, 40 + 7 * i)) for i in range(6)]
    result: dict = {"environment": env, "new_tokens": NEW, "draft_length": K}
    t = time.perf_counter()
    result["hf_generate_tok_s"] = hf_tok_s(host, ids)
    result["hf_prompt_lookup_tok_s"] = hf_tok_s(host, ids, prompt_lookup_num_tokens=K)
    print(f"hf done in {time.perf_counter() - t:.0f}s", flush=True)
    runs: dict = {"plain": {}}
    if args.overlap == "off":  # every engine run in order (generate's default overlaps on CUDA; not the drop-in row)
        OVERLAP = False
    compiled = args.compile != "off"
    if args.compile == "both":  # the eager layers first, then the compiled ones on the same host object
        host.compile = False
        runs["plain_eager_layers"] = {}
        for C in args.concurrency:
            runs["plain_eager_layers"][C] = engine_run(host, prompts_for(ids, n_prompts(C, args.max_prompts)), C)
            print("plain (eager layers)", C, round(runs["plain_eager_layers"][C]["tok_s"], 1), flush=True)
    host.compile = compiled
    env["compile"], env["overlap"] = args.compile, args.overlap
    for C in args.concurrency:
        runs["plain"][C] = engine_run(host, prompts_for(ids, n_prompts(C, args.max_prompts)), C)
        print("plain", C, round(runs["plain"][C]["tok_s"], 1), flush=True)
        save_partial(args.out_dir, result, runs)
    if args.overlap == "both":  # the in-order loop too: each round's copy read before the next round is launched
        runs["plain_in_order"] = {}
        for C in args.concurrency:
            runs["plain_in_order"][C] = engine_run(host, prompts_for(ids, n_prompts(C, args.max_prompts)), C,
                                                   overlap=False)
            print("plain (in order)", C, round(runs["plain_in_order"][C]["tok_s"], 1), flush=True)
            save_partial(args.out_dir, result, runs)
    for name, (drafter, how) in drafters_for(host, args.drafters, args.checkpoints, K).items():
        runs[name] = {}
        for C in args.spec_concurrency:
            runs[name][C] = engine_run(host, prompts_for(ids, n_prompts(C, args.max_prompts)), C, drafter, K)
            runs[name][C]["drafter"] = how
            print(name, C, round(runs[name][C]["tok_s"], 1), "tau", round(runs[name][C]["tau"], 2), flush=True)
            save_partial(args.out_dir, result, runs)
    import dspark.hf

    # after the engine rows (saved as they finish): a failure on the device here cannot take them with it, and an
    # error the engine raises (not a device fault, which ends the process's CUDA context) is recorded, not fatal
    try:
        result["hf_custom_generate_tok_s"] = hf_tok_s(host, ids, custom_generate=dspark.hf.speculative("ngram"))
    except Exception as error:  # noqa: BLE001 (recorded in speed.json and printed in the table)
        result["hf_custom_generate_tok_s"] = float("nan")
        result["hf_custom_generate_error"] = f"{type(error).__name__}: {error}"
        print("custom_generate failed:", result["hf_custom_generate_error"], flush=True)
    result["plain_tok_s"] = {C: r["tok_s"] for C, r in runs["plain"].items()}
    plains = ("plain", "plain_eager_layers", "plain_in_order")
    if "plain_eager_layers" in runs:
        result["plain_tok_s_eager_layers"] = {C: r["tok_s"] for C, r in runs["plain_eager_layers"].items()}
    result["speculative"] = {name: {"tok_s": {C: r["tok_s"] for C, r in rs.items()},
                                    "tau": {C: r["tau"] for C, r in rs.items()},
                                    # the conversion of acceptance into speed: (spec ÷ plain tokens/s) ÷ tau
                                    "conversion": {C: r["tok_s"] / runs["plain"][C]["tok_s"] / r["tau"]
                                                   for C, r in rs.items() if C in runs["plain"]},
                                    "drafter": next(iter(rs.values()))["drafter"]}
                             for name, rs in runs.items() if name not in plains}
    result["divergence"] = {name: divergence(runs["plain"][1]["tokens"], rs[1]["tokens"])
                            for name, rs in runs.items() if name not in plains and 1 in rs and 1 in runs["plain"]}
    result["runs"] = runs_json(runs)
    del host
    torch.cuda.empty_cache()
    if not args.skip_llama8b:
        result.update(llama8b_keys(args.compile))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "speed.json").write_text(json.dumps(result, indent=1) + "\n")
    print(table(result))
    return 0


def save_partial(out_dir: Path, result: dict, runs: dict) -> None:
    """What the run has measured so far, in OUT/speed.partial.json (a device call cut at its time limit keeps it)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "speed.partial.json").write_text(json.dumps({**result, "runs": runs_json(runs)}, indent=1) + "\n")


def runs_json(runs: dict) -> dict:
    """The runs as speed.json keeps them: every field but the decoded tokens."""
    return {name: {C: {k: v for k, v in r.items() if k != "tokens"} for C, r in rs.items()}
            for name, rs in runs.items()}


def table(r: dict) -> str:
    lines = ["| method | C | tok/s | tau | ratio to plain | ratio / tau "
             "| ms/round draft / verify / accept / bookkeeping | CPU ms/round own / of it admit (ms an admission) "
             "| GC ms in loop (collections of gen 0/1/2) | graphs | warm-up s | in flight |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    lines.append(f"| transformers generate() | 1 | {r['hf_generate_tok_s']:.1f} | | | | | | | | | |")
    lines.append(f"| transformers generate(prompt_lookup_num_tokens) | 1 | {r['hf_prompt_lookup_tok_s']:.1f} "
                 f"| | | | | | | | | |")
    failed = r.get("hf_custom_generate_error")
    custom = "failed: " + failed if failed else format(r["hf_custom_generate_tok_s"], ".1f")
    lines.append(f"| transformers custom_generate=dspark.hf.speculative('ngram') | 1 | {custom} | | | | | | | | | |")
    for name, rs in r["runs"].items():
        for C, x in rs.items():
            plain = r["runs"]["plain"].get(C, {}).get("tok_s")  # plain variants too: the overlap's, compile's gain
            st = x["stage_ms_per_round"]
            split = " / ".join(f"{st.get(k, float('nan')):.2f}" for k in ("draft", "verify", "accept", "bookkeeping"))
            cpu = (f"{x['cpu_ms_per_round']:.2f} / {x['admit_ms_per_round']:.2f}" if "cpu_ms_per_round" in x
                   else "")  # speed.json files written before the CPU split
            cpu += f" ({x['admit_ms_each']:.2f})" if "admit_ms_each" in x else ""  # and before this split of it
            gc_ms = (f"{x['gc_ms']:.1f} ({'/'.join(map(str, x['gc_collections']))})" if x.get("gc_collections")
                     else "")  # and before the garbage collections were counted
            ratio = f"{x['tok_s'] / plain:.2f}" if plain else ""
            conversion = f"{x['tok_s'] / plain / x['tau']:.2f}" if plain and not name.startswith("plain") else ""
            lines.append(f"| {name}{' (' + x['drafter'] + ')' if 'drafter' in x else ''} | {C} | {x['tok_s']:.1f} | "
                         f"{x['tau']:.2f} | {ratio} | {conversion} | {split} | {cpu} | {gc_ms} | {x['graphs']} | "
                         f"{x['warmup_s']:.2f} | {x['in_flight_fraction_until_dry']:.3f} |")
    if "llama8b_step_ms" in r:
        layers = "compiled" if r["environment"].get("compile", "off") != "off" else "eager"
        lines.append(f"\nrandom llama-8b, C = 1, {layers} layers: plain step {r['llama8b_step_ms']:.2f} ms "
                     f"(verify graph {r['llama8b_verify_ms']:.2f} ms) against a weight-read floor of {r['llama8b_floor_ms']:.2f} ms "
                     f"({r['llama8b_weight_bytes'] / 1e9:.2f} GB at {r['copy_bandwidth_GBps']:.0f} GB/s; the weights "
                     f"a step reads, the input embedding but one row excluded: "
                     f"{r.get('llama8b_read_floor_ms', float('nan')):.2f} ms)")
    if "llama8b_step_ms_eager_layers" in r:
        lines.append(f"random llama-8b, C = 1, eager layers: plain step {r['llama8b_step_ms_eager_layers']:.2f} ms "
                     f"(verify graph {r['llama8b_verify_ms_eager_layers']:.2f} ms)")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
