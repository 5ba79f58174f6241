"""One round of the slot engine, in three stages over all C slots (static shapes, no host syncs):

  propose  the drafter drafts K tokens per slot, the verifier picks how many of them to verify (ell)
  verify   the host runs [x0, x1..xK] of every slot in one forward (always K + 1 wide: ell masks the rest)
  accept   acceptance on the device, then the commit: seq, the host cache, the drafter's state, the counters

Shapes: C slots, K draft positions, V vocabulary, F host features.

The stages are the eager loop's steps (dspark.decode) written for fixed shapes: idle slots propose nothing, verify
nothing and commit nothing, and the verify forward is K + 1 wide whatever ell is, so the three can be captured as
CUDA graphs (dspark.engine.graphs) and replayed. What the CPU needs from a round (new tokens, counts, the finite
flags) is packed into one tensor: the round's only device-to-host copy.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark.engine.acceptance import greedy_accept, rejection_sample
from dspark.engine.sampling import STREAM_ACCEPT, STREAM_SAMPLE, process, sample, uniform
from dspark.engine.protocol import Proposal

# columns of the packed round output after the K + 1 new tokens
N_ACCEPTED, VERIFIED, PROPOSED, FINITE = range(4)


@dataclass
class Draft:
    """What the propose stage hands to verify and accept."""

    tokens: torch.Tensor  # (C, K) long
    q: torch.Tensor | None  # (C, K, V) draft distributions, None = point masses
    confidence: torch.Tensor | None  # (C, K)
    ell: torch.Tensor  # (C,) drafts to verify (0 on idle slots)
    proposed: torch.Tensor  # (C,) drafts offered (0 on idle slots)


@dataclass
class Verified:
    logits: torch.Tensor  # (C, K+1, V) float32
    features: torch.Tensor | None  # (C, K+1, F)


def propose(slots, drafter, verifier, K: int) -> Draft:
    """Stage 1 and 2: draft, then schedule."""
    state, active = slots.state, slots.active
    C = active.shape[0]
    proposal = drafter.propose(state, K)
    full = torch.full((C,), K, dtype=torch.long, device=active.device)
    proposed = (full if proposal.lengths is None else proposal.lengths.long()) * active  # idle slots offer nothing
    seen = Proposal(tokens=proposal.tokens, q=proposal.q, confidence=proposal.confidence, lengths=proposed)
    ell = verifier.lengths(seen, K).clamp(0, K) if K else torch.zeros_like(proposed)
    ell = torch.minimum(torch.minimum(ell, proposed), (slots.remaining - 1).clamp(min=0))  # never past the budget
    return Draft(tokens=proposal.tokens, q=proposal.q, confidence=proposal.confidence, ell=ell, proposed=proposed)


def verify(slots, host, draft: Draft, taps: tuple[int, ...], attend: int | None) -> Verified:
    """Stage 3: one host forward of every slot's anchor and drafts. attend None = the whole cache (graphs)."""
    inputs = torch.cat([slots.state.anchor.unsqueeze(1), draft.tokens], dim=1)  # (C, K+1)
    out = host.step(slots.cache, inputs, draft.ell + 1, taps=taps, attend=attend)
    return Verified(logits=host.logits(out.hidden), features=out.features)


def accept(slots, drafter, draft: Draft, verified: Verified) -> torch.Tensor:
    """Stages 4 and 5: acceptance, then the commit; returns the packed (C, K+1+4) long round output."""
    state, active, logits = slots.state, slots.active, verified.logits
    tokens, ell, K = draft.tokens, draft.ell, draft.tokens.shape[1]
    finite = _finite(logits, draft)
    anchor_pos = state.seq_len - 1  # (C,)
    positions = anchor_pos.unsqueeze(1) + 1 + torch.arange(K + 1, device=ell.device)  # (C, K+1)
    if state.sampling.greedy:
        acc = greedy_accept(logits.argmax(-1), tokens, ell)
        nxt = acc.next_token
    else:
        p = process(logits, state.sampling)  # (C, K+1, V)
        u = uniform(state.seeds, positions[:, :K], STREAM_ACCEPT)  # (C, K)
        acc = rejection_sample(p, draft.q, tokens, ell, u)
        nxt = sample(acc.next_probs, state.seeds, anchor_pos + 1 + acc.n_accepted, STREAM_SAMPLE)
    n_acc = acc.n_accepted * active
    new = torch.cat([tokens, tokens.new_zeros(tokens.shape[0], 1)], dim=1).scatter_(1, n_acc.unsqueeze(1),
                                                                                      nxt.unsqueeze(1))
    state.seq.scatter_(1, positions.clamp(max=state.seq.shape[1] - 1), new)  # idle slots: past their end, unread
    step = (n_acc + 1) * active  # (C,) tokens committed: the accepted drafts and the next token
    slots.cache.advance(step)
    drafter.observe(features=verified.features, start=anchor_pos, n_valid=step, state=state)
    state.seq_len += step
    state.rounds += active.long()
    slots.remaining -= step
    return torch.cat([new, torch.stack([n_acc, ell, draft.proposed, finite.long()], dim=1)], dim=1)


def _finite(logits: torch.Tensor, draft: Draft) -> torch.Tensor:
    """(C,) host logits, draft distributions and confidences all usable (NaN or c outside [0, 1] are not)."""
    finite = torch.isfinite(logits).flatten(1).all(1)
    if draft.q is not None:
        finite = finite & torch.isfinite(draft.q).flatten(1).all(1)
    if draft.confidence is not None:  # NaN (or outside [0, 1]) would silently steer the verifier
        c = draft.confidence
        finite = finite & ((c >= 0) & (c <= 1)).all(1)  # NaN fails both comparisons
    return finite
