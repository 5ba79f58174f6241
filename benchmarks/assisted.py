"""The classic pair side by side: a small LM drafting for its larger sibling, through transformers' assisted
generation and through the slot engine, in one process on one device.

    python benchmarks/assisted.py --host qwen2.5-coder-1.5b --assistant qwen2.5-coder-0.5b \\
        --out-dir runs/small-lm                                                # GPU: bf16, greedy, 256 new tokens
    python benchmarks/assisted.py --host random:tiny-qwen2 --assistant random:tiny-qwen2 --device cpu \\
        --num-prompts 2 --max-new-tokens 8 --draft-lengths 1 3 --concurrency 1 2 --out-dir /tmp/assisted  # smoke

Rows, per prompt set (HumanEval's first --num-prompts prompts and the six MT-Bench first turns, chat-templated):
- transformers `generate()` plain and `generate(assistant_model=<assistant>)`, one prompt at a time (C = 1): its
  default assistant settings (the assistant's generation_config as loaded) and `num_assistant_tokens` = each of
  --num-assistant-tokens with the constant schedule; the best of those is marked;
- dspark plain and the small-LM drafter at every --draft-length γ, at every --concurrency (C requests in flight on
  the slot engine), verify-all, with the device seconds of each round's stages (draft / verify / accept) on CUDA;
- the γ `verifiers.draft_length.choose_draft_length` predicts from the drafter's measured acceptance (at the longest
  γ, C = 1) and its profiled step costs, with its reason, beside the γ that measured fastest.
Every row says whether its tokens equal its own plain greedy decoding (transformers' rows against transformers
plain, the engine's against the engine's plain at the same C). Writes OUT_DIR/assisted.json and assisted.md. Never
imported by the package.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # _generate, beside this script

from dspark.api import encode_prompts, load_host  # noqa: E402
from dspark.engine.jsonio import dumps  # noqa: E402
from dspark.engine.workload import PROMPTS as MT_BENCH  # noqa: E402
from dspark.quickstart import environment  # noqa: E402
from dspark.sweep import Drafted, Sweep, measure  # noqa: E402
from _generate import hf_decode  # noqa: E402  (benchmarks/_generate.py)


def transformers_rows(host, assistant_model, prompts: list[list[int]], *, new: int,
                      assistant_tokens: list[int]) -> list[dict]:
    """transformers plain, assisted with the assistant's own settings, then at each num_assistant_tokens."""
    plain = hf_decode(host.model, prompts, new=new)
    rows = [{"method": "transformers plain", "concurrency": 1, **plain}]
    config = assistant_model.generation_config
    default = (getattr(config, "num_assistant_tokens", None), getattr(config, "num_assistant_tokens_schedule", None))
    rows.append({"method": "transformers assisted (default)", "num_assistant_tokens": default[0],
                 "schedule": default[1], "concurrency": 1,
                 **hf_decode(host.model, prompts, new=new, assistant_model=assistant_model)})
    for n in assistant_tokens:
        config.num_assistant_tokens, config.num_assistant_tokens_schedule = n, "constant"
        rows.append({"method": f"transformers assisted (num_assistant_tokens={n})", "num_assistant_tokens": n,
                     "schedule": "constant", "concurrency": 1,
                     **hf_decode(host.model, prompts, new=new, assistant_model=assistant_model)})
    config.num_assistant_tokens, config.num_assistant_tokens_schedule = default
    for row in rows:
        row["identical_to_plain"] = sum(a == b for a, b in zip(row["token_ids"], plain["token_ids"])) / len(prompts)
        row["ratio_to_plain"] = (row["tokens_per_s"] / plain["tokens_per_s"]
                                 if row["tokens_per_s"] and plain["tokens_per_s"] else None)
    assisted = [r for r in rows if r["method"].startswith("transformers assisted")]
    best = max(assisted, key=lambda r: r["tokens_per_s"] or 0.0)
    best["best"] = True
    return rows


