"""Which fixed draft length γ pays best for a drafter on this host and device, from what was measured of both.

Shapes: R requests decoding together, K a draft length (drafts proposed per round), a_k the drafter's conditional
acceptance at draft position k (the chance that draft k is accepted given drafts 1..k-1 were; `dspark eval`'s
`conditional_acceptance`, measured verifying every draft at some γ_max >= K).

A round that proposes K drafts and verifies them all commits E[τ(K)] = 1 + Σ_{k<=K} Π_{i<=k} a_i tokens a request and
lasts draft(R, K) + observe(R) + t(R, K + 1): the drafter's own propose and observe steps (`CostModel.draft`, from
`dspark profile --drafter...`) and the host's verify forward of K + 1 tokens a row (`CostModel.step_seconds`). A plain
round commits one token in t(R, 1). The chosen γ maximises tokens per second, E[τ(K)] / round seconds; γ = 0 means
that no measured K beats plain decoding. The prediction leaves out what every round pays alike (sampling, acceptance,
bookkeeping), so it ranks draft lengths rather than promising a speed-up; `dspark bench` measures one.

Non-anticipating: the choice reads only the profiled costs and acceptance measured on other decodes, never the tokens
of the decode it is used for, so a decode at the chosen γ stays lossless like any fixed-γ decode.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from verifiers.cost_model import CostModel


def expected_tau(conditional_acceptance: Sequence[float | None], K: int) -> float:
    """E[τ] of a verify-all round of K drafts: 1 + Σ_{k<=K} Π_{i<=k} a_i. A position never reached when the
    acceptance was measured (None or NaN) contributes nothing from there on."""
    if K > len(conditional_acceptance):
        raise ValueError(f"acceptance was measured at {len(conditional_acceptance)} draft positions, not {K}")
    tau, survive = 1.0, 1.0
    for a in conditional_acceptance[:K]:
        if a is None or math.isnan(a):
            break
        if not 0.0 <= a <= 1.0:
            raise ValueError(f"a conditional acceptance must lie in [0, 1], got {a}")
        survive *= a
        tau += survive
    return tau


def draft_keys(cost: CostModel, drafter_name: str) -> dict[int, str]:
    """{K: key} of the draft costs that `cost` holds for drafters named `drafter_name` (keys
    "<name>/K<K>/<parameters>"); an error when it holds two drafters of that name (other parameter counts)."""
    keys: dict[int, str] = {}
    sizes = set()
    for key in cost.draft:
        m = re.fullmatch(rf"{re.escape(drafter_name)}/K(\d+)/(\d+)", key)
        if m:
            keys[int(m.group(1))] = key
            sizes.add(m.group(2))
    if len(sizes) > 1:
        raise ValueError(f"the cost table holds draft costs of {len(sizes)} {drafter_name!r} drafters (parameter counts "
                         f"{', '.join(sorted(sizes))}); profile one drafter per table")
    return dict(sorted(keys.items()))


@dataclass
class DraftLengthChoice:
    """The predicted round of each measured K at `requests` rows, and the K that pays best (0: plain decoding)."""

    draft_length: int
    requests: int
    plain_ms: float
    rows: list[dict] = field(default_factory=list)  # per K: expected_tau, draft_ms, verify_ms, round_ms, speedup

    def reason(self) -> str:
        """One line a user reads to see which γ was chosen and why."""
        if not self.rows:
            return "no draft length was both profiled and measured for acceptance"
        best = max(self.rows, key=lambda r: r["speedup"])
        if self.draft_length == 0:
            return (f"γ = 0 (plain decoding): the best draft length, K = {best['draft_length']}, would commit "
                    f"{best['expected_tau']:.2f} tokens a round in {best['round_ms']:.2f} ms against plain decoding's "
                    f"1 in {self.plain_ms:.2f} ms ({best['speedup']:.2f}x) at {self.requests} request(s)")
        return (f"γ = {self.draft_length}: {best['expected_tau']:.2f} tokens a round in {best['round_ms']:.2f} ms "
                f"(draft {best['draft_ms']:.2f} + verify {best['verify_ms']:.2f} ms) against plain decoding's 1 in "
                f"{self.plain_ms:.2f} ms, predicted {best['speedup']:.2f}x at {self.requests} request(s)")

    def to_dict(self) -> dict:
        return {"draft_length": self.draft_length, "requests": self.requests, "plain_ms": self.plain_ms,
                "rows": self.rows, "reason": self.reason()}


def choose_draft_length(cost: CostModel, conditional_acceptance: Sequence[float | None], *,
                        key_for: Callable[[int], str] | dict[int, str], requests: int = 1,
                        lengths: Sequence[int] | None = None) -> DraftLengthChoice:
    """The draft length among `lengths` (default: every K with a draft cost in `cost` and an acceptance measured)
    that maximises predicted tokens/s at `requests` rows. key_for: K -> the cost table's draft key
    (`lambda K: draft_key(drafter, K)`, or `draft_keys(cost, name)`)."""
    if requests < 1:
        raise ValueError(f"requests must be >= 1, got {requests}")
    lookup = key_for.get if isinstance(key_for, dict) else key_for
    if lengths is None:
        if not isinstance(key_for, dict):
            raise ValueError("lengths= is needed when key_for is a function")
        lengths = list(key_for)
    width = torch.tensor([1], dtype=torch.long)
    plain_s = float(cost.step_seconds(requests, width)[0])
    rows = []
    for K in sorted(set(lengths)):
        if K < 1 or K > len(conditional_acceptance):
            continue
        key = lookup(K)
        draft_s = cost.draft_seconds(key, requests) if key is not None else None
        if draft_s is None:
            continue
        observe_s = cost.draft_seconds(key, requests, step="observe") or 0.0
        verify_s = float(cost.step_seconds(requests, width * (K + 1))[0])
        round_s = draft_s + observe_s + verify_s
        tau = expected_tau(conditional_acceptance, K)
        rows.append({"draft_length": K, "expected_tau": tau, "draft_ms": 1e3 * draft_s, "observe_ms": 1e3 * observe_s,
                     "verify_ms": 1e3 * verify_s, "round_ms": 1e3 * round_s,
                     "speedup": (tau / round_s) / (1.0 / plain_s)})
    best = max(rows, key=lambda r: r["speedup"], default=None)
    chosen = best["draft_length"] if best is not None and best["speedup"] > 1.0 else 0
    return DraftLengthChoice(draft_length=chosen, requests=requests, plain_ms=1e3 * plain_s, rows=rows)
