"""Decoding speed on one GPU: dspark.sweep's engine rows, plus what that tool does not measure: transformers
generate() at concurrency 1 (plain, prompt lookup, dspark.hf's custom_generate) and the plain step of a random
llama-8b against its weight-read floor.

    python benchmarks/speed.py --out-dir DIR                  # SmolLM2 bf16, greedy, C = 1 8 64, every drafter
    python benchmarks/speed.py --device cpu --host random:tiny-llama --drafters ngram --concurrency 1 2 \\
        --num-prompts 4 --max-new-tokens 6 --repeats 1 --compile off --skip-llama8b --out-dir /tmp/speed  # CPU smoke

Engine rows (DIR/concurrency.json, .md and PNGs; the schema is dspark.sweep's, the tool behind `dspark bench`):
plain decoding and every --drafters at --draft-length under verify-all, C requests in flight, on the six MT-Bench
first turns (chat template; seeded token ids for a host without a tokenizer) cycled to max(C, --num-prompts)
requests, greedy, --max-new-tokens each, --repeats timed decodes per row (after a warm-up decode on CUDA) and the
stage split of every round on CUDA. Drafters: ngram (model-free), ngram-full (the same lookups verified K + 1 wide
every round: full_width), eagle3 / dflash / dspark random-initialised unless --checkpoints DIR holds trained ones
(DIR/<name>): their tau is then about 1 and their rows measure the engine's cost at that tau, not a trained
drafter's speed-up.

DIR/speed.json: environment (with the process settings below), new_tokens, draft_length, drafters (name ->
trained / random-init / model-free), hf_generate_tok_s, hf_prompt_lookup_tok_s, hf_custom_generate_tok_s (or
hf_custom_generate_error), engine_plain_tok_s (the engine's plain row at C = 1, the like-for-like comparison), and
unless --skip-llama8b the llama8b_* keys (--only-llama8b adds them to an existing speed.json, in a run of its own).
Process settings for A/Bs: --compile (the host's decode steps through torch.compile, dspark.engine.compiled),
--sdpa, --inductor, --gc-freeze (dspark.engine.serve.quiet_gc), --drafter-admission
(dspark.engine.serve.CAPTURE_DRAFTER_ADMISSION). Never imported by the package.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # _generate, beside this script

from dspark.api import encode_prompts, load_host  # noqa: E402
from dspark.documents import envelope  # noqa: E402
from dspark.engine import serve as serve_module  # noqa: E402
from dspark.engine.attention import SDPA_BACKENDS, restrict_sdpa  # noqa: E402
from dspark.engine.compiled import set_inductor  # noqa: E402
from dspark.engine.workload import PROMPTS as MT_BENCH  # noqa: E402
from dspark.quickstart import environment  # noqa: E402
from dspark.sweep import NAME, Drafted, Sweep, measure, run  # noqa: E402
from _generate import hf_decode  # noqa: E402  (benchmarks/_generate.py)


def hf_tok_s(host, ids: list[list[int]], *, new: int, **kwargs) -> float:
    """transformers generate() one prompt at a time (concurrency 1), greedy, after a warm-up call."""
    return hf_decode(host.model, ids, new=new, **kwargs)["tokens_per_s"]


def drafters_for(host, names, checkpoints: Path | None, K: int) -> tuple[list[Drafted], dict[str, str]]:
    """Each drafter at draft length K, and how its weights came (trained, random-init, model-free)."""
    from drafters import build_drafter, for_inference
    from dspark.api import checkpoint_dir

    drafted, how = [], {}
    for name in names:  # DIR/<name>: a save_pretrained folder or a `dspark train --output` one (its newest checkpoint)
        path = None if checkpoints is None else checkpoint_dir(checkpoints / name)
        trained = path is not None and path.is_dir()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # random weights: intended
            if name in ("ngram", "ngram-full"):
                d = build_drafter("ngram", host, full_width=name == "ngram-full")
            elif trained:
                d = build_drafter(name, host, checkpoint=path)
            else:
                torch.manual_seed(0)
                d = build_drafter(name, host, **{"eagle3": dict(ttt_length=K)}.get(name, {}))
        drafted.append(Drafted(name, K, for_inference(d, host), path=str(path) if trained else None))
        how[name] = "model-free" if name.startswith("ngram") else "trained" if trained else "random-init"
    return drafted, how


def llama8b(*, compile: bool, repeats: int, out_dir: Path, new: int = 32) -> dict:
    """Random llama-8b host, bf16, concurrency 1: plain decoding's step (dspark.sweep's row) against the time the
    device takes to read its weights once."""
    host = load_host("random:llama-8b", dtype="bfloat16", device="cuda", compile=compile)
    sweep = Sweep(drafted=[], policies=[], concurrency=[1], max_new_tokens=new, repeats=repeats, stage_timing=True)
    (row,) = measure(host, [list(range(1, 65))], sweep, out_dir=out_dir)["rows"]
    stats = row["engine_stats"]
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
    return {"llama8b_step_ms": 1000 * row["seconds"] / (stats["rounds"] + 1),
            "llama8b_verify_ms": 1000 * stats["stage_s"]["verify"] / max(1, stats["rounds"]),
            "llama8b_floor_ms": 1000 * weight_bytes / bandwidth,
            "llama8b_read_floor_ms": 1000 * read_bytes / bandwidth,  # the weights a step reads: a stricter floor
            "llama8b_weight_bytes": weight_bytes, "copy_bandwidth_GBps": bandwidth / 1e9,
            "llama8b_graphs": stats["graphs"], "llama8b_warmup_s": stats["warmup_s"]}


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", type=Path, default=Path(os.environ.get("OUT", "speed")))
    ap.add_argument("--host", default="smollm2")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of this script, no timings worth keeping")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--num-prompts", type=int, default=16, help="requests per C at least (max(C, this))")
    ap.add_argument("--drafters", nargs="+", default=["ngram", "ngram-full", "eagle3", "dflash", "dspark"],
                    help="ngram-full: the n-gram drafter with full_width (verify K + 1 wide, no wait for the width)")
    ap.add_argument("--checkpoints", type=Path, default=None, help="DIR/<name>: trained drafters")
    ap.add_argument("--draft-length", type=int, default=7)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3, help="timed decodes per row (dspark.sweep's --repeats)")
    ap.add_argument("--skip-llama8b", action="store_true")
    ap.add_argument("--only-llama8b", action="store_true",
                    help="run only the llama-8b step and add its keys to OUT/speed.json")
    ap.add_argument("--compile", choices=["on", "off"], default="on",
                    help="the host's decode steps through torch.compile (dspark.engine.compiled)")
    ap.add_argument("--sdpa", nargs="+", default=None, choices=sorted(SDPA_BACKENDS),
                    help="the SDPA backends allowed (default: all, SDPA's own choice: cuDNN on Hopper)")
    ap.add_argument("--gc-freeze", choices=["on", "off"], default="on",
                    help="freeze the objects alive when a decode starts for its loop (dspark.engine.serve.quiet_gc); "
                         "off: an A/B of that")
    ap.add_argument("--drafter-admission", choices=["captured", "eager"], default="captured",
                    help="the drafter's part of each admission replayed as CUDA graphs per arrival shape "
                         "(dspark.engine.prefill.DrafterPrefill) or, for an A/B, run as called")
    ap.add_argument("--inductor", nargs="+", default=[], metavar="KEY=VALUE",
                    help="torch._inductor.config options for the compiled pieces, e.g. combo_kernels=True")
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = parser()
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.sdpa:
        restrict_sdpa(args.sdpa)
    serve_module.FREEZE_GC = args.gc_freeze == "on"
    serve_module.CAPTURE_DRAFTER_ADMISSION = args.drafter_admission == "captured"
    command = "python benchmarks/speed.py " + " ".join(argv)
    env = {**environment(torch.device(args.device)), "command": command, "host": args.host,
           "sdpa": args.sdpa or "default", "inductor": set_inductor(args.inductor), "gc_freeze": args.gc_freeze,
           "repeats": args.repeats, "compile": args.compile, "drafter_admission": args.drafter_admission}
    path = args.out_dir / "speed.json"
    if args.only_llama8b:
        result = json.loads(path.read_text()) if path.is_file() else {"environment": env}
        result.update(llama8b(compile=args.compile == "on", repeats=args.repeats, out_dir=args.out_dir))
        result["environment"]["command_llama8b"] = command
        args.out_dir.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1) + "\n")
        print(json.dumps(result, indent=1))
        return 0
    host = load_host(args.host, dtype="bfloat16" if args.device == "cuda" else "float32", device=args.device,
                     compile=args.compile == "on")
    ids = encode_prompts(host, MT_BENCH, chat=True) if host.tokenizer is not None else \
        [list(range(5 + 3 * i, 40 + 7 * i)) for i in range(6)]
    K, new = args.draft_length, args.max_new_tokens
    result: dict = {"environment": env, "new_tokens": new, "draft_length": K}
    result["hf_generate_tok_s"] = hf_tok_s(host, ids, new=new)
    result["hf_prompt_lookup_tok_s"] = hf_tok_s(host, ids, new=new, prompt_lookup_num_tokens=K)

    drafted, result["drafters"] = drafters_for(host, args.drafters, args.checkpoints, K)
    sweep = Sweep(drafted=drafted, policies=["full"], concurrency=args.concurrency, max_new_tokens=new,
                  repeats=args.repeats, stage_timing=torch.device(host.device).type == "cuda")
    prompts = [ids[i % len(ids)] for i in range(args.num_prompts)]
    header = envelope(NAME, argv=argv, host=host, options=[], prog="python benchmarks/speed.py")
    header["settings"] = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    doc = run(host, prompts, sweep, doc=header, out_dir=args.out_dir)
    plain = next((r for r in doc["rows"] if r["method"] == "plain" and r["concurrency"] == 1), None)
    result["engine_plain_tok_s"] = None if plain is None else plain["tokens_per_s"]

    import dspark.hf

    # after the engine rows (written as they finish): a failure on the device here cannot take them with it, and an
    # error the engine raises (not a device fault, which ends the process's CUDA context) is recorded, not fatal
    try:
        result["hf_custom_generate_tok_s"] = hf_tok_s(host, ids, new=new,
                                                      custom_generate=dspark.hf.speculative("ngram"))
    except Exception as error:  # noqa: BLE001 (recorded in speed.json and printed)
        result["hf_custom_generate_tok_s"] = float("nan")
        result["hf_custom_generate_error"] = f"{type(error).__name__}: {error}"
    del host
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    if not args.skip_llama8b:
        result.update(llama8b(compile=args.compile == "on", repeats=args.repeats, out_dir=args.out_dir))
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(table(result))
    return 0


def table(r: dict) -> str:
    """transformers generate() against the engine's plain decoding at C = 1, and the llama-8b step."""
    custom = r.get("hf_custom_generate_error") or f"{r['hf_custom_generate_tok_s']:.1f}"
    engine = "" if r.get("engine_plain_tok_s") is None else f"{r['engine_plain_tok_s']:.1f}"
    lines = ["| decode at C = 1 | tokens/s |", "|---|---|",
             f"| transformers generate() | {r['hf_generate_tok_s']:.1f} |",
             f"| transformers generate(prompt_lookup_num_tokens={r['draft_length']}) | "
             f"{r['hf_prompt_lookup_tok_s']:.1f} |",
             f"| transformers custom_generate=dspark.hf.speculative('ngram') | {custom} |",
             f"| dspark slot engine, plain (concurrency.json) | {engine} |"]
    if "llama8b_step_ms" in r:
        lines.append(f"\nrandom llama-8b, C = 1, compile {r['environment']['compile']}: plain step "
                     f"{r['llama8b_step_ms']:.2f} ms (verify graph {r['llama8b_verify_ms']:.2f} ms) against a "
                     f"weight-read floor of {r['llama8b_floor_ms']:.2f} ms ({r['llama8b_weight_bytes'] / 1e9:.2f} GB "
                     f"at {r['copy_bandwidth_GBps']:.0f} GB/s; the weights a step reads, the input embedding but one "
                     f"row excluded: {r['llama8b_read_floor_ms']:.2f} ms)")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