def stage_ms(row: dict) -> dict | None:
    """A row's device ms per round by stage (draft / verify / accept ...), from its engine_stats, or None."""
    stats = row.get("engine_stats") or {}
    stage_s, rounds = stats.get("stage_s"), stats.get("rounds")
    if not stage_s or not rounds:
        return None
    return {name: 1e3 * seconds / rounds for name, seconds in stage_s.items()}


def engine_rows(host, drafter, prompts: list[list[int]], *, new: int, draft_lengths: list[int],
                concurrency: list[int], out_dir: Path) -> list[dict]:
    """dspark plain and the small-LM drafter at every γ and C (dspark.sweep), verify-all, greedy."""
    sweep = Sweep(drafted=[Drafted("small-lm", k, drafter) for k in draft_lengths], policies=["full"],
                  concurrency=concurrency, max_new_tokens=new,
                  stage_timing=torch.device(host.device).type == "cuda")
    rows = measure(host, prompts, sweep, out_dir=out_dir)["rows"]
    for row in rows:
        row["method"] = "dspark plain" if row["method"] == "plain" else "dspark small-lm"
        row["ratio_to_plain"] = row.pop("speedup", None)
        row["stage_ms_per_round"] = stage_ms(row)
    return rows


def predicted_choice(host, drafter, rows: list[dict], *, draft_lengths: list[int], context: int) -> dict | None:
    """The γ the cost model predicts from the acceptance measured at the longest γ (C = 1) and profiled steps."""
    from verifiers.cost_model import draft_key, profile, profile_draft
    from verifiers.draft_length import choose_draft_length

    longest = max(draft_lengths)
    measured = next((r for r in rows if r["method"] == "dspark small-lm" and r["draft_length"] == longest
                     and r["concurrency"] == 1), None)
    if measured is None or not measured.get("conditional_acceptance"):
        return None
    cost = profile(host, batch_sizes=[1], tokens_per_request=sorted({1, *[k + 1 for k in draft_lengths]}),
                   context=context, repeats=5, warmup=2)
    for k in draft_lengths:
        cost.draft[draft_key(drafter, k)] = profile_draft(host, drafter, batch_sizes=[1], draft_length=k,
                                                          context=context, repeats=5, warmup=2)
    choice = choose_draft_length(cost, measured["conditional_acceptance"], key_for=lambda k: draft_key(drafter, k),
                                 lengths=draft_lengths)
    return choice.to_dict()


def prompt_sets(host, names: list[str], n: int, max_prompt_length: int) -> dict[str, list[list[int]]]:
    """{set: prompts}: HumanEval's first n prompts (chat-templated, at most max_prompt_length tokens) and the six
    MT-Bench first turns; seeded random token ids for a host without a tokenizer."""
    if host.tokenizer is None:
        g = torch.Generator().manual_seed(0)
        return {name: [torch.randint(0, host.vocab_size, (8 + 5 * i,), generator=g).tolist() for i in range(n)]
                for name in names}
    sets = {}
    for name in names:
        if name == "mtbench":
            sets[name] = encode_prompts(host, MT_BENCH, chat=True)[:n]
        else:
            from dspark.cli import EvalOptions, eval_prompts

            sets[name] = eval_prompts(host, EvalOptions(data=name, split="all", limit=n,
                                                        max_prompt_length=max_prompt_length))
    return sets


