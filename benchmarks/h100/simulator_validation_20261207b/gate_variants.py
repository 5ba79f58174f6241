"""Draft-gate variants replayed on a recorded simulator validation folder (CPU, no host): each scheduler row's
predicted tokens/s over the predicted plain row's, for the gate as it is and for variants patched in over
DraftGate.after_round. Exploration after the fourteenth session's run (benchmarks/RESULTS.md); nothing adopted.

    python benchmarks/h100/simulator_validation_20261207b/gate_variants.py benchmarks/h100/simulator_validation_20261207b/compiled
"""
import json
import math
import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root
from experiments.simulator import load_trace, simulate
from experiments.validate import _constants, _pricing
from verifiers import build_verifier, policy_options
from verifiers.cost_model import CostModel
from verifiers import prefix_scheduler as ps

src = Path(sys.argv[1])
doc = json.loads((src / 'simulator_validation.json').read_text())
K = doc['draft_length']
cost = CostModel.load(src / 'cost.json')
traces = {m: load_trace(src / f'trace_{m}.json') for m in ('ngram', 'dspark')}
consts = {int(C): _constants(c['plain_run'], cost, int(C)) for C, c in doc['constants'].items()}
rows = {(r['method'], r['policy'], r['concurrency']): r for r in doc['rows']}

orig_after = ps.DraftGate.after_round

def after_keep(self, *, slots, rows, width, drafted, committed):
    """probes update the EMA instead of restarting it"""
    if not drafted:
        self.skip_left = max(0, self.skip_left - 1); return
    self.awaiting = False
    if rows == 0: return
    draft_s = self.fixed_draft_s
    if width == 0 and not draft_s: return
    plain, spent = self._seconds(slots, 1), self._seconds(slots, width + 1) + (draft_s or 0.0)
    gain = (committed / rows) * plain / spent
    self.gain = gain if self.gain is None else self.smoothing * gain + (1 - self.smoothing) * self.gain
    self.probing = False
    if self.gain > 1.0:
        self.wait = 1
    else:
        amortised = math.ceil(max(spent - plain, 0.0) / (self.probe_budget * plain))
        self.skip_left, self.probing = max(self.wait, amortised), True
        self.wait = min(2 * self.wait, self.max_wait)

def after_mean(self, *, slots, rows, width, drafted, committed):
    """a streak's gain is its running mean until 1/smoothing rounds, then the EMA (bias-corrected EMA)"""
    if not drafted:
        self.skip_left = max(0, self.skip_left - 1); return
    self.awaiting = False
    if rows == 0: return
    draft_s = self.fixed_draft_s
    if width == 0 and not draft_s: return
    plain, spent = self._seconds(slots, 1), self._seconds(slots, width + 1) + (draft_s or 0.0)
    gain = (committed / rows) * plain / spent
    fresh = self.gain is None or self.probing
    self.n = 1 if fresh else self.n + 1
    w = max(self.smoothing, 1.0 / self.n)
    self.gain = gain if fresh else w * gain + (1 - w) * self.gain
    self.probing = False
    if self.gain > 1.0:
        self.wait = 1
    else:
        amortised = math.ceil(max(spent - plain, 0.0) / (self.probe_budget * plain))
        self.skip_left, self.probing = max(self.wait, amortised), True
        self.wait = min(2 * self.wait, self.max_wait)

def make_margin(m):
    def after_margin(self, *, slots, rows, width, drafted, committed):
        if not drafted:
            self.skip_left = max(0, self.skip_left - 1); return
        self.awaiting = False
        if rows == 0: return
        draft_s = self.fixed_draft_s
        if width == 0 and not draft_s: return
        plain, spent = self._seconds(slots, 1), self._seconds(slots, width + 1) + (draft_s or 0.0)
        gain = (committed / rows) * plain / spent
        fresh = self.gain is None or self.probing
        self.gain = gain if fresh else self.smoothing * gain + (1 - self.smoothing) * self.gain
        was_probe = self.probing and self.gain is not None
        self.probing = False
        if self.gain > (m if was_probe else 1.0):
            self.wait = 1
        else:
            amortised = math.ceil(max(spent - plain, 0.0) / (self.probe_budget * plain))
            self.skip_left, self.probing = max(self.wait, amortised), True
            self.wait = min(2 * self.wait, self.max_wait)
    return after_margin

variants = {'current': (orig_after, 0.1), 'current s0.3': (orig_after, 0.3), 'current s0.05': (orig_after, 0.05),
            'keep s0.1': (after_keep, 0.1), 'keep s0.3': (after_keep, 0.3), 'keep s0.5': (after_keep, 0.5),
            'mean s0.1': (after_mean, 0.1), 'mean s0.05': (after_mean, 0.05),
            'm1.5': (make_margin(1.5), 0.1), 'm2': (make_margin(2.0), 0.1)}
for C in sorted(consts):
    plainp = simulate(traces['dspark'], policy=None, concurrency=C, cost=cost, requests=rows[('plain','none',C)]['requests'], pricing=_pricing(consts[C], cost))['tokens_per_s']
    for m in ('ngram', 'dspark'):
        t = rows[(m, 'scheduler', C)]
        full = rows[(m, 'full', C)]
        fp = simulate(traces[m], policy=build_verifier('full', positions=K), concurrency=C, cost=cost, requests=t['requests'],
                      pricing=_pricing(consts[C], cost, key=full['draft_key'], deferred=False, overlapped=full['overlapped']))['tokens_per_s']
        out = []
        for name, (fn, s) in variants.items():
            ps.DraftGate.after_round = fn
            pol = build_verifier('scheduler', positions=K, **policy_options('scheduler', cost_table=cost))
            pol.gate.smoothing = s
            p = simulate(traces[m], policy=pol, concurrency=C, cost=cost, requests=t['requests'],
                         pricing=_pricing(consts[C], cost, key=t['draft_key'], deferred=t['deferred_observe'], overlapped=t['overlapped']))
            out.append(f"{name}: {p['tokens_per_s']/plainp:.3f} (tau {p['tau']:.2f})")
        ps.DraftGate.after_round = orig_after
        print(f"C={C:3d} {m:6s} measured sched {t['measured_tokens_per_s']/rows[('plain','none',C)]['measured_tokens_per_s']:.3f} full(pred) {fp/plainp:.3f} | " + ' | '.join(out))
