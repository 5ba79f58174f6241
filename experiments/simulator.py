"""Replay simulator: predict throughput and per-request speed of any policy at any concurrency from logged rounds
and a profiled SPS(B) table, for loads and hosts beyond the machine at hand.

    dspark experiment simulate --traces results/acc/trace_dspark_chat.json --cost-table h200_cost.json \\
        --policies full threshold scheduler --concurrency 1 8 64 512 --draft-ms 0.5 --out-dir results/sim

Trace (format "dspark.trace", version 1; written by `dspark experiment acceptance` from a verify-all decode):
    method, domain, host, draft_length K
    requests    [{"new_tokens": n, "proposed": [..], "verified": [..], "accepted": [..],
                  "confidence": [[c_1..c_K], ..] or null}]   one entry per logged round, in order

Model (closed loop, C requests in flight): every step, each live request takes the logged round that covers its
position (the tokens it has committed; `logged_round`): at a round's start, that round as logged; d tokens into
it, the rest of it (its accepted drafts less d, its confidences from position d on). A verify-all replay so takes
the logged rounds one after another; a plain step or a partial verify moves a request fewer tokens than the log
did, and it meets the drafter where the logged decode stood at that position, not at the log's next round (so a
drafter whose acceptance comes in bursts, as an n-gram's does, is probed inside a burst as often as the text is
in one). The policy under test (the real verifier class) picks ell from those confidences; the request commits
min(ell, a) + 1 tokens, where a is the logged number of accepted drafts under verify-all (when the log verified
fewer than ell and accepted all of them, a is censored and taken as logged: conservative).
The step lasts 1 / SPS(B) with B = Σ (1 + ell) over the live requests (the slot engine's pricing: by the forward's
shape, see Pricing), plus `draft_ms` per speculative step. A request that reaches its logged new_tokens leaves and
the next one enters at the following step. Throughput = tokens / simulated seconds; per-request speed = tokens /
(leave - enter), averaged over requests.

The schedulers' draft gate is replayed too: a step it skips is plain (no draft_ms, nothing verified, one token
per request), priced by the gate with `draft_ms`, and told what the engine tells it (the tokens committed and, with
logged confidences, the drafts they expected to be accepted).

Approximations, stated: a round is replayed from the logged round at the same position, so drafts proposed from
a position the logged decode passed through mid-round are taken to be that round's remaining drafts (what the
drafter would propose afresh from there is not logged); drafting cost is one constant per step; the
lagged scheduler's history restarts whenever the set of live requests changes. The GPU check of these predictions
against measured runs belongs with the continuous-batching engine.
Writes OUT_DIR/simulate.json (`rows` as concurrency.json's, engine "replay"; `break_even`), simulate.md and PNGs.
"""
from __future__ import annotations

import bisect
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch

from dspark.documents import Section, write_result
from dspark.engine.acceptance import expected_accepted
from dspark.engine.protocol import Proposal
from dspark.engine.round import backlog_rounds, width_bucket
from verifiers.prefix_scheduler import forward_seconds

FORMAT = "dspark.trace"
VERSION = 1


# ---- traces -----------------------------------------------------------------------------------------------------
def trace_from_result(result, *, draft_length: int, **meta) -> dict:
    """A trace document from a verify-all GenerationResult (its RoundLog), one entry per request."""
    log = result.log
    request = log.column("request")
    conf = log.confidences()
    columns = {name: log.column(name) for name in ("proposed", "verified", "accepted")}
    requests = []
    for i, tokens in enumerate(result.token_ids):
        rows = (request == i).nonzero().flatten()
        requests.append({"new_tokens": len(tokens), **{k: v[rows].tolist() for k, v in columns.items()},
                         "confidence": None if conf is None else [[round(c, 5) for c in r] for r in
                                                                   conf[rows].tolist()]})
    return {"format": FORMAT, "version": VERSION, "draft_length": draft_length, **meta, "requests": requests}


