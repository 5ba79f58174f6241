"""The protocol between the decode loop and its methods: what a drafter receives each round and what it returns,
and what a verifier decides. Plain decoding (`NoDrafter`) and verify-all (`VerifyAll`) are its trivial members.

Shapes: B requests, K draft positions, V vocabulary, T tokens, F = m*H concatenated host features.
Notation (docs/DSPARK.md): p = host distribution, q = draft distribution, c = confidence.

A verifier may only look at what is known before the host verifies (confidences, the number of requests, its own
history). Lengths must not depend on tokens they are deciding about beyond what a non-anticipating rule allows
(docs/DSPARK.md §4.3); `tests/test_verifiers_lossless.py` checks every registered policy at T = 1.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from dspark.engine.sampling import STREAM_DRAFT, SamplingConfig, argmax, process, sample


# how many graph_shapes blocks are open (a plain global, not a ContextVar: the engine runs on one thread, and
# torch.compile guards on a global int where it would break its graph on a ContextVar's get)
_graph_shapes = 0


@contextlib.contextmanager
def graph_shapes():
    """A block that a graph runner will capture, or whose shapes its capture must find compiled already: its
    warm-ups, its recording and (capture off, the static runner) every re-run of a recorded graph
    (dspark.engine.graphs.GraphRound). Inside it `fixed_shapes` holds, so a drafter runs its capturable path
    there, not only under the capture itself. why: a warm-up that takes the eager path runs other shapes than the
    capture (the small-LM drafter attends a bucketed prefix of its cache, the capture the whole cache), so
    torch.compile would recompile the host-step pieces inside the capture, which CUDA forbids ("operation not
    permitted when stream is capturing")."""
    global _graph_shapes
    _graph_shapes += 1
    try:
        yield
    finally:
        _graph_shapes -= 1


def fixed_shapes(device: torch.device) -> bool:
    """Whether the running code must keep the shapes and the device-read-free path a CUDA graph captures: while a
    stream of `device` is capturing, or inside `graph_shapes` (a graph runner's warm-ups and recording). A
    drafter with an eager path (shapes from values read off the device) and a capturable one picks by this, never
    by torch.cuda.is_current_stream_capturing alone: the warm-ups must run exactly what the capture runs."""
    return _graph_shapes > 0 or (device.type == "cuda" and torch.cuda.is_current_stream_capturing())


@dataclass
class Proposal:
    """What a drafter proposes for one round."""

    tokens: torch.Tensor  # (B, K) long: x1..xK
    q: torch.Tensor | None = None  # (B, K, V) float32: the exact distributions x was sampled from; None = point mass
    confidence: torch.Tensor | None = None  # (B, K) in [0, 1]: P(x_k survives | x_<k survived)
    lengths: torch.Tensor | None = None  # (B,) long: valid proposals per request (<= K); None = all K
    # a bound on `lengths` as a Python int, when the drafter knows one without reading the device (MTP-1 always
    # proposes 1; the n-gram drafter with full_width states K); lets verify-all size its forward without a device
    # sync. None = not known (the loop then reads the largest length from the device when it needs it)
    width: int | None = None


@dataclass
class DraftState:
    """The decode loop's view of the batch, handed to `Drafter.propose` each round.

    `seq[b, :seq_len[b]]` are the committed tokens (prompt + generated) of request b; the last one is the anchor
    x0, committed but not yet run through the host. `seeds` and `rounds` key the counter-based sampling noise so a
    request's draws depend only on its own seed and history, never on its batch companions.
    """

    seq: torch.Tensor  # (B, Tmax) long
    seq_len: torch.Tensor  # (B,) long
    seeds: torch.Tensor  # (B,) long
    rounds: torch.Tensor  # (B,) long: rounds done so far by each request
    sampling: SamplingConfig

    @property
    def anchor(self) -> torch.Tensor:
        """(B,) the last committed token of each request."""
        return self.seq.gather(1, (self.seq_len - 1).unsqueeze(1)).squeeze(1)

    def draw(self, logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft position k of this round from draft logits (B, V): the exact distribution q (B, V) the token is
        drawn from, and the token (B,) (the argmax when greedy). The noise is keyed by (round, k), fresh every
        round and never shared with the host's streams."""
        q = process(logits, self.sampling)
        if self.sampling.greedy:
            return q, argmax(logits)
        return q, sample(q, self.seeds, self.rounds * 1024 + k, STREAM_DRAFT)  # K < 1024: keys never collide


class Drafter:
    """Base class of every drafter. Subclasses set `feature_layers` and implement `propose`.

    Round protocol driven by `dspark.engine.decode.generate`:
      begin(...)            once per batch, after the host prefilled the prompts
      observe(...)          host features of newly committed positions (prompt, then accepted tokens each round)
      prefill(state)        once per admission, after the prompt's observe: a drafter with a model of its own
                            feeds the prompts (eagerly, any shape), so its rounds feed only what they commit
      propose(state, K)     draft K tokens after the anchor
      select(rows)          keep only these batch rows (finished requests leave the batch)
    """

    name: str = "drafter"
    #: attributes holding per-request state, batch-major (a KVCache's batch rows, or a tensor's dim 0). The slot
    #: engine (dspark.engine.slots) admits a request into a free slot by running begin/observe on a sub-batch and
    #: writing these rows into the full batch's state in place; the static batch is the case of one admission.
    slot_state: tuple[str, ...] = ()
    #: True when propose/observe are tensor-only (no host syncs, no Python branching on values) and update state in
    #: place: the slot engine may then capture them in a CUDA graph. A drafter that has an eager path besides (device
    #: reads, value-dependent shapes) takes the capturable one whenever `fixed_shapes` holds
    capturable: bool = False
    #: False when propose/observe must not be compiled whole (dspark.engine.compiled.drafter_fn) though capturable:
    #: the small-LM drafter, whose steps are a Host's, already compiled piece by piece when the host is
    compile_whole: bool = True
    #: True when begin's state is all zeros and observe + prefill of an admission's prompts are tensor-only at the
    #: shapes given (no host syncs, no Python branching on values, state updated in place): the slot engine then
    #: runs a drafter's admission on scratch rows per arrival shape, replayed as a CUDA graph
    #: (dspark.engine.prefill.DrafterPrefill). Not the small-LM drafter, whose prefill sizes its step by the prompts
    admit_capturable: bool = False
    #: host layers whose raw outputs this drafter consumes (concatenated in this order); () = none
    feature_layers: tuple[int, ...] = ()
    #: True when observe writes each position from its own features alone (no state carried from one position to
    #: the next), so positions may be observed later and many at once: under a draft gate the slot engine then keeps
    #: plain rounds' features and observes them before the next drafted round (dspark.engine.round.flush_observe),
    #: in one call of up to round.backlog_rounds(K) positions per row; padding positions past n_valid that would
    #: fall beyond the drafter's cache are clamped to its last position (never a committed one)
    observe_batched: bool = False

    def begin(self, *, host, batch_size: int, max_len: int) -> None:
        """Allocate per-batch state for `batch_size` requests of at most `max_len` positions."""

    def observe(self, *, features: torch.Tensor | None, start: torch.Tensor, n_valid: torch.Tensor,
                state: DraftState) -> None:
        """Host features (B, T, F) of positions start[b] .. start[b]+n_valid[b]-1, now committed."""

    def prefill(self, *, state: DraftState) -> None:
        """The prompts of `state`'s rows are committed (their first new token is the anchor)."""

    def propose(self, state: DraftState, K: int) -> Proposal:
        raise NotImplementedError

    def select(self, rows: torch.Tensor) -> None:
        """Keep only batch rows `rows` (B',) of the per-batch state, in that order."""


class NoDrafter(Drafter):
    """Proposes nothing: the loop degenerates to plain autoregressive decoding."""

    name = "none"
    capturable = True

    def propose(self, state: DraftState, K: int) -> Proposal:
        return Proposal(tokens=state.seq.new_zeros(state.seq.shape[0], 0))


class Verifier:
    """Base class: `lengths` returns (B,) long in 0..K, clipped to `proposal.lengths` by the caller."""

    name: str = "verifier"
    #: False only for the deliberately biased global search kept for the losslessness demonstration
    lossless: bool = True
    #: True when every length is K (or the drafter's own lengths): the decode loop then sizes the verify
    #: forward as K + 1, or as the drafter's `Proposal.width` + 1, without reading the lengths back from the device
    static_length: bool = False
    #: True when lengths() is tensor-only and keeps no Python state: the slot engine may capture it in a CUDA graph
    capturable: bool = False
    #: True when draft_next may stop drafting for long runs of rounds (a draft gate): the slot engine then defers a
    #: drafter's observe over those plain rounds where the drafter allows it (Drafter.observe_batched)
    gates_drafts: bool = False

    def begin(self, *, batch_size: int) -> None:
        """Reset per-batch state."""

    def lengths(self, proposal: Proposal, K: int) -> torch.Tensor:
        raise NotImplementedError

    def select(self, rows: torch.Tensor) -> None:
        """Keep only these batch rows of any per-request state."""

    def bind(self, *, drafter: Drafter, K: int) -> None:
        """Called once before decoding, with the drafter and the draft length in use."""

    def draft_next(self) -> bool:
        """Whether the next round runs the drafter at all; False makes it a plain round (no draft forward,
        nothing verified). It may depend only on finished rounds, never on drafts not yet made, which keeps every
        policy lossless: a plain round is an ordinary round with nothing proposed."""
        return True

    def after_round(self, *, slots: int, rows: int, width: int, drafted: bool, committed: int,
                    expected: float | None = None) -> None:
        """What a finished round did, read from its device-to-host copy (no device read of its own): `slots` rows in
        the verify forward (live or idle), `rows` live requests, `width` drafts per row of that forward, whether
        it drafted, the tokens the live rows committed (accepted + 1 each, before budgets and stops cut), and the
        drafts they expected to have accepted by the drafter's confidences (acceptance.expected_accepted; None for a
        plain round or a drafter without confidences)."""

    def next_width(self) -> torch.Tensor | None:
        """A bound on every length the next call of lengths() will return, as a 0-dim long tensor, when it is
        decided already (a lagged policy); None = not known. The slot engine reads it back with this round's
        copy, so the next round's verify width needs no device read of its own."""
        return None


class VerifyAll(Verifier):
    """ell_b = K, or the drafter's own `proposal.lengths` when it proposed fewer. Trivially lossless."""

    name = "full"
    static_length = True
    capturable = True

    def lengths(self, proposal: Proposal, K: int) -> torch.Tensor:
        if proposal.lengths is not None:
            return proposal.lengths.long().clamp(0, K)
        return torch.full((proposal.tokens.shape[0],), K, dtype=torch.long, device=proposal.tokens.device)
