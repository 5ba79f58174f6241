"""Calibration and burstiness of a validation folder's logged rounds (CPU): DSpark's expected accepted drafts by
its confidences (sum_k prod_{i<=k} c_i over what each round verified) against the accepted ones, overall and in
bins of the expectation, and for both drafters the lag-one correlation of accepted counts within a request and
P(next round accepts one or more | this one accepted two or more). The numbers behind the draft gate's pricing by
confidences (benchmarks/RESULTS.md, fourteenth session).

    python benchmarks/h100/simulator_validation_20261207b/trace_stats.py benchmarks/h100/simulator_validation_20261207b/compiled
"""
import json
import sys
from pathlib import Path

import numpy as np

folder = Path(sys.argv[1])
trace = json.loads((folder / "trace_dspark.json").read_text())
expected, accepted = [], []
for r in trace["requests"]:
    for c, a, v in zip(r["confidence"], r["accepted"], r["verified"]):
        expected.append(np.cumprod(np.clip(c, 0, 1))[:v].sum())
        accepted.append(a)
expected, accepted = np.array(expected), np.array(accepted)
print(f"dspark: {len(expected)} rounds, expected {expected.mean():.3f}, accepted {accepted.mean():.3f} a round")
for lo, hi in [(0, 0.2), (0.2, 0.4), (0.4, 0.8), (0.8, 2), (2, 8)]:
    m = (expected >= lo) & (expected < hi)
    if m.any():
        print(f"  expected in [{lo}, {hi}): {m.sum()} rounds, expected {expected[m].mean():.2f}, "
              f"accepted {accepted[m].mean():.2f}")
for method in ("ngram", "dspark"):
    now, nxt = [], []
    for r in json.loads((folder / f"trace_{method}.json").read_text())["requests"]:
        now += r["accepted"][:-1]
        nxt += r["accepted"][1:]
    now, nxt = np.array(now), np.array(nxt)
    print(f"{method}: lag-one correlation {np.corrcoef(now, nxt)[0, 1]:.2f}, P(next >= 1 | this >= 2) "
          f"{(nxt[now >= 2] >= 1).mean():.2f}, P(next >= 1) {(nxt >= 1).mean():.2f}")