def load_trace(path: str | Path) -> dict:
    from dspark.engine.jsonio import read_versioned_json

    doc = read_versioned_json(path, FORMAT, VERSION, what="trace")
    if not doc.get("requests") or any(not r["accepted"] for r in doc["requests"]):
        raise ValueError(f"trace {path} has no requests, or a request without logged rounds")
    return doc


# ---- the replay -------------------------------------------------------------------------------------------------
@dataclass
class _Live:
    serial: int  # admission order: identifies the request (ids of freed objects get reused)
    trace: dict
    starts: list[int]  # the position (tokens committed before it) at which each logged round began
    start: float
    tokens: int = 0


def round_starts(request: dict, first: int) -> list[int]:
    """Where each logged round of a trace request began: the tokens committed before it, `first` of them before any
    round (1 where the admission's prefill draws the first token, as the slot engine's does)."""
    starts, at = [], first
    for a in request["accepted"]:
        starts.append(at)
        at += a + 1
    return starts


def logged_round(live: _Live, K: int) -> tuple[int, int, list[float] | None]:
    """What the drafter offers at the request's position p, from the logged round that covers it: round j began at
    p - d (d >= 0) and accepted a drafts, so from p it offers its remaining a - d accepted drafts (none past them),
    proposed - d proposed ones, and the confidences of its positions d.. (zero past the logged K). d = 0 at every
    step of a verify-all replay; d > 0 after plain steps or a partial verify, which commit fewer tokens than the
    logged round did. At d = a of a round that accepted all it proposed (its bonus token's position: the log does
    not say what a draft from there would do), the next logged round stands in, one token early. Returns
    (accepted, proposed, confidences or None)."""
    t = live.trace
    j = max(0, bisect.bisect_right(live.starts, live.tokens) - 1)
    d = live.tokens - live.starts[j]
    if d and d == t["accepted"][j] == t["proposed"][j] and j + 1 < len(live.starts):
        j, d = j + 1, 0
    conf = t["confidence"]
    return (max(t["accepted"][j] - d, 0), max(t["proposed"][j] - d, 0),
            None if conf is None else list(conf[j][d:]) + [0.0] * min(d, K))


@dataclass(frozen=True)
class Pricing:
    """What a replayed step costs besides its verify forward (`verify_seconds`).

    mode "ragged": a step verifies B = Σ (1 + ell) tokens over the live requests and drafts `draft_ms`; "slots": as
    the slot engine runs it, every one of the C slots (live or idle) carries the anchor and the bucketed longest ell
    (dspark.engine.round.width_bucket), a forward of C rows x (L + 1) tokens priced by that shape, and the draft
    step covers C rows (`draft_seconds(C)`, e.g. a cost table's profiled draft entry, else `draft_ms`), and a
    request's first new token comes from its admission's prefill, before its first step. `observe_seconds(rows)`,
    when given, prices the drafter's observe of each step's committed positions, in every step of a speculative
    decode (plain steps of a gated one too), or, with `deferred_observe` (the engine's backlog,
    dspark.engine.graphs.defers_observe), for a gated decode's plain steps one observe of all of them, paid at the
    next drafted step or when 4 verify widths of K + 1 fill, priced as an observe over rows x widths rows (the same
    positions: its width-(K + 1) price scaled by rows). `step_overhead_ms` is added to every step (the engine's
    acceptance and CPU bookkeeping) and `admission_ms` to every step that admits requests (one prefill per group of
    arrivals). `overlap`: the engine's overlapped rounds (dspark.engine.serve.overlap_allowed), each launched before
    the last one is committed: a verifier hears of a step after the next one has drafted or not (a draft gate lags
    one step), and a finished request holds its slot one more step (its refill comes a step later; a step with only
    such rows still runs)."""

    mode: str = "ragged"
    draft_ms: float = 0.0
    draft_seconds: Optional[Callable[[int], float]] = None
    observe_seconds: Optional[Callable[[int], float]] = None
    deferred_observe: bool = False
    step_overhead_ms: float = 0.0
    admission_ms: float = 0.0
    overlap: bool = False

    def __post_init__(self) -> None:
        if self.mode not in ("ragged", "slots"):
            raise ValueError(f"pricing mode must be ragged or slots, got {self.mode!r}")

    @property
    def slots(self) -> bool:
        return self.mode == "slots"

    def verify_tokens(self, ell: torch.Tensor, concurrency: int, K: int) -> int:
        """B of one step's verify forward."""
        return concurrency * (width_bucket(int(ell.max()), K) + 1) if self.slots else int((ell + 1).sum())

    def verify_seconds(self, cost, ell: torch.Tensor, concurrency: int, K: int) -> float:
        """Seconds of one step's verify forward. "slots": C rows of the bucketed width plus the anchor, by the
        forward's shape where `cost` is a profiled CostModel with its (R, T) grid (as the scheduler and the draft
        gate price it, verifiers.prefix_scheduler.forward_seconds), else 1 / SPS(C·T); "ragged": 1 / SPS(B)."""
        if not self.slots:
            return 1.0 / float(cost(self.verify_tokens(ell, concurrency, K)))
        width = torch.tensor([width_bucket(int(ell.max()), K) + 1])
        return float(forward_seconds(cost, concurrency, width)[0])

    def draft(self, rows: int) -> float:
        """Seconds of one draft step over `rows` rows."""
        return self.draft_seconds(rows) if self.draft_seconds is not None else self.draft_ms / 1000.0

    def observe(self, rows: int) -> float:
        return self.observe_seconds(rows) if self.observe_seconds is not None else 0.0


