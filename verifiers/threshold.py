"""Static confidence threshold (docs/DSPARK.md §4.1): the diagnostic baseline of confidence-scheduled verification.

Shapes: B requests, K draft positions. c_k confidence, a_k = Π_{i<=k} c_i survival, tau the threshold.
"""
from __future__ import annotations

import torch

from dspark.engine.protocol import Proposal, Verifier
from verifiers.calibration import STSCalibrator, calibrated_confidence

MODES = ("cumulative", "position")


class ThresholdVerifier(Verifier):
    """Verify the prefix before the first position whose score falls below tau.

    mode "cumulative" scores position k by a_k, "position" by c_k; ell = the number of leading positions with
    score >= tau (tau = 0 verifies all). Without confidences every score is 1, so everything is verified.
    Lossless: whether x_k is verified depends on c_1..c_k, which depend only on x_<k.
    """

    name = "threshold"

    def __init__(self, threshold: float, mode: str = "cumulative", *,
                 calibrator: STSCalibrator | None = None) -> None:
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"threshold must be in [0, 1], got {threshold}")
        if mode not in MODES:
            raise ValueError(f"threshold mode must be one of {MODES}, got {mode!r}")
        self.tau, self.mode, self.calibrator = float(threshold), mode, calibrator
        self.capturable = calibrator is None  # a calibrator's lookup is not vetted for capture

    def lengths(self, proposal: Proposal, K: int) -> torch.Tensor:
        c = calibrated_confidence(proposal, K, self.calibrator)  # (B, K)
        score = c.cumprod(1) if self.mode == "cumulative" else c  # (B, K)
        return (score >= self.tau).long().cumprod(1).sum(1)  # (B,) leading run of passing positions
