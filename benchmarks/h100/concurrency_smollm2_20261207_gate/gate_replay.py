"""Replays of this folder's two runs (compile off, and compiled/) with the draft gate and scheduler pricing a forward
by the SPS(M) table (as the run did) and by its shape (CostModel.step_seconds, the fix made after seeing the run),
to estimate what the fix changes before a GPU measures it (issue 22, 2026-12-07, eleventh session).

DSpark's trace is synthetic: i.i.d. rounds drawn from the run's measured verify-all conditional acceptance at C = 1,
three seeds, each round's confidences set to those per-position rates (a drafter calibrated on average; the real
confidences vary per round, so the replayed widths are not the run's). The round's verify is priced at its shape
t(C, L + 1) from the run's cost table plus a per-C constant fitted on the plain row (measured plain step minus
t(C, 1)), the drafter's propose and observe from the table's draft entry. A replay, not a measurement. Run from the
project root:
    python benchmarks/h100/concurrency_smollm2_20261207_gate/gate_replay.py > .../gate_replay.txt
"""
import json
import math
import random
import statistics
from functools import partial
from pathlib import Path

import torch

import verifiers.prefix_scheduler as ps
from experiments.simulator import Pricing, simulate
from verifiers import build_verifier
from verifiers.cost_model import CostModel

HERE = Path(__file__).resolve().parent
K, NEW, SEEDS, CS = 7, 128, (0, 1, 2), (1, 4, 16)
BY_SHAPE = ps.forward_seconds


def by_tokens(sps, R, width):  # the pricing the run used: 1 / SPS(R * width), the slowest shape of that M
    return 1.0 / ps._sps_at(sps, R * width)


def synthetic(cond: list[float], seed: int, n_req: int = 32) -> dict:
    rng = random.Random(seed)
    conf = [0.0 if math.isnan(c) else c for c in cond]
    reqs = []
    for _ in range(n_req):
        acc, got = [], 0
        while got < NEW:
            a = 0
            while a < K and rng.random() < conf[a]:
                a += 1
            acc.append(a)
            got += a + 1
        reqs.append({"new_tokens": NEW, "proposed": [K] * len(acc), "verified": [K] * len(acc), "accepted": acc,
                     "confidence": [conf] * len(acc)})
    return {"format": "dspark.trace", "version": 1, "draft_length": K, "method": "dspark", "requests": reqs}


def replay(folder: Path) -> None:
    cost = CostModel.load(folder / "cost.json")
    doc = json.loads((folder / "concurrency.json").read_text())
    rows = {(r["method"], r["policy"], r["concurrency"]): r for r in doc["rows"]}
    key = next(iter(cost.draft))
    traces = [synthetic(rows["dspark", "full", 1]["conditional_acceptance"], s) for s in SEEDS]
    ds = lambda R, step="propose": cost.draft_seconds(key, R, step=step) or 0.0  # noqa: E731
    print(f"== {folder.relative_to(HERE.parents[2])}")
    for C in CS:
        plain_row = rows["plain", "none", C]
        e = plain_row["engine_stats"]
        t1 = float(cost.step_seconds(C, torch.tensor([1]))[0])
        overhead_ms = 1000 * (plain_row["seconds"] - e["admit_s"] - e["rounds"] * t1) / e["rounds"]
        machine = dict(mode="slots", admission_ms=1000 * e["admit_s"] / e["admissions"], step_overhead_ms=overhead_ms,
                       overlap=True)
        shaped = lambda M, C=C: 1.0 / cost.step_seconds(C, torch.as_tensor(M) // C)  # noqa: E731  (slots: M = C w)
        measured = {p: rows["dspark", p, C]["tokens_per_s"] / plain_row["tokens_per_s"] for p in ("full", "scheduler")}
        out = {}
        for name, pricing in (("M", by_tokens), ("shape", BY_SHAPE)):
            ps.forward_seconds = pricing
            ratios = {"full": [], "scheduler": []}
            for trace in traces:
                n = max(C, 32)
                plain = simulate(trace, policy=None, concurrency=C, cost=shaped, requests=n,
                                 pricing=Pricing(**machine))["tokens_per_s"]
                for pol in ratios:
                    v = build_verifier(pol, cost_table=cost if pol == "scheduler" else None)
                    if pol == "scheduler":
                        v.gate.key = key
                    got = simulate(trace, policy=v, concurrency=C, cost=shaped, requests=n,
                                   pricing=Pricing(draft_seconds=ds, observe_seconds=partial(ds, step="observe"),
                                                   deferred_observe=pol == "scheduler", **machine))
                    ratios[pol].append(got["tokens_per_s"] / plain)
            out[name] = {p: statistics.mean(v) for p, v in ratios.items()}
        ps.forward_seconds = BY_SHAPE
        print(f"C = {C:2d}: measured full {measured['full']:.3f} sched {measured['scheduler']:.3f} | replay, gate by M:"
              f" full {out['M']['full']:.3f} sched {out['M']['scheduler']:.3f} | by shape: sched "
              f"{out['shape']['scheduler']:.3f}")


if __name__ == "__main__":
    replay(HERE)
    replay(HERE / "compiled")
