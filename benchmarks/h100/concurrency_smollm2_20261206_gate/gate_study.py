"""The draft gate's variants replayed with this folder's H100 cost table and plain-run constants (a study of where
scheduled DSpark's remaining loss at C = 4 and 16 goes; issue 22, 2026-12-06, fifth session).

Traces: DSpark's synthetic (i.i.d. rounds drawn from the measured verify-all row's conditional acceptance at C = 1,
three seeds: the real drafter's acceptance is burstier) and the CPU n-gram traces of
benchmarks/cpu/acceptance_ngram_smollm2 (SmolLM2 fp32 on the CPU: not this run's n-gram). Replayed with
experiments.simulator in the slot engine's pricing (overlap, deferred observe, the plain rows' admission and step
constants at the nearest measured C; the table is profiled up to 16 rows, so C stops at 16). Variants of the gate:
`cap<x>` caps the moving average a paying probe restarts from; `margin<x>` judges a probe that pays less than x a
failure; then the probe budget (0.01 is the default). Run from the project root:
    python benchmarks/h100/concurrency_smollm2_20261206_gate/gate_study.py > .../gate_study.txt
gate_study.txt was written before the schedulers priced a forward by its shape (CostModel.step_seconds, 2026-12-07):
run now, the gate prices plain rows at this table's (R, 1) points and its numbers move.
"""
import json, math, random, sys
from functools import partial
import torch
from experiments.simulator import Pricing, simulate, load_trace
from verifiers import build_verifier
from verifiers.cost_model import CostModel
import verifiers.prefix_scheduler as ps

from pathlib import Path
RUN = Path(__file__).resolve().parent
ROOT = RUN.parents[2]
cost = CostModel.load(f"{RUN}/cost.json")
doc = json.load(open(f"{RUN}/concurrency.json"))
rows = {(r["method"], r["policy"], r["concurrency"]): r for r in doc["rows"]}
key = next(iter(cost.draft))

def synthetic(cond, n_req=32, new=128, burst=0.0, seed=0):
    rng = random.Random(seed)
    reqs = []
    for _ in range(n_req):
        scale = 1.0 if burst == 0 else min(1.0, rng.betavariate(2 * (1 - burst) / burst, 2) / 0.5 * 0.5 + 0.0)
        acc = []
        got = 0
        while got < new:
            a = 0
            while a < 7 and rng.random() < min(1.0, cond[a] * (scale if burst else 1.0)):
                a += 1
            acc.append(a); got += a + 1
        reqs.append({"new_tokens": new, "proposed": [7] * len(acc), "verified": [7] * len(acc), "accepted": acc,
                     "confidence": None})
    return {"format": "dspark.trace", "version": 1, "draft_length": 7, "method": "dspark", "requests": reqs}

ORIGINAL = ps.DraftGate.after_round  # every variant wraps the shipped rule (not the last variant's wrapper)


def variant(name):
    orig = ORIGINAL
    def after_round(self, *, slots, rows, width, drafted, committed, expected=None):
        if name == "current" or not drafted or rows == 0:
            return orig(self, slots=slots, rows=rows, width=width, drafted=drafted, committed=committed)
        probing = self.probing
        orig(self, slots=slots, rows=rows, width=width, drafted=drafted, committed=committed)
        if probing and self.gain is not None and self.gain > 1.0:
            if name.startswith("cap"):
                self.gain = min(self.gain, float(name[3:]))
            elif name.startswith("margin"):
                if self.gain < float(name[6:]):  # judged a failure after all
                    self.gain = 1.0
                    plain = self._seconds(slots, 1); spent = self._seconds(slots, width + 1) + (self.fixed_draft_s or 0)
                    amortised = math.ceil(max(spent - plain, 0.0) / (self.probe_budget * plain))
                    self.skip_left, self.probing = max(self.wait, amortised), True
                    self.wait = min(2 * self.wait, self.max_wait)
    return after_round

def run(trace, C, gate_variant, draft=True):
    ps.DraftGate.after_round = variant(gate_variant)
    plain_row = rows[("plain", "none", min((1, 4, 16), key=lambda m: abs(m - C)))]
    e = plain_row["engine_stats"]
    adm = 1000 * e["admit_s"] / max(1, e["admissions"])
    Cm = plain_row["concurrency"]; raw = 1000 * (plain_row["seconds"] - e["admit_s"] - e["rounds"] / float(cost(Cm))) / max(1, e["rounds"])
    ds = (lambda R, step="propose": cost.draft_seconds(key, R, step=step) or 0.0) if draft else (lambda R, step="propose": 0.0)
    machine = dict(mode="slots", admission_ms=adm, step_overhead_ms=raw, overlap=True)
    n = max(C, 32)
    p = simulate(trace, policy=None, concurrency=C, cost=cost, requests=n, pricing=Pricing(**machine))
    out = {}
    for pol in ("full", "scheduler"):
        v = build_verifier(pol, cost_table=cost if pol == "scheduler" else None)
        if pol == "scheduler": v.gate.key = key
        s = simulate(trace, policy=v, concurrency=C, cost=cost, requests=n,
                     pricing=Pricing(draft_seconds=ds, observe_seconds=partial(ds, step="observe"),
                                     deferred_observe=pol == "scheduler", **machine))
        out[pol] = s["tokens_per_s"] / p["tokens_per_s"]
    return out

cond = rows[("dspark", "full", 1)]["conditional_acceptance"]
print("measured cond", [round(c, 3) for c in cond])
traces = {"dspark-iid": synthetic(cond)}
for dom in ("chat", "code", "math"):
    traces[f"ngram-{dom}"] = load_trace(ROOT / f"benchmarks/cpu/acceptance_ngram_smollm2/trace_ngram_{dom}.json")
for var in ["current", "cap1.05", "cap1.2", "margin1.25", "margin1.5"]:
    line = []
    for tn, tr in traces.items():
        for C in (1, 4, 16):
            r = run(tr, C, var, draft=tn.startswith("dspark"))
            line.append(f"{tn}@{C}: full {r['full']:.3f} sched {r['scheduler']:.3f}")
    print(var); print("   " + "\n   ".join(line))


print("---- budgets, broader")
import statistics
for seed in (1, 2):
    traces[f"dspark-iid-s{seed}"] = synthetic(cond, seed=seed)
orig_init = ps.DraftGate.__init__
Cs = (1, 2, 4, 8, 16)
for budget in (0.01, 0.0075, 0.005):
    def init(self, cost, *, smoothing=0.1, max_wait=64, probe_budget=budget):
        orig_init(self, cost, smoothing=smoothing, max_wait=max_wait, probe_budget=probe_budget)
    ps.DraftGate.__init__ = init
    res = {}
    for tn, tr in traces.items():
        res[tn] = [run(tr, C, "current", draft=tn.startswith("dspark"))["scheduler"] for C in Cs]
    print(budget)
    for tn, v in res.items():
        print(f"   {tn:14s}", " ".join(f"{x:.3f}" for x in v))
ps.DraftGate.__init__ = orig_init
