"""What a trainable drafter's training step receives and returns (the training loop's side of the contract).

Shapes: B sequences, K draft positions, V vocabulary, T tokens, F = m*H concatenated host features.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TrainBatch:
    """One training step's inputs, host outputs computed online (no feature cache). T tokens, B sequences.

    host_logits[b, t] is the host's next-token distribution after input_ids[b, :t+1] (it targets token t+1);
    loss_mask[b, t] = 1 where token t is an assistant (response) token, the only tokens drafted/anchored on.
    """

    input_ids: torch.Tensor  # (B, T) long
    loss_mask: torch.Tensor  # (B, T) long/bool
    document_ids: torch.Tensor  # (B, T) long: packed documents never see each other
    features: torch.Tensor | None  # (B, T, F) host taps of the drafter's feature_layers, or None
    host_logits: torch.Tensor  # (B, T, V) float: the host's dtype (fused loss) or float32 (reference loss)
    generator: torch.Generator | None = None  # for anchor sampling, so resumed runs repeat exactly
    # (B,) long: keys each row's anchor noise (counter-based, dspark.engine.sampling) so that a row samples the same
    # anchors whatever batch, process or padding it is in (N processes x B rows = 1 process x N*B rows); wins over
    # generator
    anchor_seeds: torch.Tensor | None = None


@dataclass
class TrainOutput:
    loss: torch.Tensor  # scalar, differentiable
    metrics: dict  # str -> float: loss parts (ce, tv, conf, ...), for logging
    acceptance: torch.Tensor  # (K,) teacher-forced conditional acceptance estimate per position, in [0, 1]
    # the loss's normaliser: loss = (sum of the weighted terms) / weight. The training loop weighs processes by it, so
    # N processes train and log the one-process loss of the same global batch; None: every process weighs the same
    weight: float | None = None
