"""Drafter training speed on one GPU: tokens/s, the step's split, achieved TFLOP/s against a bf16 GEMM measured in the
same run, and peak memory, for DSpark, DFlash and EAGLE-3 on random hosts of real shapes, the fused loss
(TrainConfig.loss_impl = fused, the default) against the reference loss it replaced.

    python benchmarks/train_speed.py                                  # GPU: both shapes, the three drafters
    python benchmarks/train_speed.py --shapes qwen2.5-coder-1.5b --drafters dspark --steps 3 --out-dir /tmp/ts
    python benchmarks/train_speed.py --device cpu --out-dir /tmp/ts   # CPU smoke: the tiny shape, seconds

Nothing to bring along: the hosts are `random:<shape>` (dspark.engine.models, seeded random weights of the real
shape, built on the device) and the rows synthetic: each of --batch-size rows of --seq-len tokens packs documents of
PROMPT prompt tokens and RESPONSE response tokens (the recipes' data: the host's own answers of at most 320 tokens),
random ids. The drafters are built with the Qwen2.5-Coder-1.5B recipes' drafter_args
(experiments/recipes/qwen2.5-coder-1.5b-<drafter>.yaml: DSpark 5 layers, block size 7, Markov head of rank 256,
confidence, 1024 anchors per row; DFlash the same backbone; EAGLE-3 ttt_length 7, a 32,000-token draft vocabulary),
on both shapes, and trained as `dspark train` does: the host's forward under no_grad (dspark.training.train
make_batch), bf16 autocast over float32 master weights, clipping at 1.0, fused AdamW.

Each (shape, drafter, loss) row: --warmup steps (compilation, allocator), then --steps timed ones. ms per step split
into host / forward (the drafter's forward and loss) / backward / optimizer by CUDA events (wall clock on a CPU);
tokens/s = rows x seq_len / step time. FLOPs per step: the matrix products' 2mnk from the shapes (the host's forward,
the drafter's forward, its backward at twice the forward's cost where both inputs and weights take gradients, once
where only one does, nothing for the frozen LM head's weight), attention counted over the keys each query may see
(causal within its document); `fraction_of_peak` = achieved TFLOP/s / the bf16 GEMM rate of an 8192^3 product timed
in the same run. A row that fails (out of memory) is recorded with its error, not raised.

Writes OUT/train_speed.json ({"environment", "gemm_tflops", "settings", "rows": fused, "baseline": reference, and
"compiled" for --compile-layers}) and OUT/train_speed.md (the tables).
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import platform
import sys
import time
import warnings
from datetime import datetime, timezone
from pathlib import Path
from typing import NamedTuple

import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from drafters import build_drafter  # noqa: E402
from dspark.engine.models import load_host  # noqa: E402
from dspark.training.data import TokenizedChat, pack  # noqa: E402
from dspark.training.train import compile_layers, make_batch, make_optimizer  # noqa: E402

DRAFTERS = ("dspark", "dflash", "eagle3")


class Shape(NamedTuple):
    host: str  # random:<shape>
    prompt: int  # prompt tokens per packed document (no targets)
    response: int  # response tokens per packed document (targets; anchors sit here)
    drafter_args: dict  # per drafter: overrides of the recipe's drafter_args


SHAPES = {
    "qwen2.5-coder-1.5b": Shape("random:qwen2.5-coder-1.5b", prompt=192, response=320, drafter_args={}),
    "llama-8b": Shape("random:llama-8b", prompt=192, response=320, drafter_args={}),
    # the CPU smoke: a tiny host and drafters, so the whole run takes seconds
    "tiny": Shape("random:tiny-llama", prompt=12, response=20, drafter_args={
        "dspark": dict(num_layers=1, rank=16, max_anchors=24), "dflash": dict(num_layers=1, max_anchors=24),
        "eagle3": dict(ttt_length=3, draft_vocab=128)}),
}


def recipe_args(drafter: str) -> dict:
    """drafter_args of experiments/recipes/qwen2.5-coder-1.5b-<drafter>.yaml."""
    recipe = yaml.safe_load((ROOT / f"experiments/recipes/qwen2.5-coder-1.5b-{drafter}.yaml").read_text())
    return dict(recipe["train"]["drafter_args"])


def synthetic_rows(shape: Shape, *, vocab: int, batch_size: int, seq_len: int, seed: int) -> list[TokenizedChat]:
    """batch_size packed rows of seq_len tokens: documents of shape.prompt prompt and shape.response response tokens,
    random ids."""
    g = torch.Generator().manual_seed(seed)
    length = shape.prompt + shape.response
    n = batch_size * math.ceil(seq_len / length)
    docs = [TokenizedChat(torch.randint(0, vocab, (length,), generator=g).tolist(),
                          [0] * shape.prompt + [1] * shape.response) for _ in range(n)]
    return pack(docs, seq_len=seq_len, max_rows=batch_size)


# ---- FLOPs from the shapes -----------------------------------------------------------------------------------------

def _layer_flops(tokens: int, H: int, Nq: int, Nkv: int, I: int, *, qkv_in: int | None = None) -> float:
    """Matrix-product FLOPs of one decoder layer's projections and MLP on `tokens` tokens (attention scores apart)."""
    qkv_in = qkv_in or H
    return 2 * tokens * (qkv_in * (Nq + 2 * Nkv) + Nq * H + 3 * H * I)


