"""What the docs claim is stated with its conditions: the EAGLE-3 baseline next to every comparison with it, and the
dtype next to every promise of token-for-token equality (issue 19)."""
from __future__ import annotations

import re
from pathlib import Path

from drafters.eagle3 import Eagle3Config, Eagle3Drafter, Eagle3Layer, eagle3_feature_layers

ROOT = Path(__file__).resolve().parents[1]
NEARBY = 20  # lines either side of a claim (a bullet or a table and its notes)
SMOLLM2_LAYERS = 30  # the recorded runs' host, SmolLM2-135M-Instruct


def prose() -> dict[str, list[str]]:
    """Lines of the README, the recorded results and docs/."""
    files = [ROOT / "README.md", ROOT / "benchmarks" / "RESULTS.md", *sorted((ROOT / "docs").glob("*.md"))]
    return {str(f.relative_to(ROOT)): f.read_text(encoding="utf-8").splitlines() for f in files}


def near(lines: list[str], i: int, span: int) -> str:
    """Lines i - span .. i + span joined, whitespace collapsed (wrapped text reads as one line)."""
    return " ".join(" ".join(lines[max(0, i - span): i + span + 1]).split())


def eagle3_baseline() -> str:
    """The description of the EAGLE-3 baseline, from the code and the recorded recipe."""
    recipe = (ROOT / "experiments" / "runs" / "smollm2_h200.py").read_text()
    gamma = int(re.search(r"^GAMMA = (\d+)$", recipe, flags=re.M).group(1))
    assert '"eagle3": [f"ttt_length={GAMMA}"]' in recipe  # the recorded recipe sets only the unroll, to gamma
    fused = {1: "one", 2: "two", 3: "three"}[len(eagle3_feature_layers(SMOLLM2_LAYERS))]
    return (f"EAGLE-3 baseline: one layer on {fused} fused host layers, the full host vocabulary through the frozen "
            f"LM head, chain drafting (no tree), training-time test of {gamma}")


def test_eagle3_baseline_description_matches_the_code(tiny_host):
    drafter = Eagle3Drafter(tiny_host)
    assert sum(isinstance(m, Eagle3Layer) for m in drafter.modules()) == 1  # one layer
    assert drafter.fc.in_features == 3 * tiny_host.hidden_size  # three fused host layers
    assert drafter.shared.lm_head is tiny_host.lm_head  # the host's own head, full vocabulary
    assert not any(p.requires_grad for p in tiny_host.lm_head.parameters())  # frozen
    assert Eagle3Config().ttt_length == 7 and "training-time test of 7" in eagle3_baseline()


def test_every_claim_over_eagle3_states_the_baseline():
    # a comparison (a ratio, "over", "vs"), not a list of drafters such as "plain / DSpark / EAGLE-3"
    claim = re.compile(r"(over|vs\.?|×|(?<!plain / )DSpark /) EAGLE-3")
    baseline, claims = eagle3_baseline(), 0
    for path, lines in prose().items():
        for i, line in enumerate(lines):
            if claim.search(line):
                claims += 1
                assert baseline in near(lines, i, NEARBY), f"{path}:{i + 1} compares with EAGLE-3 without saying " \
                                                            f"what it is ({baseline!r} within {NEARBY} lines)"
    assert claims >= 10  # README and RESULTS compare with EAGLE-3 throughout


def test_token_for_token_promises_name_the_dtype_they_hold_in():
    promise = re.compile(r"token[- ]for[- ]token|token for token", re.I)
    sources = dict(prose())
    for f in sorted((ROOT / "dspark").rglob("*.py")):
        sources[str(f.relative_to(ROOT))] = f.read_text(encoding="utf-8").splitlines()
    promises = 0
    for path, lines in sources.items():
        for i, line in enumerate(lines):
            if promise.search(line):
                promises += 1
                window = near(lines, i, 3)
                assert "fp32" in window and "bf16" in window, f"{path}:{i + 1} promises token-for-token equality " \
                                                              f"without saying it holds in fp32 and not in bf16"
    assert promises >= 3  # README, docs/RELIABILITY.md and dspark/hf.py
    assert "def test_greedy_equals_plain_generate" in (ROOT / "tests" / "test_hf.py").read_text()
