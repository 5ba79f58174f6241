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

def after_realized(self, *, expected=None, **round_):
    """the gate before the confidences' expectation (2026-12-07, fourteenth session): realised counts only"""
    return orig_after(self, **round_)


def variant(update, margin: float = 1.0):
    """A gate priced by realised counts (as before the confidences' expectation) whose smoothed gain is
    update(gate, gain, fresh) and which resumes after a probe only above `margin`."""
    def after(self, *, slots, rows, width, drafted, committed, expected=None):
        if not drafted:
            self.skip_left = max(0, self.skip_left - 1)
            return
        self.awaiting = False
        draft_s = self.fixed_draft_s
        if rows == 0 or (width == 0 and not draft_s):
            return
        plain, spent = self._seconds(slots, 1), self._seconds(slots, width + 1) + (draft_s or 0.0)
        fresh, was_probe = self.gain is None or self.probing, self.probing and self.gain is not None
        self.gain = update(self, (committed / rows) * plain / spent, fresh)
        self.probing = False
        if self.gain > (margin if was_probe else 1.0):
            self.wait = 1
        else:
            amortised = math.ceil(max(spent - plain, 0.0) / (self.probe_budget * plain))
            self.skip_left, self.probing = max(self.wait, amortised), True
            self.wait = min(2 * self.wait, self.max_wait)
    return after


def ema(self, gain, fresh):
    """the gate's average: restarted by a probe"""
    return gain if fresh else self.smoothing * gain + (1 - self.smoothing) * self.gain


def keep(self, gain, fresh):
    """probes update the average instead of restarting it"""
    return gain if self.gain is None else self.smoothing * gain + (1 - self.smoothing) * self.gain


def mean(self, gain, fresh):
    """a streak's running mean until 1 / smoothing rounds, then the average (bias-corrected)"""
    self.n = 1 if fresh else self.n + 1
    w = max(self.smoothing, 1.0 / self.n)
    return gain if fresh else w * gain + (1 - w) * self.gain


after_keep, after_mean = variant(keep), variant(mean)


def make_margin(m):
    return variant(ema, margin=m)


variants = {'realized': (after_realized, 0.1), 'current': (orig_after, 0.1), 'current s0.3': (orig_after, 0.3), 'current s0.05': (orig_after, 0.05),
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
