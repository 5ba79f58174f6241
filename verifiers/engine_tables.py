"""The verifier's tables in the files SGLang's DSpark support reads (docs/DEEPSPEC.md), next to the engine-neutral
JSON of `cost_model.export_engine_json`.

SPS table (`--speculative-dspark-sps-table-path`), SGLang's `SpsCostTable` as JSON:
    sample_batch_tokens   [int]    tokens in one verify forward, strictly increasing (our cost table's B grid)
    sample_steps_per_sec  [float]  verify steps per second at each (our SPS)
    max_batch_tokens      int      the largest B the table covers (our last B)
  SGLang reads SPS between points as a step function (the value of the largest sample <= B); ours interpolates
  linearly, so the two agree at the profiled points only: profile a denser B grid when that matters.
STS calibration (`--speculative-dspark-confidence-sts-path`), SGLang's `DSparkStsCalibration` as JSON:
    temperatures          [float]  t_1..t_K, one per draft position, > 0: c_k' = sigmoid(logit(c_k) / t_k)
    dataset               str      what the temperatures were fitted on (informational)
    num_samples           int      rounds the fit saw at position 1 (informational)
"""
from __future__ import annotations

from pathlib import Path

from dspark.engine.jsonio import write_json_atomic
from verifiers.calibration import STSCalibrator
from verifiers.cost_model import CostModel


def sglang_sps_table(cost: CostModel) -> dict:
    """Our SPS(B) table as SGLang's DSpark `SpsCostTable`."""
    return {"sample_batch_tokens": [int(b) for b in cost.tokens],
            "sample_steps_per_sec": [float(s) for s in cost.sps],
            "max_batch_tokens": int(cost.tokens[-1])}


def sglang_sts_calibration(sts: STSCalibrator, *, dataset: str = "") -> dict:
    """Our STS temperatures as SGLang's DSpark `DSparkStsCalibration`."""
    return {"temperatures": [float(t) for t in sts.temperatures], "dataset": dataset,
            "num_samples": int(sts.fit_size[0]) if sts.fit_size else 0}


def export_sglang_sps(path: str | Path, cost: CostModel) -> None:
    """Write `cost` where SGLang's --speculative-dspark-sps-table-path reads it."""
    write_json_atomic(path, sglang_sps_table(cost))


def export_sglang_sts(path: str | Path, sts: STSCalibrator, *, dataset: str = "") -> None:
    """Write `sts` where SGLang's --speculative-dspark-confidence-sts-path reads it."""
    write_json_atomic(path, sglang_sts_calibration(sts, dataset=dataset))
