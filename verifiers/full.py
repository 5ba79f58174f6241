"""Verify everything the drafter proposed: the fixed-length speculation baseline.

Shapes: B requests, K draft positions.
"""
from __future__ import annotations

import torch

from drafters.base import Proposal
from verifiers.base import Verifier


class VerifyAll(Verifier):
    """ell_b = K, or the drafter's own `proposal.lengths` when it proposed fewer. Trivially lossless."""

    name = "full"
    static_length = True
    capturable = True

    def lengths(self, proposal: Proposal, K: int) -> torch.Tensor:
        if proposal.lengths is not None:
            return proposal.lengths.long().clamp(0, K)
        return torch.full((proposal.tokens.shape[0],), K, dtype=torch.long, device=proposal.tokens.device)
