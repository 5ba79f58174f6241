"""One round of the slot engine, in three stages over all C slots (static shapes, no host syncs in a stage):

  propose  the drafter drafts K tokens per slot, the verifier picks how many of them to verify (ell)
  verify   the host runs [x0, x1..xL] of every slot in one forward, L + 1 wide (ell masks the rest of a row)
  accept   acceptance on the device, then the commit: seq, the host cache, the drafter's state, the counters

Shapes: C slots, K draft positions, L drafts per row in the verify forward (a bucket, `width_bucket`), V
vocabulary, F host features.

The stages are the eager loop's steps (dspark.engine.decode) written for fixed shapes: idle slots propose nothing,
verify nothing and commit nothing. Between propose and verify the CPU picks L (`drafts_to_verify`): the longest
verified row, rounded up to a bucket, so the forward is only as wide as what is verified (a scheduler's shorter
lengths save host compute, as they do in the eager loop) while shapes stay few: verify and accept run at one of a
few widths, each captured once as a CUDA graph (dspark.engine.graphs) and replayed. What the CPU needs from a round
(new tokens, counts, the finite flags) is packed into one tensor, the round's device-to-host copy. When L depends on
device values (see `drafts_to_verify`) the runner on CUDA proposes the next round's draft at the end of this round
and packs its longest length into the same copy (column AHEAD), so a round makes a second copy only when that draft
was not made: the first round, and after an admission.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark.engine.acceptance import expected_accepted, greedy_accept, rejection_sample
from dspark.engine.compiled import commit_fn, drafter_fn
from dspark.engine.sampling import STREAM_ACCEPT, STREAM_SAMPLE, argmax, process, sample, uniform
from dspark.engine.protocol import Proposal

# columns of the packed round output after the K + 1 new tokens; AHEAD: the longest length of the next round's
# draft when it was proposed at the end of this round (graphs.py, lookahead), -1 = not proposed yet; SEQ_LEN: each
# slot's committed length after the round, which the CPU checks against its own count (serve._commit_round);
# EXPECTED: the drafts the row expected to have accepted by its confidences (acceptance.expected_accepted) in
# units of 1 / EXPECTED_SCALE, -1 = a drafter without confidences (the packed output is one long tensor)
N_ACCEPTED, VERIFIED, PROPOSED, FINITE, NEXT_WIDTH, AHEAD, SEQ_LEN, EXPECTED = range(8)
COLUMNS = 8
EXPECTED_SCALE = 1 << 16


@dataclass
class Draft:
    """What the propose stage hands to verify and accept."""

    tokens: torch.Tensor  # (C, K) long
    q: torch.Tensor | None  # (C, K, V) draft distributions, None = point masses
    confidence: torch.Tensor | None  # (C, K)
    ell: torch.Tensor  # (C,) drafts to verify (0 on idle slots)
    proposed: torch.Tensor  # (C,) drafts offered (0 on idle slots)
    # the longest proposal as a Python int when known without a device read: K when the drafter proposes all K,
    # else its `Proposal.width` (MTP-1: 1); None = only the device knows (n-gram lookups)
    width: int | None = None
    # 0-dim long: the verifier's bound on the next round's lengths (Verifier.next_width), -1 = none
    next_width: torch.Tensor | None = None


@dataclass
class Verified:
    logits: torch.Tensor  # (C, L+1, V) float32
    features: torch.Tensor | None  # (C, L+1, F)


def propose(slots, drafter, verifier, K: int) -> Draft:
    """Stage 1 and 2: draft, then schedule."""
    state, active = slots.state, slots.active
    C = active.shape[0]
    # a compiled host compiles the drafter's propose too (greedy only: dspark.engine.compiled.drafter_fn)
    proposal = drafter_fn(drafter, "propose", slots.host, state.sampling.greedy)(state, K)
    full = torch.full((C,), K, dtype=torch.long, device=active.device)
    proposed = (full if proposal.lengths is None else proposal.lengths.long()) * active  # idle slots offer nothing
    seen = Proposal(tokens=proposal.tokens, q=proposal.q, confidence=proposal.confidence, lengths=proposed)
    ell = verifier.lengths(seen, K).clamp(0, K) if K else torch.zeros_like(proposed)
    ell = torch.minimum(torch.minimum(ell, proposed), (slots.remaining - 1).clamp(min=0))  # never past the budget
    width = K if proposal.lengths is None else None if proposal.width is None else min(K, int(proposal.width))
    ahead = verifier.next_width() if K else None
    ahead = torch.full((), -1, device=ell.device) if ahead is None else ahead.long().clamp(0, K)
    return Draft(tokens=proposal.tokens, q=proposal.q, confidence=proposal.confidence, ell=ell, proposed=proposed,
                 width=width, next_width=ahead)


def no_draft(slots, K: int, draft: Draft | None = None) -> Draft:
    """A plain round's Draft (the verifier skipped drafting, Verifier.draft_next): nothing proposed or verified.
    Given `draft`, written into its buffers in place (a captured round reads those very tensors): its tokens and q
    are left as they are, unread at width 0, and its confidences zeroed (a stale one of a slot admitted since
    could fail the finite check)."""
    if draft is None:
        C, device = slots.capacity, slots.active.device
        zeros = torch.zeros(C, dtype=torch.long, device=device)
        return Draft(tokens=torch.zeros(C, K, dtype=torch.long, device=device), q=None, confidence=None, ell=zeros,
                     proposed=zeros.clone(), width=0, next_width=torch.full((), -1, device=device))
    draft.ell.zero_()
    draft.proposed.zero_()
    if draft.confidence is not None:
        draft.confidence.zero_()
    draft.next_width.fill_(-1)
    draft.width = 0
    return draft


def width_bucket(L: int, K: int) -> int:
    """The drafts per row (bucket) of a verify forward that must hold L drafts: the forward width L + 1 rounded up
    to every width up to 8, then powers of two, capped at K + 1.

    why these buckets: each width is one more pair of captured graphs (capture time and graph memory on a GPU), so
    widths must stay few; up to 8 wide (K <= 7, the default K = 7 included) there are few enough to keep every
    one, so the forward is exactly as wide as the scheduler priced it (verify_tokens: R·(L + 1)); past 8, padding a
    row by at most 2x costs less than a graph per width. (The eager loop, with no graphs, runs L + 1 exactly.)"""
    W = L + 1
    if W > 8:
        W = 1 << (W - 1).bit_length()
    return min(W, K + 1) - 1


def width_on_cpu(slots, verifier, draft: Draft, K: int) -> int | None:
    """The longest verified row as known on the CPU without a device read, or None.

    With a known `draft.width` (K, or a drafter's static maximum) verify-all needs none (every live row verifies
    min(width, budget - 1); the budgets are mirrored on the CPU), nor does a verifier that bounded this round's
    lengths in advance (the lagged scheduler's capacity, `slots.next_width`, read back with the previous round's
    copy). Otherwise (n-gram lengths, threshold and scheduler lengths, the lagged scheduler's first two rounds)
    only the device knows."""
    ahead = None if verifier.static_length or slots.next_width < 0 else slots.next_width
    if draft.width is not None and (verifier.static_length or ahead is not None):
        budget = max((slots.remaining_cpu[s] for s, r in enumerate(slots.request) if r is not None), default=1)
        return max(0, min(draft.width, budget - 1, K if ahead is None else ahead))
    return None


def drafts_to_verify(slots, verifier, draft: Draft, K: int) -> int:
    """L for this round's verify forward: the bucket of the longest verified row, read on the CPU where possible
    (`width_on_cpu`), else from the device: a second device-to-host copy this round, one integer, before the
    forward. (A round runner that proposes the next round's draft at the end of this one reads it with this
    round's copy instead: graphs.py, lookahead.)"""
    L = width_on_cpu(slots, verifier, draft, K)
    if L is None:
        L = int(draft.ell.max().cpu())  # the round's second device-to-host copy
    return width_bucket(L, K)


def verify(slots, host, draft: Draft, L: int, taps: tuple[int, ...], attend: int | None) -> Verified:
    """Stage 3: one host forward of every slot's anchor and first L drafts. attend None = the whole cache (graphs).
    L >= every ell (drafts_to_verify); the clamp only guards a drafter whose `width` understated its lengths."""
    inputs = torch.cat([slots.state.anchor.unsqueeze(1), draft.tokens[:, :L]], dim=1)  # (C, L+1)
    out = host.step(slots.cache, inputs, draft.ell.clamp(max=L) + 1, taps=taps, attend=attend)
    return Verified(logits=host.logits(out.hidden), features=out.features)


def accept(slots, drafter, draft: Draft, verified: Verified, defer: bool = False) -> torch.Tensor:
    """Stages 4 and 5: acceptance, then the commit, at the verify forward's width L + 1; returns the packed
    (C, K+1+COLUMNS) long round output (the new tokens padded to K + 1, whatever L). A compiled host runs the
    acceptance and the commit of tokens as one compiled function (greedy: dspark.engine.compiled.commit_fn).
    `defer` (a plain round of a runner that defers, graphs.defers_observe): the anchor's features go into the
    slots' backlog instead of the drafter's observe (flush_observe observes them later)."""
    state, active = slots.state, slots.active
    commit = commit_fn(_commit, slots.host, state.sampling.greedy)
    out, anchor_pos, step = commit(verified.logits, draft.tokens, draft.q, draft.ell, draft.proposed,
                                   draft.next_width, draft.confidence, state.seq, state.seq_len, state.seeds, active,
                                   slots.remaining, slots.cache.lengths, state.sampling)
    if defer:  # a plain round commits at most the anchor: its features wait at each slot's next backlog row
        n = slots.backlog_n
        rows = torch.arange(n.shape[0], device=n.device)
        slots.backlog[rows, n.clamp(max=slots.backlog.shape[1] - 1)] = verified.features[:, 0]
        slots.backlog_n += step
    else:
        drafter_fn(drafter, "observe", slots.host)(features=verified.features, start=anchor_pos, n_valid=step,
                                                   state=state)
    state.seq_len += step
    state.rounds += active.long()
    slots.remaining -= step
    return out


#: plain rounds whose features a deferring runner keeps, in verify widths of K + 1 positions (backlog_rounds)
BACKLOG_CHUNKS = 4


def backlog_rounds(K: int) -> int:
    """Plain rounds a deferring runner keeps before it observes them (at most one position per slot each)."""
    return BACKLOG_CHUNKS * (K + 1)


def flush_observe(slots, drafter, K: int, chunks: int) -> None:
    """The drafter observes the backlog (every slot's features of the plain rounds since its last observe) in one
    call over `chunks` verify widths of K + 1 positions, then the backlog is empty. The host's cache holds every
    committed position, so each slot's backlog starts at its cache length less its backlog; the rest of a row is
    padding (n_valid), as in a round's observe. The same positions from the same features as the plain rounds
    would have observed them (observe_batched). why one call rather than one per verify width: at low load an
    observe is launch-bound, a run of small kernels whose count does not depend on its width, so one wide call
    should cost about as much as one of the per-width calls it replaces."""
    n = slots.backlog_n * slots.active
    drafter_fn(drafter, "observe", slots.host)(features=slots.backlog[:, :chunks * (K + 1)],
                                               start=slots.cache.lengths - n, n_valid=n, state=slots.state)
    slots.backlog_n.zero_()


def _commit(logits, draft_tokens, draft_q, ell, proposed, next_width, confidence, seq, seq_len, seeds, active,
            remaining, cache_lengths, sampling):
    """accept's tensor work before the drafter observes: acceptance, the new tokens into seq, the host cache's
    lengths advanced; returns (packed output, each slot's anchor position, tokens committed). Tensors and a
    SamplingConfig only, so that torch.compile traces it once for every run (no Python objects to guard on)."""
    C, K, L = draft_tokens.shape[0], draft_tokens.shape[1], logits.shape[1] - 1
    tokens, q, ell = draft_tokens[:, :L], None if draft_q is None else draft_q[:, :L], ell.clamp(max=L)
    finite = _finite(logits, q, confidence)
    anchor_pos = seq_len - 1  # (C,)
    positions = anchor_pos.unsqueeze(1) + 1 + torch.arange(L + 1, device=ell.device)  # (C, L+1)
    if sampling.greedy:
        acc = greedy_accept(argmax(logits), tokens, ell)
        nxt = acc.next_token
    else:
        p = process(logits, sampling)  # (C, L+1, V)
        u = uniform(seeds, positions[:, :L], STREAM_ACCEPT)  # (C, L)
        acc = rejection_sample(p, q, tokens, ell, u)
        nxt = sample(acc.next_probs, seeds, anchor_pos + 1 + acc.n_accepted, STREAM_SAMPLE)
    # why `remaining > 0` too: a slot whose budget is spent commits nothing even before the CPU retires it, so no
    # disagreement between the CPU and the device can run a slot past the end of its rows (an index error on CUDA)
    live = active & (remaining > 0)
    n_acc = acc.n_accepted * live
    new = torch.cat([tokens, tokens.new_zeros(C, K + 1 - L)], dim=1).scatter_(1, n_acc.unsqueeze(1),
                                                                               nxt.unsqueeze(1))  # (C, K+1)
    seq.scatter_(1, positions.clamp(max=seq.shape[1] - 1), new[:, : L + 1])  # idle: past their end
    step = (n_acc + 1) * live  # (C,) tokens committed: the accepted drafts and the next token
    cache_lengths += step  # the host cache's KVCache.advance
    if confidence is None:
        expected = torch.full_like(n_acc, -1)
    elif L == 0:  # nothing verified (a plain round's graph): no kernels for a sum that is 0
        expected = torch.zeros_like(n_acc)
    else:
        expected = (expected_accepted(confidence, ell) * EXPECTED_SCALE).round().long() * live
    columns = [n_acc, ell, proposed, finite.long(), next_width.expand(C), torch.full_like(n_acc, -1), seq_len + step,
               expected]
    return torch.cat([new, torch.stack(columns, dim=1)], dim=1), anchor_pos, step


def _finite(logits: torch.Tensor, q: torch.Tensor | None, confidence: torch.Tensor | None) -> torch.Tensor:
    """(C,) host logits, draft distributions and confidences all usable (NaN or c outside [0, 1] are not)."""
    finite = torch.isfinite(logits).flatten(1).all(1)
    if q is not None:
        finite = finite & torch.isfinite(q).flatten(1).all(1)
    if confidence is not None:  # NaN (or outside [0, 1]) would silently steer the verifier
        c = confidence
        finite = finite & ((c >= 0) & (c <= 1)).all(1)  # NaN fails both comparisons
    return finite
