#!/usr/bin/env bash
# DSpark vs DFlash vs EAGLE-3 for SmolLM2-135M-Instruct on one GPU: same self-distilled data, same budget, gamma = 7.
#
#   bash experiments/runs/train_smollm2_gpu.sh                 # everything: regenerate, then the three drafters
#   STEPS=3000 OUT=/data/runs bash experiments/runs/train_smollm2_gpu.sh
#   STAGES="train" bash experiments/runs/train_smollm2_gpu.sh  # data already regenerated
#
# On a machine without network (the H200): stage the GGUF and ShareGPT with shared/stage_offline.py first and
# export PYTHONPATH / HF_HUB_OFFLINE as it says; the first load converts the GGUF to fp32 safetensors (~25 s).
# Every run resumes by itself (resume=auto) when restarted with the same OUT, regeneration included.
# Multi-GPU: replace `python -m dspark.training.train` by `accelerate launch -m dspark.cli train` (or set TRAIN) — the
# batch below is per GPU, so scale STEPS down by the GPU count for the same budget.
#
# Cost, measured on one H200 with a SmolLM2-shaped random host (torch 2.11, transformers 5.17), batch 8 x 2048:
#   dspark (3 layers, gamma 7) ~85k tokens/s, 44.5 GiB peak; dflash ~99k tokens/s, 44 GiB;
#   eagle3 (ttt 7) ~40k tokens/s, 93 GiB; so 6000 steps (98M tokens) take roughly 20 / 17 / 41 minutes.
#   At 5 layers DSpark ran 13 % fewer tokens/s than at 3 in the shared H200 runs (22.9k vs 26.4k, RESULTS.md).
#   Alone on the H200 at batch 4 x 2048, 5 layers (solo_throughput.sh, 2026-12-04): DSpark 62.8k tokens/s at 512
#   anchors, 38.3k at 1024 (46 GiB); DFlash 72.2k / 42.1k; EAGLE-3 34.2k (27 GiB). With the sparse (flex-attention)
#   training mask, since the default on CUDA in bf16: DSpark 47.0k, DFlash 49.5k at 1024 anchors.
set -euo pipefail

OUT=${OUT:-runs/smollm2}
DATA=${DATA:-$OUT/sharegpt_smollm2_regen.jsonl}
STEPS=${STEPS:-6000}          # optimizer steps, identical for the three drafters (~8 epochs of the regenerated data)
STAGES=${STAGES:-"regenerate train"}
LAYERS=${LAYERS:-5}            # DSpark / DFlash backbone depth (benchmarks/RESULTS.md: 5 vs 3)
ANCHORS=${ANCHORS:-1024}       # DSpark / DFlash blocks per 2048-token row (RESULTS.md: 1024 vs DeepSpec's 512)
REPORT_TO=${REPORT_TO:-none}  # wandb (offline unless WANDB_MODE is set) or tensorboard where installed
TRAIN=${TRAIN:-python -m dspark.training.train}         # = `dspark train`
REGENERATE=${REGENERATE:-python -m dspark.training.regenerate}  # = `dspark regenerate`
mkdir -p "$OUT"

# 1. Self-distillation (DSPARK.md §3): SmolLM2 answers the first user turn (+ system) of every ShareGPT training
#    conversation at T = 1, so the drafters learn the host's own distribution. Appends per batch; a restart
#    skips finished ids. The held-out split is left for evaluation.
if [[ " $STAGES " == *" regenerate "* ]]; then
  $REGENERATE --host smollm2 --data sharegpt --split train --output "$DATA" \
    --max-prompt-length 1024 --max-new-tokens 1024 --temperature 1.0 --top-p 1.0 --top-k 0 --seed 0 \
    --batch-size 256
fi

# 2. One shared config: the same data, packing, batch, schedule and budget for every drafter (reference optimiser:
#    AdamW 6e-4, no weight decay, 4 % warmup then cosine, clip 1.0, bf16 autocast with fp32 master weights).
cat > "$OUT/common.yaml" <<EOF
host: smollm2
data: $DATA
heldout_fraction: 0.02
max_length: 2048
seq_len: 2048
batch_size: 8
grad_accum: 1
lr: 6.0e-4
weight_decay: 0.0
warmup_ratio: 0.04
max_grad_norm: 1.0
max_steps: $STEPS
seed: 0
save_every: 500
keep_checkpoints: 2
eval_every: 500
eval_batches: 16
bf16: true
report_to: $REPORT_TO
project: dspark-smollm2
EOF

if [[ " $STAGES " == *" train "* ]]; then
  # DSpark: LAYERS backbone layers (default 5, DeepSpec's; 3 is the DeepSeek-V4 production depth), Markov head
  # r = 256, confidence head, gamma 7, ANCHORS blocks per row.
  $TRAIN --config "$OUT/common.yaml" --drafter dspark --output "$OUT/dspark" \
    --drafter-args num_layers=$LAYERS gamma=7 head=markov rank=256 confidence=true max_anchors=$ANCHORS
  # DFlash: the same backbone with the heads off (L = L_ce), gamma 7, the same anchors.
  $TRAIN --config "$OUT/common.yaml" --drafter dflash --output "$OUT/dflash" \
    --drafter-args num_layers=$LAYERS gamma=7 max_anchors=$ANCHORS
  # EAGLE-3: one layer, training-time test unrolled 7 steps (= gamma).
  $TRAIN --config "$OUT/common.yaml" --drafter eagle3 --output "$OUT/eagle3" \
    --drafter-args ttt_length=7
fi

# Teacher-forced comparison (expected tau, per-position acceptance) is in each run's metrics.jsonl ("kind": "eval")
# and training_curve.png; the final drafters are $OUT/<drafter>/checkpoint-<STEPS>, loadable by drafters.load_drafter.
ls -d "$OUT"/*/checkpoint-* 2>/dev/null || true
