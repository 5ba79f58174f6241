"""Sequential Temperature Scaling and the calibration metrics on synthetic rollout logs."""
from __future__ import annotations

import json

import pytest
import torch

from dspark.engine.protocol import Proposal
from verifiers.calibration import (STSCalibrator, auroc, brier, calibrated_confidence, calibration_report, ece,
                                   labels, outcomes_from_counts, reliability_diagram)

K = 5
OVERCONFIDENCE = 2.5


def synthetic_log(N: int = 4000, seed: int = 0):
    """Raw c = σ(2.5·z) while the true conditional acceptance is σ(z); verify-all, stop at the first rejection."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(N, K, generator=g) * 1.5 + 1.5  # (N, K) true logits
    p = torch.sigmoid(z)
    c = torch.sigmoid(OVERCONFIDENCE * z)  # (N, K) over-confident raw confidences
    accepted = torch.rand(N, K, generator=g) < p  # (N, K)
    survived = accepted.long().cumprod(1).bool()
    reached = torch.cat([torch.ones(N, 1, dtype=torch.bool), survived[:, :-1]], 1)  # (N, K)
    return c, accepted & reached, reached


def test_sts_reduces_ece_on_overconfident_data():
    c, accepted, reached = synthetic_log()
    held_c, held_acc, held_reached = synthetic_log(seed=1)
    cal = STSCalibrator.fit(c, accepted, reached)
    assert cal.positions == K and len(cal.fit_size) == K and cal.fit_size[0] == 4000
    assert cal.temperatures[0] == pytest.approx(OVERCONFIDENCE, rel=0.2)
    report = calibration_report(held_c, held_acc, held_reached, calibrator=cal)
    for view in ("survival", "conditional"):
        before = torch.tensor(report["before"][view]["ece"]).mean()
        after = torch.tensor(report["after"][view]["ece"]).mean()
        assert after < 0.4 * before, (view, before, after)
    assert max(report["after"]["survival"]["ece"]) < 0.03
    # order-preserving: AUROC of conditional confidences per position is unchanged
    assert report["after"]["conditional"]["auroc"] == pytest.approx(report["before"]["conditional"]["auroc"])
    assert calibration_report(c, accepted, reached)["after"] is None


def test_apply_is_order_preserving_and_shape_preserving():
    cal = STSCalibrator(temperatures=[0.5, 1.0, 2.0, 3.0, 10.0])
    c = torch.linspace(0, 1, 101).unsqueeze(1).expand(101, K).contiguous()  # (101, K) sorted per column
    out = cal.apply(c)
    assert out.shape == c.shape and out.dtype == c.dtype
    assert bool((out[1:] > out[:-1]).all())  # strictly increasing, including the endpoints 0 and 1
    assert out[0].tolist() == [0.0] * K and out[-1].tolist() == [1.0] * K
    assert torch.allclose(out[:, 1], c[:, 1])  # t = 1 is the identity
    assert cal.apply(c.double().unsqueeze(0)).shape == (1, 101, K)  # leading dims are free


def test_save_load_and_position_errors(tmp_path):
    cal = STSCalibrator(temperatures=[1.2, 1.5, 2.0], fit_size=[10, 8, 5])
    path = tmp_path / "sts.json"
    cal.save(path)
    assert STSCalibrator.load(path, expect_positions=3) == cal
    with pytest.raises(ValueError, match=r"fitted for 3 draft positions, but 7 are in use: it has no "
                                         r"temperatures for positions 4\.\.7.*--draft-length 7"):
        STSCalibrator.load(path, expect_positions=7)
    with pytest.raises(ValueError, match=r"fitted for 3 draft positions, but 5 are in use"):
        cal.apply(torch.rand(2, 5))


def test_a_fit_at_one_draft_length_serves_every_shorter_one(tmp_path):
    """STS fits position by position, so the first g temperatures of a fit at K are the fit at g, and loading
    or applying it at any g <= K works (a sweep's draft lengths 1, 3, 5 with a calibration fitted at 7)."""
    c, accepted, reached = synthetic_log(N=1500)
    full = STSCalibrator.fit(c, accepted, reached)
    path = tmp_path / "sts.json"
    full.save(path)
    for g in range(1, K + 1):
        short = STSCalibrator.fit(c[:, :g], accepted[:, :g], reached[:, :g])
        assert full.temperatures[:g] == short.temperatures
        assert torch.equal(full.apply(c[:, :g]), short.apply(c[:, :g]))
        assert STSCalibrator.load(path, expect_positions=g) == full
        p = Proposal(tokens=torch.zeros(len(c), g, dtype=torch.long), confidence=c[:, :g])
        assert torch.equal(calibrated_confidence(p, g, full), short.apply(c[:, :g].float()))
    with pytest.raises(ValueError, match="> 0"):
        STSCalibrator(temperatures=[1.0, -1.0])


def test_auroc_ece_brier():
    g = torch.Generator().manual_seed(0)
    y = torch.rand(20000, generator=g) < 0.4
    assert auroc(y.double(), y) == 1.0
    assert auroc(1.0 - y.double(), y) == 0.0
    assert auroc(torch.rand(20000, generator=g), y) == pytest.approx(0.5, abs=0.02)
    assert auroc(torch.full((10,), 0.3), torch.arange(10) < 5) == 0.5  # all tied
    assert auroc(torch.tensor([0.1, 0.4, 0.35, 0.8]), torch.tensor([0, 0, 1, 1])) == 0.75
    assert torch.isnan(torch.tensor(auroc(torch.rand(5), torch.ones(5))))
    assert ece(torch.ones(10), torch.zeros(10)) == 1.0
    assert ece(torch.full((10,), 0.8), torch.arange(10) < 8) == pytest.approx(0.0, abs=1e-6)
    # two bins: conf 0.2 with rate 0.5, conf 0.9 with rate 0.5 -> (0.3 + 0.4) / 2
    assert ece(torch.tensor([0.2, 0.2, 0.9, 0.9]), torch.tensor([0, 1, 0, 1])) == pytest.approx(0.35)
    assert brier(torch.tensor([1.0, 0.0, 0.5]), torch.tensor([1, 1, 0])) == pytest.approx(1.25 / 3)


def test_labels_from_counts():
    # round 0: ell = 3, 1 accepted (rejected at 2); round 1: ell = 2, 2 accepted (3 not verified);
    # round 2: ell = 0
    accepted, reached = outcomes_from_counts(torch.tensor([3, 2, 0]), torch.tensor([1, 2, 0]), 4)
    assert reached.tolist() == [[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0]]
    assert accepted.tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0]]
    lab = labels(accepted, reached)
    assert lab.survived.tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0]]
    # survival after a rejection is known (0); past an unverified position it is not
    assert lab.known.tolist() == [[1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0]]


