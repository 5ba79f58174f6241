#!/usr/bin/env bash
# The fast-engine run on one H200 (issues 21 and 22), one phase per device call (each well under the 10-minute
# limit of a call), every result written to $OUT. Stage first (`python ../shared/stage_offline.py`, one call per
# chunk running `bash .device-stage/N/unstage.sh`), then, back to back while the machine is warm:
#
#   PHASE=tests bash experiments/runs/engine_h200.sh        # tests/test_engine_cuda.py  -> engine_cuda_tests.log
#   PHASE=speed bash experiments/runs/engine_h200.sh        # speed.py --compile both (--overlap both) -> speed.json
#   PHASE=llama8b bash experiments/runs/engine_h200.sh      # the random llama-8b step, added to that speed.json
#   PHASE=validate bash experiments/runs/engine_h200.sh     # simulator_validation.json (+ .md, .png, cost.json)
#   PHASE=concurrency bash experiments/runs/engine_h200.sh  # concurrency.json: break-even, scheduler vs fixed gamma
#   PHASE=sps8b bash experiments/runs/engine_h200.sh        # cost_llama8b.json: the random llama-8b SPS(B) table
#   PHASE=train bash experiments/runs/engine_h200.sh        # a short DSpark + EAGLE-3 training for the speed rows
#   PHASE=profile bash experiments/runs/engine_h200.sh      # round_profile.json: kernels and ms per round stage
#   PHASE=pack-cache bash experiments/runs/engine_h200.sh   # inductor's cache in pieces, to stage next session
#   PHASE=gcpause bash experiments/runs/engine_h200.sh      # gc_pause/: the loop's garbage collections, frozen or not
#
# tests, profile, gcpause and sps8b need no staging (random hosts): PHASE="tests profile" is a good first call of a
# fresh machine.
#
# sps8b (issue 22, item 6): the random llama-8b host's verify steps, replayed as CUDA graphs, bf16, at 1..512
# requests x 1, 2, 4, 8 tokens, with an 8B-shaped DSpark drafter's own propose / observe cost (random weights: a
# cost, not an acceptance). Back on the CPU machine, the SmolLM2 acceptance traces predict fixed-gamma break-even on
# that host: `dspark experiment simulate --traces benchmarks/cpu/acceptance_ngram_smollm2/trace_ngram_*.json
# --cost-table benchmarks/h200/cost_llama8b.json --policies full scheduler --concurrency 1 2 4 8 16 32 64 128 256
# 512 --out-dir benchmarks/h200/predict_llama8b` (the trained drafters' traces join once their checkpoints exist).
#
# HOST (default smollm2), NEW (new tokens, default 128), NUM_PROMPTS, CONC and DRAFTERS override the settings,
# POLICIES, GAMMAS and REPEATS (--repeats) the concurrency phase's; STAGE_TIMING=1 makes that phase a diagnostic
# (--stage-timing: each row's engine_stats.stage_s splits its rounds' device time by stage) in $OUT/stage_timing;
# TESTS the test files of the tests phase; SPEED_COMPILE (on, off, default both) speed.py's --compile; HOST8B and
# SPS_MODE the sps8b host and timing mode (a CPU dry run: HOST8B=random:tiny-llama SPS_MODE=eager). SDPA (e.g.
# SDPA=efficient) the SDPA backends that the profile and speed phases allow (profile: round_profile_sdpa-<names>.json;
# speed: $OUT/speed-sdpa-<names>/speed.json); INDUCTOR (e.g. INDUCTOR=combo_kernels=True) torch._inductor.config
# options for both; PROFILE_METHODS, PROFILE_COMPILE and PROFILE_PROMPT the profile's --methods, --compile and
# --prompt-length (e.g. 480: a ShareGPT-length context, where the concurrency run's DSpark rounds were slow).
# GC_FREEZE=off runs the speed phase with --gc-freeze off (the loop's garbage collector as Python leaves it; an A/B of
# dspark.engine.serve.quiet_gc) into $OUT/speed-gc-off/; DRAFTER_ADMISSION=eager with --drafter-admission eager (the
# drafter's part of each admission as called, not replayed: an A/B of dspark.engine.prefill.DrafterPrefill) into
# $OUT/speed-admission-eager/.
# CHECKPOINTS=DIR (DIR/<drafter> save_pretrained folders, e.g. from experiments/runs/smollm2_h200.py) makes the
# DSpark / DFlash / EAGLE-3 rows trained ones (PHASE=train writes /tmp/dspark-run/<drafter>: STEPS, default 400, of
# experiments/runs/smollm2_h200.py's recipe on its recorded regeneration, TRAIN_DRAFTERS default dspark,eagle3; then
# CHECKPOINTS=/tmp/dspark-run for the later phases while the machine stays warm, or in the same call, e.g.
# PHASE="train concurrency": each phase looks its folders up as it starts, and a timing phase whose CHECKPOINTS
# holds none is skipped, said in no_checkpoints.txt, rather than run random; WARM_COMPILE=0 skips its compile
# warm-up beside EAGLE-3's training; the timing phases first wait, up to
# TRAIN_GUARD_S = 300 s, for a training PHASE=train left running, else write contended.txt); without it they are
# random-initialised (tau ~1: the rows then measure the engine's overhead at that tau, and the results say so).
# COMPILE=on|off|auto sets --compile of the validate and concurrency phases (default auto: compiled on CUDA). The
# first phase of a fresh machine converts the staged GGUF into $DSPARK_CACHE (about 20 s), which later phases
# reuse while the machine stays warm. Staging for tests, train, speed and llama8b: `python ../shared/stage_offline.py
# --no-data --chunk-mib 40 --out .stage-smol` (three chunks: a chunk and the working tree, about 19 MiB on
# 2026-12-07, share one call's 64 MiB carry, and 47 MiB chunks no longer fitted); validate and concurrency read
# ShareGPT prompts: also `--no-smollm2 --out .stage-data` (one chunk, carried beside the last model chunk).
set -euo pipefail
OUT=${OUT:?set OUT}
PHASE=${PHASE:?set PHASE to tests, profile, speed, llama8b, validate, concurrency, sps8b or train}
STAGE=${STAGE:-/tmp/dspark-stage}
mkdir -p "$OUT" /tmp/site
# the staged wheels and GGUF, where staged (the random-host phases, tests and sps8b, need neither)
if ! python3 -c "import gguf" 2>/dev/null && compgen -G "$STAGE/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site "$STAGE"/*.whl
fi
export PYTHONPATH=/tmp/site:.${PYTHONPATH:+:$PYTHONPATH} HF_HUB_OFFLINE=1 WANDB_MODE=offline
export DSPARK_CACHE=${DSPARK_CACHE:-/tmp/dspark-cache}
if [ -z "${DSPARK_SMOLLM2_GGUF:-}" ] && compgen -G "$STAGE/*.gguf" >/dev/null; then
  DSPARK_SMOLLM2_GGUF=$(ls "$STAGE"/*.gguf | head -1)
  export DSPARK_SMOLLM2_GGUF
fi
# inductor's on-disk cache from an earlier session: PHASE=pack-cache brought it back in pieces; joined into one
# inductor_cache.tgz it is staged with the rest (`python ../shared/stage_offline.py --file inductor_cache.tgz`, whose
# unstage.sh reassembles and checks it) and unpacked here once a machine, into a cache an earlier call may have begun
# (entries are keyed by content either way). why: the first compiled decode of a fresh machine spent 300-400 s
# compiling; a cached graph is loaded instead (a graph the code changed since still compiles)
INDUCTOR_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/torchinductor_$(id -un)}
if [ -f "$STAGE/inductor_cache.tgz" ] && [ ! -f "$STAGE/inductor_cache.unpacked" ]; then
  mkdir -p "$INDUCTOR_DIR" && tar -xzf "$STAGE/inductor_cache.tgz" -C "$INDUCTOR_DIR"
  touch "$STAGE/inductor_cache.unpacked"
  echo "inductor cache unpacked into $INDUCTOR_DIR ($(du -sh "$INDUCTOR_DIR" | cut -f1))" >&2
fi
# CHECKPOINTS' drafter folders, looked up as each phase starts: PHASE="train concurrency" trains them in its first
# phase (looked up once at the start, that call's timing phases would have run random-initialised drafters)
checkpoint_paths() {
  paths=()
  [ -n "${CHECKPOINTS:-}" ] || return 0
  for d in dspark dflash eagle3; do [ -d "$CHECKPOINTS/$d" ] && paths+=("$d=$CHECKPOINTS/$d"); done
  if [ "${#paths[@]}" -eq 0 ]; then
    echo "CHECKPOINTS=$CHECKPOINTS holds no dspark, dflash or eagle3 folder; $1 skipped (not run random)" \
      | tee -a "$OUT/no_checkpoints.txt" >&2
    return 1
  fi
}
compile=()
if [ -n "${COMPILE:-}" ]; then compile=(--compile "$COMPILE"); fi  # auto (the default: on on CUDA), on or off
# why: PHASE=train leaves its trainings running detached when the call's limit comes first, and a timing phase that
# shares the GPU with one measures the contention (it happened once: that run is labelled contended in RESULTS)
training_alive() {
  python3 - <<'PY'
import json, sys
from pathlib import Path
from experiments.runs.smollm2_h200 import _alive  # the driver's own test (a zombie is not alive)
path = Path("/tmp/dspark-run/train_pids.json")  # PHASE=train's RUN
pids = json.loads(path.read_text()) if path.exists() else {}
alive = [name for name, entry in pids.items() if _alive(entry["pid"])]
print(" ".join(alive))
sys.exit(0 if alive else 1)
PY
}
wait_for_training() {  # up to TRAIN_GUARD_S (default 300) seconds; then the phase runs, marked contended
  local waited=0 names
  while names=$(training_alive); do
    if [ "$waited" -ge "${TRAIN_GUARD_S:-300}" ]; then
      echo "CONTENDED: training ($names) still runs on this GPU; $1's timings share it" | tee -a "$OUT/contended.txt" >&2
      return
    fi
    echo "waiting for training ($names) to finish before $1 (${waited}s)" >&2
    sleep 10; waited=$((waited + 10))
  done
}
tag="${SDPA:+-sdpa-${SDPA// /-}}${INDUCTOR:+-${INDUCTOR// /-}}${GC_FREEZE:+-gc-$GC_FREEZE}"  # the speed phase's folder
tag="$tag${DRAFTER_ADMISSION:+-admission-$DRAFTER_ADMISSION}"
tag=${tag//=/-}
for phase in $PHASE; do  # several phases in one call run in turn, e.g. PHASE="tests sps8b"
case "$phase" in speed|llama8b|validate|concurrency|sps8b|profile) wait_for_training "$phase" ;; esac
case "$phase" in train|pack-cache|gcpause|tests|sps8b|llama8b) paths=() ;; *) checkpoint_paths "$phase" || continue ;; esac
case "$phase" in
  tests)
    # bounded (TESTS_TIMEOUT_S, default 420 s) so that a slow or hung test leaves the call's later phases time; -rA
    # and the durations name every test's outcome and the slowest ones in the log
    timeout "${TESTS_TIMEOUT_S:-420}" python3 -m pytest -q -rA --durations=15 -p no:cacheprovider \
      ${TESTS:-tests/test_engine_cuda.py} 2>&1 \
      | tee "$OUT/engine_cuda_tests.log" || true ;;  # a failure is in the log; the call's later phases still run
  speed)  # into /tmp/speedrun (kept while the machine stays warm), copied to $OUT; partial results survive a cut
    python3 benchmarks/speed.py --host "${HOST:-smollm2}" --compile "${SPEED_COMPILE:-both}" ${CHECKPOINTS:+--checkpoints "$CHECKPOINTS"} \
      ${SDPA:+--sdpa $SDPA} ${INDUCTOR:+--inductor $INDUCTOR} ${GC_FREEZE:+--gc-freeze $GC_FREEZE} \
      ${DRAFTER_ADMISSION:+--drafter-admission $DRAFTER_ADMISSION} --skip-llama8b \
      --out-dir "/tmp/speedrun$tag" || true
    dest="$OUT${tag:+/speed$tag}"  # with SDPA, INDUCTOR, GC_FREEZE or DRAFTER_ADMISSION, beside the default's files
    mkdir -p "$dest" && cp "/tmp/speedrun$tag"/speed*.json "$dest"/ ;;
  llama8b)
    python3 benchmarks/speed.py --only-llama8b --compile "${SPEED_COMPILE:-both}" --out-dir /tmp/speedrun
    cp /tmp/speedrun/speed*.json "$OUT"/ ;;
  validate)  # ~7 decodes per C (traces, plain, 2 drafters x 2 policies); the JSON is rewritten after every C
    python3 -m experiments simulator_validation --host "${HOST:-smollm2}" "${compile[@]}" --drafters ngram dspark \
      ${paths:+--drafter-paths "${paths[@]}"} --policies full scheduler --draft-length 7 \
      --concurrency ${CONC:-1 8 64} --num-prompts "${NUM_PROMPTS:-32}" --max-new-tokens "${NEW:-128}" \
      --out-dir "$OUT" ;;
  concurrency)  # 1 + drafters x 4 decodes per C, max(C, NUM_PROMPTS) requests each. Split CONC over calls if slow
    # (e.g. CONC="1 4 16 64", then CONC="256 512"; each call profiles the SPS(B) table at its own C): the JSON is
    # rewritten after every C, and `python -m experiments concurrency --merge A/concurrency.json B/concurrency.json
    # --out-dir DIR` joins the calls' results
    python3 -m experiments concurrency --host "${HOST:-smollm2}" "${compile[@]}" \
      --drafters ${DRAFTERS:-ngram dspark eagle3} \
      ${paths:+--drafter-paths "${paths[@]}"} --policies ${POLICIES:-full scheduler} --draft-lengths ${GAMMAS:-3 7} \
      --concurrency ${CONC:-1 4 16 64 256 512} --num-prompts "${NUM_PROMPTS:-32}" --max-new-tokens "${NEW:-128}" \
      ${STAGE_TIMING:+--stage-timing} ${REPEATS:+--repeats "$REPEATS"} \
      --out-dir "$OUT${STAGE_TIMING:+/stage_timing}" || true ;;  # 32 prompts: with 16, a row at C <= 16 timed 0.2-3 s
  train)  # one drafter after another (two side by side ran out of memory), resumable by running the phase again
    steps=${STEPS:-400}
    if [ "${WARM_COMPILE:-1}" = 1 ]; then
      # why: the first compiled decode of a fresh machine spent about 400 s compiling (2026-12-05), a quarter of a
      # session's device time. Once DSpark's last checkpoint is saved (EAGLE-3 trains next), a short run of the
      # concurrency phase's first settings (same prompts, new tokens and cache sizes) fills inductor's on-disk cache
      # for the timed phases; nothing of it is timed, and it is stopped when the trainings end
      last=$(printf 'checkpoint-%08d' "$steps")
      ( while [ ! -d "/tmp/dspark-run/dspark/$last" ]; do sleep 5; done
        exec python3 -m experiments concurrency --host "${HOST:-smollm2}" --drafters ngram dspark \
          --drafter-paths dspark=/tmp/dspark-run/dspark --policies full scheduler --draft-lengths 3 7 \
          --concurrency 1 4 --num-prompts "${NUM_PROMPTS:-32}" --max-new-tokens "${NEW:-128}" \
          --out-dir /tmp/warm-compile ) > "$OUT/warm_compile.log" 2>&1 &
      warm=$!
    fi
    ONLY=${TRAIN_DRAFTERS:-dspark,eagle3} STEPS=$steps TRAIN_WAIT_S=${TRAIN_WAIT_S:-480} RUN=/tmp/dspark-run \
      REGEN_FROM=experiments/data/sharegpt_smollm2_regen.jsonl.gz \
      python3 experiments/runs/smollm2_h200.py prepare regenerate train
    if [ -n "${warm:-}" ]; then  # its subshell, or the python it became
      kill "$warm" 2>/dev/null || true
      wait "$warm" 2>/dev/null || true
      unset warm
    fi
    for d in /tmp/dspark-run/*/metrics.jsonl; do
      gzip -c "$d" > "$OUT/train_metrics_$(basename "$(dirname "$d")").jsonl.gz"  # committed gzipped
    done ;;
  profile)  # where a round's time goes: kernels per stage, eager vs compiled (random host, random drafters)
    python3 benchmarks/round_profile.py --host "${PROFILE_HOST:-random:smollm2}" \
      ${CHECKPOINTS:+--checkpoints "$CHECKPOINTS"} ${SDPA:+--sdpa $SDPA} ${INDUCTOR:+--inductor $INDUCTOR} \
      ${PROFILE_METHODS:+--methods $PROFILE_METHODS} ${PROFILE_COMPILE:+--compile $PROFILE_COMPILE} \
      ${PROFILE_PROMPT:+--prompt-length $PROFILE_PROMPT} --out-dir "$OUT" ;;
  pack-cache)  # inductor's cache, gzipped, in 15 MiB pieces (files from $OUT are at most 16 MiB; `cat` them into
    # inductor_cache.tgz): up to PACK_MAX_MIB (default 60, four pieces within $OUT's eight files) or nothing
    [ -d "$INDUCTOR_DIR" ] || { echo "no inductor cache at $INDUCTOR_DIR" | tee "$OUT/inductor_cache.txt"; continue; }
    ( cd "$INDUCTOR_DIR" && tar -cz . ) > /tmp/inductor_cache.tgz
    size=$(( $(stat -c %s /tmp/inductor_cache.tgz) / 1048576 ))
    echo "inductor cache: $(du -sh "$INDUCTOR_DIR" | cut -f1) on disk, ${size} MiB gzipped" \
      | tee "$OUT/inductor_cache.txt"
    if [ "$size" -le "${PACK_MAX_MIB:-60}" ]; then
      split -b 15M /tmp/inductor_cache.tgz "$OUT/inductor_cache.tgz.part-"
    fi ;;
  gcpause)  # benchmarks/gc_pause.py: each setting (freeze on / off) in its own process, GC_REPEATS (default 1) each
    python3 benchmarks/gc_pause.py --host "${PROFILE_HOST:-random:smollm2}" --repeats "${GC_REPEATS:-1}" \
      --out-dir "$OUT/gc_pause" ;;
  sps8b)
    python3 -m dspark profile --host "${HOST8B:-random:llama-8b}" --dtype bfloat16 --mode "${SPS_MODE:-graph}" \
      --batch-sizes 1 2 4 8 16 32 64 128 256 512 --tokens-per-request 1 2 4 8 --drafter dspark --draft-lengths 3 7 \
      --out "$OUT/cost_llama8b.json" ;;
  *)
    echo "unknown phase $phase (tests, profile, speed, llama8b, validate, concurrency, sps8b, train, pack-cache," \
      "gcpause)" >&2
    exit 2 ;;
esac
done