def simulate(trace: dict, *, policy, concurrency: int, cost, requests: int, pricing: Pricing = Pricing()) -> dict:
    """Replay `requests` requests (trace entries in turn) with C = concurrency in flight; policy is a Verifier or
    None for plain decoding (ell = 0, no drafting); `pricing` says what a step costs besides its verify forward.
    Returns the row metrics of one setting."""

    if concurrency < 1 or requests < 1:
        raise ValueError(f"need concurrency >= 1 and requests >= 1, got {concurrency} and {requests}")
    K = trace["draft_length"] if policy is not None else 0
    pool = trace["requests"]
    first = int(pricing.slots)  # tokens before the first round: the admission's prefill draws one (slots)
    starts = [round_starts(r, first) for r in pool]
    waiting = [(pool[i % len(pool)], starts[i % len(pool)]) for i in range(requests)]
    admitted = 0
    live: list[_Live] = []
    now, steps, total_tokens = 0.0, 0, 0
    verified_sum = accepted_sum = request_rounds = 0
    speeds: list[float] = []
    members: tuple = ()
    gate = getattr(policy, "gate", None)  # the schedulers' draft gate, priced with this replay's draft cost
    if gate is not None:
        gate.begin()
        gate.fixed_draft_s = pricing.draft(concurrency)
    blocked = 0  # slots still held by requests that finished in the last step (overlap)
    backlog = 0  # plain steps whose observe waits (Pricing.deferred_observe)
    told = None  # the last step's after_round, told one step late (overlap)
    last_step_s = 0.0  # what the last step cost: a step of only finished rows (overlap) costs the same
    while waiting or live or blocked:
        if waiting and len(live) + blocked < concurrency:
            now += pricing.admission_ms / 1000.0  # one prefill for the arrivals of this moment
        while waiting and len(live) + blocked < concurrency:
            request, request_starts = waiting.pop(0)
            live.append(_Live(serial=admitted, trace=request, starts=request_starts, start=now))
            admitted += 1
            if pricing.slots:  # the admission's prefill draws the first new token, as the engine's does
                live[-1].tokens = 1
                total_tokens += 1
                if live[-1].trace["new_tokens"] <= 1:  # done at admission: no round of its own
                    live.pop()
        if not live:
            if blocked:  # launched before the engine knew its rows had finished: it runs all the same
                now, steps, blocked = now + last_step_s, steps + 1, 0
            continue
        if policy is not None and tuple(s.serial for s in live) != members:
            policy.begin(batch_size=len(live))  # why: per-request policy state is indexed by batch row
            members = tuple(s.serial for s in live)
        R = len(live)
        logged = [logged_round(s, K) for s in live]  # (accepted, proposed, confidences) at each one's position
        logged_acc = torch.tensor([a for a, _, _ in logged])  # (R,)
        drafting = policy is not None and policy.draft_next()
        if not drafting:  # plain decoding, or a round the draft gate skipped
            ell = torch.zeros(R, dtype=torch.long)
        else:
            proposed = torch.tensor([n for _, n, _ in logged])  # (R,)
            conf = None if logged[0][2] is None else torch.tensor([c for _, _, c in logged])  # (R, K)
            proposal = Proposal(tokens=torch.zeros(R, K, dtype=torch.long), confidence=conf, lengths=proposed)
            ell = torch.minimum(policy.lengths(proposal, K).clamp(0, K), proposed)  # (R,)
        accepted = torch.minimum(ell, logged_acc)  # (R,)
        rows = concurrency if pricing.slots else R  # the rows a draft step covers
        observes, flushed = int(policy is not None), 0  # this step's own observe; the backlog's rows x widths
        if policy is not None and pricing.deferred_observe and gate is not None:
            if not drafting:  # a plain step's features wait in the backlog, observed all at once later
                observes, backlog = 0, backlog + 1
            if backlog and (drafting or backlog == backlog_rounds(K)):  # one observe over the widths it spans
                flushed, backlog = rows * -(-backlog // (K + 1)), 0
        draft_s = (pricing.draft(rows) if drafting else 0.0) + observes * pricing.observe(rows)
        draft_s += pricing.observe(flushed) if flushed else 0.0
        last_step_s = pricing.verify_seconds(cost, ell, concurrency, K) + draft_s + pricing.step_overhead_ms / 1000.0
        now += last_step_s
        steps += 1
        if policy is not None:
            expected = (float(expected_accepted(conf, ell).sum()) if drafting and conf is not None else None)
            heard = dict(slots=R, rows=R, width=int(ell.max()), drafted=drafting, committed=int(accepted.sum()) + R,
                         expected=expected)
            if pricing.overlap:  # this step's draft_next came before the last step's after_round
                told, heard = heard, told
            if heard is not None:
                policy.after_round(**heard)
        verified_sum += int(ell.sum())
        accepted_sum += int(accepted.sum())
        request_rounds += R
        still = []
        for s, a in zip(live, accepted.tolist()):
            take = min(a + 1, s.trace["new_tokens"] - s.tokens)
            s.tokens += take
            total_tokens += take
            if s.tokens >= s.trace["new_tokens"]:
                speeds.append(s.tokens / (now - s.start))
            else:
                still.append(s)
        blocked = len(live) - len(still) if pricing.overlap else 0
        live = still
    return {"tokens_per_s": total_tokens / now,
            "per_request_tokens_per_s": sum(speeds) / len(speeds) if speeds else float("nan"),
            "tau": (accepted_sum + request_rounds) / request_rounds,
            "accepted_per_round": accepted_sum / request_rounds, "verified_per_round": verified_sum / request_rounds,
            "steps": steps, "requests": requests,
            "new_tokens": total_tokens, "seconds": now}


# ---- the runner -------------------------------------------------------------------------------------------------
@dataclass
class SimulateOptions:
    traces: list[str] = field(default_factory=list, metadata={
        "help": "trace JSONs (dspark experiment acceptance writes trace_METHOD_DOMAIN.json)"})
    cost_table: Optional[str] = field(default=None, metadata={
        "help": "SPS(B) JSON from `dspark profile` on the host and device to predict for (required)"})
    policies: list[str] = field(default_factory=lambda: ["full", "scheduler"], metadata={
        "help": "full, threshold, scheduler, lagged (plain decoding is always simulated)"})
    threshold: float = field(default=0.5, metadata={"help": "survival threshold of the 'threshold' policy"})
    concurrency: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64, 128, 256, 512], metadata={
        "help": "requests in flight"})
    requests: int = field(default=0, metadata={"help": "requests replayed per point (0 = max(4 C, trace size))"})
    draft_ms: float = field(default=0.0, metadata={"help": "drafting milliseconds added to every speculative step"})
    out_dir: str = field(default="results", metadata={"help": "directory for simulate.json, .md and the PNGs"})