def step_flops(host, drafter, rows: list[TokenizedChat]) -> dict:
    """{"host", "drafter", "total"} matrix-product FLOPs of one training step (module docstring)."""
    cfg = host.config
    H, L, V, I = host.hidden_size, host.num_layers, host.vocab_size, cfg.intermediate_size
    D = host.head_dim
    Nq, Nkv = host.num_heads * D, host.num_kv_heads * D
    B, T = len(rows), len(rows[0].input_ids)
    # keys a causal query sees within its document, summed over the row's positions
    doc_lengths = [torch.tensor(r.document_ids).bincount().tolist() for r in rows]
    causal_keys = sum(n * (n + 1) / 2 for lengths in doc_lengths for n in lengths)
    host_flops = L * (_layer_flops(B * T, H, Nq, Nkv, I) + 4 * causal_keys * Nq) + 2 * B * T * H * V
    dcfg = drafter.config
    m = len(drafter.feature_layers)
    fc = 2 * B * T * m * H * H * 2  # forward and the weight's gradient (the features take none)
    if drafter.kind == "dspark":
        S, A = dcfg.block_size, _anchors(rows, dcfg.max_anchors)
        slots = B * A * S
        # a block's queries see the context before its anchor within its document and the S slots of the block
        mean_context = _mean_anchor_position(rows)
        attention = 4 * slots * (mean_context + S) * Nq
        per_layer = _layer_flops(slots, H, Nq, Nkv, I) + 2 * B * T * H * 2 * Nkv + attention
        head = 2 * slots * H * V * 2  # the frozen LM head: forward and the hidden states' gradient
        if dcfg.head != "none":
            head += 2 * slots * dcfg.rank * V * 3  # W2: forward, its input's and its weight's gradients
        drafter_flops = fc + 3 * dcfg.num_layers * per_layer + head
    else:  # eagle3: ttt_length unrolled steps of one layer over every position
        S, Vq = dcfg.ttt_length, dcfg.draft_vocab or V
        per_step = _layer_flops(B * T, H, Nq, Nkv, I, qkv_in=2 * H) + 4 * causal_keys * Nq
        head = 2 * B * T * H * Vq * (3 if dcfg.draft_vocab else 2)  # a trainable draft head takes a gradient too
        drafter_flops = fc + S * (3 * per_step + head)
    return {"host": host_flops, "drafter": drafter_flops, "total": host_flops + drafter_flops}


def _candidates(row: TokenizedChat) -> list[int]:
    """In-document positions of a row's anchor candidates (the next token is a response token of the document)."""
    out, start = [], 0
    for t in range(len(row.input_ids) - 1):
        if t and row.document_ids[t] != row.document_ids[t - 1]:
            start = t
        if row.loss_mask[t + 1] and row.document_ids[t + 1] == row.document_ids[t]:
            out.append(t - start)
    return out


def _anchors(rows, max_anchors: int) -> int:
    return min(max_anchors, max(len(_candidates(r)) for r in rows))


def _mean_anchor_position(rows) -> float:
    positions = [p for r in rows for p in _candidates(r)]
    return sum(positions) / len(positions)