def test_calibrated_confidence():
    p = Proposal(tokens=torch.zeros(2, 3, dtype=torch.long))
    assert calibrated_confidence(p, 3).tolist() == [[1.0] * 3] * 2
    p.confidence = torch.full((2, 3), 0.9)
    cal = STSCalibrator(temperatures=[2.0] * 3)
    assert calibrated_confidence(p, 3).tolist() == p.confidence.tolist()
    assert bool((calibrated_confidence(p, 3, cal) < 0.9).all())


def test_reliability_diagram_png(tmp_path):
    c, accepted, reached = synthetic_log(N=500)
    cal = STSCalibrator.fit(c, accepted, reached)
    path = tmp_path / "reliability.png"
    reliability_diagram(path, c, accepted, reached, calibrator=cal)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def test_cli_fits_on_some_prompts_and_reports_on_the_others(tmp_path, capsys):
    """`dspark calibrate` on a saved random DSpark: STS JSON beside the drafter, a held-out report and its PNG."""
    from test_regenerate import chat_host, write_conversations

    from drafters import build_drafter
    from dspark.cli import main

    host = chat_host()
    host.model.save_pretrained(tmp_path / "host")
    host.tokenizer.save_pretrained(tmp_path / "host")
    with pytest.warns(UserWarning, match="random weights"):  # a random drafter is what this test calibrates
        build_drafter("dspark", host, block_size=4, num_layers=1).save_pretrained(tmp_path / "drafter")
    data = write_conversations(tmp_path / "chats.jsonl", 10)
    argv = ["calibrate", "--host", str(tmp_path / "host"), "--device", "cpu", "--drafter-path", str(tmp_path / "drafter"),
            "--data", data, "--split", "all", "--offset", "2", "--limit", "8", "--draft-length", "4", "--max-new-tokens", "12"]
    with pytest.warns(UserWarning, match="which `dspark eval` also scores"):  # --split all: on purpose here
        assert main(argv) == 0
    report = json.loads((tmp_path / "drafter" / "calibration_report.json").read_text())
    assert (report["fit_requests"], report["report_requests"]) == (4, 4)
    assert report["fit_rounds"] > 0 and report["report_rounds"] > 0 and report["positions"] == 4
    assert (tmp_path / "drafter" / "calibration_report.png").stat().st_size > 0
    assert len(STSCalibrator.load(tmp_path / "drafter" / "calibration.json").temperatures) == 4
    assert main(argv + ["--holdout", "1"]) == 1
    assert "--holdout must be in [0, 1), got 1.0" in capsys.readouterr().err