def run(opts: SimulateOptions, cost) -> list[dict]:
    from verifiers import build_verifier, policy_options

    rows = []
    for path in opts.traces:
        trace = load_trace(path)
        for C in opts.concurrency:
            n = opts.requests or max(4 * C, len(trace["requests"]))
            # plain decoding on each trace's own requests: a speed-up compares the same requests (their lengths
            # decide how long a closed loop drains at fewer than C in flight)
            rows.append({"method": "plain", "policy": "none", "draft_length": 0, "concurrency": C, "engine": "replay",
                         "trace": path, **simulate(trace, policy=None, concurrency=C, cost=cost, requests=n)})
            for name in opts.policies:
                policy = build_verifier(name, **policy_options(name, threshold=opts.threshold, cost_table=cost))
                rows.append({"method": trace.get("method", "?"), "policy": name,
                             "draft_length": trace["draft_length"], "concurrency": C, "engine": "replay",
                             "trace": path, **simulate(trace, policy=policy, concurrency=C, cost=cost, requests=n,
                                                       pricing=Pricing(draft_ms=opts.draft_ms))})
    return rows


def name_by_trace(rows: list[dict]) -> None:
    """Each row's method gets its trace's name, "<method>@<trace stem>", plain decoding too ("plain@<trace>": one
    baseline per trace), so that settings of several traces stay apart."""
    for r in rows:
        r["method"] = f"{r['method']}@{Path(r['trace']).stem}"


