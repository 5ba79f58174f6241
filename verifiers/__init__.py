"""Verification policies by name: how many drafts of each request the host verifies per round.

`VERIFIERS` maps the CLI / config name to the class; `build_verifier` constructs one from plain options.
"""
from __future__ import annotations

from pathlib import Path

import torch

from dspark.engine.protocol import Verifier, VerifyAll
from verifiers.calibration import STSCalibrator
from verifiers.cost_model import CostModel
from verifiers.prefix_scheduler import GlobalSearchScheduler, LaggedCapacityScheduler, PrefixScheduler
from verifiers.threshold import ThresholdVerifier

VERIFIERS: dict[str, type[Verifier]] = {
    "full": VerifyAll,
    "threshold": ThresholdVerifier,
    "scheduler": PrefixScheduler,
    "lagged": LaggedCapacityScheduler,
    "global-unsafe": GlobalSearchScheduler,
}
_COSTED = ("scheduler", "lagged", "global-unsafe")


def policy_options(name: str, *, threshold: float | None = None, cost_table=None) -> dict:
    """The part of a sweep's shared settings that policy `name` takes, as build_verifier keywords: the threshold
    only for "threshold", the cost table only for the schedulers (build_verifier rejects the rest, so a sweep over
    several policies passes each one its own)."""
    return {"threshold": threshold if name == "threshold" else None,
            "cost_table": cost_table if name in _COSTED else None}


def build_verifier(name: str, *, threshold: float | None = None, threshold_mode: str = "cumulative",
                   cost_table: CostModel | str | Path | None = None,
                   calibration: STSCalibrator | str | Path | None = None,
                   expect_host: str | None = None, expect_device: torch.device | str | None = None,
                   positions: int | None = None, draft_gate: bool = True) -> Verifier:
    """The verifier `name` of VERIFIERS.

    threshold (+ threshold_mode): only for "threshold", required there. cost_table: a CostModel or a JSON path,
    required by the schedulers; a path is checked against expect_host / expect_device. calibration: an
    STSCalibrator or a JSON path, applied to confidences by every policy that reads them; it must cover
    `positions` = K (a fit at K' >= K serves K through its first K temperatures). Options a policy does not use
    are errors, so a misconfigured run fails instead of ignoring them. draft_gate: the schedulers skip the draft
    forward while speculation does not pay (prefix_scheduler.DraftGate); False drafts every round.
    """
    if name not in VERIFIERS:
        raise ValueError(f"unknown verifier {name!r}; choose one of {sorted(VERIFIERS)}")
    if threshold is not None and name != "threshold":
        raise ValueError(f"threshold applies only to the 'threshold' verifier, not {name!r}")
    if cost_table is not None and name not in _COSTED:
        raise ValueError(f"a cost table applies only to {list(_COSTED)}, not {name!r}")
    if not draft_gate and name not in _COSTED:
        raise ValueError(f"draft_gate=False applies only to {list(_COSTED)}, not {name!r} (which always drafts)")
    if calibration is not None and name == "full":
        raise ValueError("calibration has no effect on the 'full' verifier, which ignores confidences")
    if isinstance(calibration, (str, Path)):
        calibration = STSCalibrator.load(calibration, expect_positions=positions)
    elif calibration is not None and positions is not None:
        calibration.check_positions(positions)  # fail before decoding, not in its first round
    if name == "full":
        return VerifyAll()
    if name == "threshold":
        if threshold is None:
            raise ValueError("the 'threshold' verifier needs threshold= (a confidence in [0, 1])")
        return ThresholdVerifier(threshold, threshold_mode, calibrator=calibration)
    if cost_table is None:
        raise ValueError(f"the {name!r} verifier needs cost_table= (a CostModel or the JSON written by "
                         f"verifiers.cost_model.profile(...).save(path)); profile the host first")
    if isinstance(cost_table, (str, Path)):
        cost_table = CostModel.load(cost_table, expect_host=expect_host, expect_device=expect_device)
    return VERIFIERS[name](cost_table, calibrator=calibration, gate=draft_gate)
