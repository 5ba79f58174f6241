"""CPU A/B of TrainConfig.init_layers_from_host: the quickstart's `small` DSpark recipe (SmolLM2-135M-Instruct host,
fp32, 2 backbone layers, 180 steps, 400 ShareGPT conversations), with random backbone layers or the host's last two.

    HF_HUB_OFFLINE=1 python benchmarks/cpu/init_layers_from_host/run.py random   # then: ... run.py host
Writes /tmp/initexp/<arm>/ (checkpoints, metrics.jsonl; the two metrics files are copied next to this script).
"""
import sys

from dspark.quickstart import SIZES, training_config
from dspark.training.train import train

arm = sys.argv[1]
if arm not in ("random", "host"):
    raise SystemExit("usage: run.py random|host")
cfg = training_config(SIZES["small"], output=f"/tmp/initexp/{arm}", eval_every=45, eval_batches=6,
                      init_layers_from_host=arm == "host", report_to="none")
print(train(cfg))
