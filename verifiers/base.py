"""The verifier contract: map a round's proposal (and the load) to per-request verification lengths.

A verifier may only look at what is known before the host verifies (confidences, the number of requests, its own
history). Lengths must not depend on tokens they are deciding about beyond what a non-anticipating rule allows
(DSPARK.md §4.3); `tests/test_verifiers_lossless.py` checks every registered policy at T = 1.
"""
from __future__ import annotations

import torch

from drafters.base import Proposal


class Verifier:
    """Base class: `lengths` returns (B,) long in 0..K, clipped to `proposal.lengths` by the caller."""

    name: str = "verifier"
    #: False only for the deliberately biased global search kept for the losslessness demonstration
    lossless: bool = True
    #: True when every length is K (or the drafter's own lengths): the decode loop then sizes the verify
    #: forward as K + 1 without reading the lengths back from the device
    static_length: bool = False

    def begin(self, *, batch_size: int) -> None:
        """Reset per-batch state."""

    def lengths(self, proposal: Proposal, K: int) -> torch.Tensor:
        raise NotImplementedError

    def select(self, rows: torch.Tensor) -> None:
        """Keep only these batch rows of any per-request state."""