def render(doc: dict, out: Path) -> Section:
    from dspark.sweep import render as render_concurrency

    section = render_concurrency(doc, out)
    section.title = "simulate: replayed throughput and per-request speed against concurrency (predicted)"
    section.markdown = (f"Predicted from traces {', '.join(doc['traces'])} with the SPS(B) table of "
                        f"{doc['cost']['host']} on {doc['cost']['device']} ({doc['cost']['mode']}).\n\n"
                        + section.markdown)
    return section


def main(argv: list[str] | None = None) -> int:
    from dspark.config import parse, to_dict
    from dspark.quickstart import environment
    from dspark.sweep import add_speedup, break_even
    from verifiers.cost_model import CostModel

    argv = list(sys.argv[1:] if argv is None else argv)
    (opts,) = parse([SimulateOptions], argv, prog="dspark experiment simulate")
    if not opts.traces or not opts.cost_table:
        raise ValueError("dspark experiment simulate needs --traces and --cost-table")
    cost = CostModel.load(opts.cost_table)
    traces = {}
    for path in opts.traces:
        trace = load_trace(path)
        traces[path] = {k: trace.get(k) for k in ("method", "domain", "host", "draft_length")}

    rows = run(opts, cost)
    if len(opts.traces) > 1:  # one break-even per trace: name settings by trace too
        name_by_trace(rows)
    add_speedup(rows)
    doc = {"experiment": "simulate", "command": "dspark experiment simulate " + " ".join(argv),
           "environment": environment(torch.device("cpu")), "host": cost.host, "settings": to_dict(opts),
           "traces": opts.traces, "trace_meta": traces,
           "cost": {"host": cost.host, "device": cost.device, "mode": cost.mode, "tokens": cost.tokens,
                    "sps": cost.sps},
           "rows": rows, "skipped": [], "break_even": break_even(rows)}
    path = write_result(doc, opts.out_dir, render)
    print(f"wrote {path}; predicted break-even concurrency: {doc['break_even']}")
    return 0