def gemm_tflops(device: torch.device, n: int) -> float:
    """TFLOP/s of an n^3 matrix product (bf16 on CUDA, float32 on a CPU), the mean of timed products after warm-ups."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    repeats = 10 if device.type == "cuda" else 2
    for _ in range(3):
        a @ b
    clock = Clock(device)
    clock.start()
    for _ in range(repeats):
        a @ b
    seconds = clock.lap_all()[0]
    return 2 * n**3 * repeats / seconds / 1e12


# ---- timing -------------------------------------------------------------------------------------------------------

class Clock:
    """Stage times: CUDA events recorded between stages and read once at the end (no synchronize between them), or
    wall clock on a CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def start(self) -> None:
        self.marks = []
        self.mark()

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def lap_all(self) -> list[float]:
        """Seconds between consecutive marks (ending with a mark now)."""
        self.mark()
        if self.cuda:
            self.marks[-1].synchronize()
            return [a.elapsed_time(b) / 1e3 for a, b in zip(self.marks, self.marks[1:])]
        return [b - a for a, b in zip(self.marks, self.marks[1:])]


STAGES = ("host", "forward", "backward", "optimizer")


def time_row(host, shape_name: str, drafter_name: str, rows, *, loss_impl: str, compiled: bool, args,
             device: torch.device) -> dict:
    """One (shape, drafter, loss) row: warm-up and timed training steps of a freshly built drafter."""
    shape = SHAPES[shape_name]
    overrides = {**recipe_args(drafter_name), **shape.drafter_args.get(drafter_name, {})}
    row = {"shape": shape_name, "drafter": drafter_name, "loss_impl": loss_impl, "compile_layers": compiled,
           "drafter_args": overrides}
    drafter = optimizer = batch = None
    try:
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*has no checkpoint.*")
            drafter = build_drafter(drafter_name, host, **overrides).to(device)
        if getattr(drafter.config, "draft_vocab", 0):
            # the recipe's reduced vocabulary; which ids does not change the cost
            drafter.set_draft_vocab(torch.arange(drafter.config.draft_vocab))
        drafter.loss_impl = loss_impl
        drafter.train()
        if compiled:
            compile_layers(drafter)
        trainable = [p for p in drafter.parameters() if p.requires_grad]
        optimizer = make_optimizer(trainable, lr=6e-4, weight_decay=0.0, device=device)
        use_bf16 = device.type == "cuda"
        autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if use_bf16 else contextlib.nullcontext
        taps = tuple(drafter.feature_layers)
        seeds = torch.arange(len(rows))
        flops = step_flops(host, drafter, rows)
        clock = Clock(device)
        steps = []
        for i in range(args.warmup + args.steps):
            if i == args.warmup and device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats(device)
            started = time.perf_counter()
            clock.start()
            batch = make_batch(host, rows, taps=taps, device=device, pad_token_id=0, anchor_seeds=seeds,
                               autocast=autocast, loss_impl=loss_impl)
            clock.mark()
            with autocast():
                out = drafter.training_loss(batch)
            clock.mark()
            out.loss.backward()
            clock.mark()
            torch.nn.utils.clip_grad_norm_(trainable, 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            laps = clock.lap_all()  # synchronizes: the step is over
            wall = time.perf_counter() - started
            last_loss = float(out.loss.detach())
            batch = out = None
            if i >= args.warmup:
                steps.append({"wall_s": wall, **dict(zip(STAGES, laps))})
        if args.profile:
            profile_step(lambda: train_once(host, drafter, optimizer, trainable, rows, taps, seeds, autocast,
                                            loss_impl, device),
                         Path(args.out_dir) / f"profile_{shape_name}_{drafter_name}_{loss_impl}"
                                              f"{'_compiled' if compiled else ''}.txt", device)
        tokens = sum(len(r.input_ids) for r in rows)
        step_s = sorted(s["wall_s"] for s in steps)[len(steps) // 2]  # the median step
        row.update({
            "tokens_per_step": tokens, "step_ms": 1e3 * step_s, "tokens_per_s": tokens / step_s,
            **{f"{k}_ms": 1e3 * sorted(s[k] for s in steps)[len(steps) // 2] for k in STAGES},
            "flops_per_step": flops["total"], "host_flops": flops["host"], "drafter_flops": flops["drafter"],
            "tflops": flops["total"] / step_s / 1e12,
            "fraction_of_peak": flops["total"] / step_s / 1e12 / args.gemm_tflops,
            "peak_memory_gb": (torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None),
            "trainable_parameters": sum(p.numel() for p in trainable), "last_loss": last_loss,
        })
    except torch.cuda.OutOfMemoryError as error:
        row["error"] = f"out of memory: {str(error).splitlines()[0]}"
    finally:
        drafter = optimizer = batch = None
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return row


def train_once(host, drafter, optimizer, trainable, rows, taps, seeds, autocast, loss_impl, device) -> None:
    """One untimed training step, as the timed ones."""
    batch = make_batch(host, rows, taps=taps, device=device, pad_token_id=0, anchor_seeds=seeds, autocast=autocast,
                       loss_impl=loss_impl)
    with autocast():
        out = drafter.training_loss(batch)
    out.loss.backward()
    torch.nn.utils.clip_grad_norm_(trainable, 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def profile_step(step, path: Path, device: torch.device) -> None:
    """step() under torch.profiler; its operators by device (or CPU) time, the top 40, into `path`."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    path.write_text(prof.key_averages().table(sort_by=key, row_limit=40, max_name_column_width=80))


# ---- the run ------------------------------------------------------------------------------------------------------

def environment(device: torch.device) -> dict:
    import transformers

    return {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "python": platform.python_version(),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "triton": _version("triton"), "platform": platform.platform(), "device": str(device),
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None}


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


COLUMNS = [("shape", "host shape"), ("drafter", "drafter"), ("tokens_per_s", "tokens/s"), ("step_ms", "ms / step"),
           ("host_ms", "host"), ("forward_ms", "forward"), ("backward_ms", "backward"), ("optimizer_ms", "optimizer"),
           ("tflops", "TFLOP/s"), ("fraction_of_peak", "of GEMM peak"), ("peak_memory_gb", "peak GB")]


def table(rows: list[dict]) -> list[str]:
    lines = ["| " + " | ".join(h for _, h in COLUMNS) + " |", "|" + " --- |" * len(COLUMNS)]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['shape']} | {r['drafter']} | " + r["error"] + " |" + " |" * (len(COLUMNS) - 3))
            continue
        cells = [r["shape"], r["drafter"], f"{r['tokens_per_s']:,.0f}"] + \
            [f"{r[k]:.1f}" for k in ("step_ms", "host_ms", "forward_ms", "backward_ms", "optimizer_ms")] + \
            [f"{r['tflops']:.1f}" if r["tflops"] >= 1 else f"{r['tflops']:.3g}"] + \
            [f"{r['fraction_of_peak']:.1%}", "-" if r["peak_memory_gb"] is None else f"{r['peak_memory_gb']:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def speedups(result: dict) -> list[str]:
    """Fused against reference tokens/s, per (shape, drafter)."""
    base = {(r["shape"], r["drafter"]): r for r in result["baseline"]}
    lines = ["| host shape | drafter | fused tokens/s | reference tokens/s | x reference |", "| --- | --- | --- | --- | --- |"]
    for r in result["rows"]:
        b = base.get((r["shape"], r["drafter"]))
        if b is None:
            continue
        fused = "-" if "error" in r else f"{r['tokens_per_s']:,.0f}"
        ref = b.get("error", None) or f"{b['tokens_per_s']:,.0f}"
        ratio = f"{r['tokens_per_s'] / b['tokens_per_s']:.2f}" if "error" not in r and "error" not in b else "-"
        lines.append(f"| {r['shape']} | {r['drafter']} | {fused} | {ref} | {ratio} |")
    return lines


def write_markdown(result: dict, path: Path, command: str) -> None:
    env, settings = result["environment"], result["settings"]
    lines = [f"# Drafter training speed ({env['gpu'] or 'CPU'})", "",
             f"`{command}` on {env['gpu'] or env['platform']}, torch {env['torch']}, transformers "
             f"{env['transformers']}, triton {env['triton']}, Python {env['python']}, {env['date']}.",
             f"{settings['batch_size']} rows x {settings['seq_len']} tokens a step, {settings['warmup']} warm-up and "
             f"{settings['steps']} timed steps (medians). Measured GEMM rate: {result['gemm_tflops']:.0f} TFLOP/s "
             f"({settings['gemm_n']}^3 {'bf16' if env['gpu'] else 'float32'} product).", "",
             "## Fused loss (the default)", "", *table(result["rows"]), "",
             "## Reference loss", "", *table(result["baseline"]), ""]
    if result.get("compiled"):
        lines += ["## Fused loss, compile_layers", "", *table(result["compiled"]), ""]
    lines += ["## Fused against reference", "", *speedups(result), ""]
    path.write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shapes", nargs="+", default=None, choices=sorted(SHAPES),
                        help="host shapes (default: qwen2.5-coder-1.5b llama-8b on a GPU, tiny on a CPU)")
    parser.add_argument("--drafters", nargs="+", default=list(DRAFTERS), choices=DRAFTERS)
    parser.add_argument("--steps", type=int, default=None, help="timed steps per row (default 5 on a GPU, 1 on a CPU)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 2 on a GPU, 1 on a CPU)")
    parser.add_argument("--batch-size", type=int, default=None, help="rows a step (default 2, the recipes')")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens a row (default 2048 on a GPU, 128 on a CPU)")
    parser.add_argument("--compile-layers", nargs="*", default=[], metavar="DRAFTER[@SHAPE]",
                        help="drafters also timed with TrainConfig.compile_layers (fused loss), on every shape or on "
                             "SHAPE only: the 'compiled' rows")
    parser.add_argument("--render", action="store_true", help="only rewrite OUT/train_speed.md from its JSON")
    parser.add_argument("--no-baseline", action="store_true", help="skip the reference-loss rows")
    parser.add_argument("--profile", action="store_true",
                        help="after each row's timed steps, one more under torch.profiler: OUT/profile_<shape>_<drafter>_"
                             "<loss>.txt, its operators by CUDA time")
    parser.add_argument("--out-dir", default=str(ROOT / "benchmarks/results/training"))
    args = parser.parse_args(argv)
    out = Path(args.out_dir)
    command = "python benchmarks/train_speed.py " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.render:
        result = json.loads((out / "train_speed.json").read_text())
        write_markdown(result, out / "train_speed.md", result["command"])
        return result
    compiled_on = [tuple(spec.partition("@")[::2]) for spec in args.compile_layers]
    bad = [d for d, _ in compiled_on if d not in DRAFTERS]
    if bad:
        parser.error(f"--compile-layers: unknown drafters {bad}; choose from {DRAFTERS}")
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    args.shapes = args.shapes or (["qwen2.5-coder-1.5b", "llama-8b"] if gpu else ["tiny"])
    args.steps = args.steps or (5 if gpu else 1)
    args.warmup = args.warmup if args.warmup is not None else (2 if gpu else 1)
    args.batch_size = args.batch_size or 2
    args.seq_len = args.seq_len or (2048 if gpu else 128)
    gemm_n = 8192 if gpu else 512
    args.gemm_tflops = gemm_tflops(device, gemm_n)
    print(f"GEMM: {args.gemm_tflops:.4g} TFLOP/s", flush=True)
    result = {"command": command, "environment": environment(device), "gemm_tflops": args.gemm_tflops,
              "settings": {"batch_size": args.batch_size, "seq_len": args.seq_len, "steps": args.steps,
                           "warmup": args.warmup, "gemm_n": gemm_n, "shapes": {k: SHAPES[k].host for k in args.shapes}},
              "rows": [], "baseline": [], "compiled": []}
    out.mkdir(parents=True, exist_ok=True)
    for shape_name in args.shapes:
        shape = SHAPES[shape_name]
        host = load_host(shape.host, device=device, dtype=torch.bfloat16 if gpu else torch.float32)
        rows = synthetic_rows(shape, vocab=host.vocab_size, batch_size=args.batch_size, seq_len=args.seq_len, seed=0)
        runs = [("rows", "fused", False)] + ([] if args.no_baseline else [("baseline", "reference", False)])
        for drafter_name in args.drafters:
            compiled = any(d == drafter_name and shape in ("", shape_name) for d, shape in compiled_on)
            plan = runs + ([("compiled", "fused", True)] if compiled else [])
            for key, impl, compiled in plan:
                row = time_row(host, shape_name, drafter_name, rows, loss_impl=impl, compiled=compiled, args=args,
                               device=device)
                result[key].append(row)
                print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()
                                  if k != "drafter_args"}), flush=True)
                (out / "train_speed.json").write_text(json.dumps(result, indent=1))  # a crash keeps the rows so far
        host = None
        gc.collect()
        if gpu:
            torch.cuda.empty_cache()
    (out / "train_speed.json").write_text(json.dumps(result, indent=1))
    write_markdown(result, out / "train_speed.md", command)
    return result


if __name__ == "__main__":
    main()
