#!/usr/bin/env bash
# Solo training throughput of the three drafters as the H200 runs train them (5-layer DSpark / DFlash, EAGLE-3 with
# TTT 7, gamma 7, batch BS x SEQ packed tokens, bf16), one after another so each has the GPU to itself. The host is
# a randomly initialised SmolLM2-135M-shaped model on synthetic tokens: the kernels and so the speed are the real
# host's, no weights or data need staging; the acceptance numbers in the logs mean nothing.
#
#   OUT=/tmp/out SEQ=2048 BS=4 STEPS_SOLO=60 bash experiments/runs/solo_throughput.sh
#   ANCHORS="512 1024" ...   # DSpark / DFlash at each anchors-per-row cap (default 512, the recorded runs')
#   DRAFTERS="dspark" ...      # a subset (default: dspark dflash eagle3)
#   DSPARK_SPARSE_ATTENTION=0  # DSpark / DFlash with the dense training mask instead of flex attention (CUDA);
#                              # the same as `dspark train --sparse-attention false`
#
# Prints, per run: steps, median tokens/s and median s/step after the first 5 steps, peak GiB; copies each
# run's metrics.jsonl to $OUT/solo_<run>.jsonl (run = drafter, plus _a<anchors> when ANCHORS has several).
set -euo pipefail
OUT=${OUT:?set OUT}; SEQ=${SEQ:-2048}; BS=${BS:-4}; STEPS_SOLO=${STEPS_SOLO:-60}; WORK=${WORK:-/tmp/solo}
ANCHORS=${ANCHORS:-512}
mkdir -p "$WORK" "$OUT"
DRAFTERS=${DRAFTERS:-"dspark dflash eagle3"}
specs=()
for a in $ANCHORS; do
  tag=$([ "$ANCHORS" = "$a" ] && echo "" || echo "_a$a")
  specs+=("dspark$tag dspark num_layers=5 gamma=7 head=markov rank=256 confidence=true max_anchors=$a"
          "dflash$tag dflash num_layers=5 gamma=7 max_anchors=$a")
done
specs+=("eagle3 eagle3 ttt_length=7")
for spec in "${specs[@]}"; do
  set -- $spec; name=$1; drafter=$2; shift 2
  [[ " $DRAFTERS " == *" $drafter "* ]] || continue
  python3 -m dspark.training.train --host random:smollm2 --data synthetic:512 --drafter "$drafter" \
    --output "$WORK/$name" --max-length "$SEQ" --seq-len "$SEQ" --batch-size "$BS" --max-steps "$STEPS_SOLO" \
    --save-every 100000 --eval-every 0 --bf16 true --report-to none --seed 0 --drafter-args "$@" > "$WORK/$name.log" 2>&1 \
    || { tail -20 "$WORK/$name.log"; exit 1; }
  cp "$WORK/$name/metrics.jsonl" "$OUT/solo_$name.jsonl"
  python3 - "$OUT/solo_$name.jsonl" "$name" <<'PY'
import json, statistics, sys
train = [r for r in map(json.loads, open(sys.argv[1])) if r.get("kind") == "train"][5:]
print(sys.argv[2], "steps", len(train) + 5, "tokens/s", round(statistics.median(r["tokens_per_s"] for r in train)),
      "s/step", round(statistics.median(r["step_s"] for r in train), 3),
      "peak GiB", round(max(r["peak_mem_gb"] for r in train), 1))
PY
done