def table(doc: dict) -> str:
    lines = [f"`{doc['command']}` — {doc['environment'].get('date', '')}, "
             f"{doc['environment'].get('gpu') or doc['environment'].get('processor', '')}, "
             f"torch {doc['environment'].get('torch', '')}, transformers {doc['environment'].get('transformers', '')}",
             ""]
    for name, part in doc["sets"].items():
        lines += [f"## {name}", "", "| method | γ | C | τ | tokens/s | × its plain | = its plain | draft / verify / "
                  "accept ms a round |", "|---|---|---|---|---|---|---|---|"]
        for r in part["rows"]:
            stages = r.get("stage_ms_per_round") or {}
            split = " / ".join(f"{stages[k]:.2f}" for k in ("draft", "verify", "accept") if k in stages) or "–"
            gamma = r.get("draft_length", r.get("num_assistant_tokens")) or "–"
            tau = f"{r['tau']:.2f}" if r.get("tau") is not None else "–"
            ratio = f"{r['ratio_to_plain']:.3f}" if r.get("ratio_to_plain") is not None else "–"
            lines.append(f"| {r['method']}{' (best)' if r.get('best') else ''} | {gamma} | {r['concurrency']} | {tau} | "
                         f"{r['tokens_per_s']:.1f} | {ratio} | {r['identical_to_plain']:.2f} | {split} |")
        choice = part.get("predicted")
        if choice:
            lines += ["", f"Predicted: {choice['reason']}; measured fastest at C = 1: γ = {part['fastest_gamma']}."]
        lines.append("")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python benchmarks/assisted.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--host", default="qwen2.5-coder-1.5b")
    ap.add_argument("--assistant", default="qwen2.5-coder-0.5b", help="the small LM, named as hosts are")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--sets", nargs="+", default=["humaneval", "mtbench"])
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-prompt-length", type=int, default=512)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--draft-lengths", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6, 7])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--num-assistant-tokens", type=int, nargs="+", default=[3, 5, 7, 10, 20])
    ap.add_argument("--compile", choices=["on", "off"], default=None, help="default: on with CUDA")
    ap.add_argument("--out-dir", type=Path, default=Path("runs/assisted"))
    return ap


def main(argv: list[str] | None = None) -> int:
    from drafters.small_lm import SmallLMDrafter

    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    if min(args.draft_lengths) < 1 or min(args.concurrency) < 1 or args.num_prompts < 1:
        raise SystemExit("--draft-lengths, --concurrency and --num-prompts must be >= 1")
    cuda = torch.device(args.device).type == "cuda"
    compile_on = cuda if args.compile is None else args.compile == "on"
    dtype = "bfloat16" if cuda else "float32"
    host = load_host(args.host, dtype=dtype, device=args.device, compile=compile_on)
    drafter = SmallLMDrafter.from_pretrained(args.assistant, host)
    doc = {"experiment": "assisted", "command": "python benchmarks/assisted.py " + " ".join(argv),
           "environment": environment(torch.device(args.device)), "host": args.host, "assistant": args.assistant,
           "dtype": dtype, "compile": compile_on, "max_new_tokens": args.max_new_tokens, "sets": {}}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for name, prompts in prompt_sets(host, args.sets, args.num_prompts, args.max_prompt_length).items():
        rows = transformers_rows(host, drafter.lm.model, prompts, new=args.max_new_tokens,
                                 assistant_tokens=args.num_assistant_tokens)
        rows += engine_rows(host, drafter, prompts, new=args.max_new_tokens, draft_lengths=args.draft_lengths,
                            concurrency=args.concurrency, out_dir=args.out_dir)
        for row in rows:
            row.pop("token_ids", None)
        at_one = [r for r in rows if r["method"] == "dspark small-lm" and r["concurrency"] == 1]
        part = {"prompts": len(prompts), "rows": rows,
                "fastest_gamma": max(at_one, key=lambda r: r["tokens_per_s"])["draft_length"] if at_one else None}
        context = max(len(p) for p in prompts) + args.max_new_tokens
        part["predicted"] = predicted_choice(host, drafter, rows, draft_lengths=args.draft_lengths, context=context)
        doc["sets"][name] = part
        (args.out_dir / "assisted.json").write_text(dumps(doc, indent=1) + "\n")
    (args.out_dir / "assisted.md").write_text("# The small LM through transformers and through dspark\n\n"
                                              + table(doc) + "\n")
    print(table(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
