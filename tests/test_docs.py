"""What the results page says of the EAGLE-3 baseline is what the code and the recorded recipe build."""
from __future__ import annotations

from pathlib import Path

import yaml

from drafters.eagle3 import Eagle3Config, Eagle3Drafter, Eagle3Layer, eagle3_feature_layers

ROOT = Path(__file__).resolve().parents[1]
SMOLLM2_LAYERS = 30  # the recorded runs' host, SmolLM2-135M-Instruct


def test_the_eagle3_baseline_the_results_page_describes_is_what_is_built(tiny_host):
    recipe = yaml.safe_load((ROOT / "experiments" / "recipes" / "smollm2-eagle3.yaml").read_text())["train"]
    assert recipe["drafter_args"] == {"ttt_length": 7}  # the recorded recipe sets only the unroll
    fused = {1: "one", 2: "two", 3: "three"}[len(eagle3_feature_layers(SMOLLM2_LAYERS))]
    described = (f"EAGLE-3 baseline: one layer on {fused} fused host layers, the full host vocabulary through the "
                 f"frozen LM head, chain drafting (no tree), training-time test of {recipe['drafter_args']['ttt_length']}")
    page = " ".join((ROOT / "benchmarks" / "README.md").read_text().split())
    assert described in page

    drafter = Eagle3Drafter(tiny_host)
    assert sum(isinstance(m, Eagle3Layer) for m in drafter.modules()) == 1  # one layer
    assert drafter.fc.in_features == 3 * tiny_host.hidden_size  # three fused host layers
    assert drafter.shared.lm_head is tiny_host.lm_head  # the host's own head, full vocabulary
    assert not any(p.requires_grad for p in tiny_host.lm_head.parameters())  # frozen
    assert Eagle3Config().ttt_length == 7
