"""experiments/runs/qwen_coder_h200.py (issue 24): the GPU run's driver, checked on the CPU.

The slow test runs the whole pipeline under DRY_RUN (two small random Qwen2 hosts with the real Qwen2.5 tokenizer)
and checks results.json's `tau` map; the fast ones check how `collect` merges an earlier session's results and that
a `background` driver holds later phases back until it ends.
"""
from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import load_script

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "experiments" / "runs" / "qwen_coder_h200.py"
KEYS = sorted(f"{d}/{s}/T{t}" for d in ("dspark", "dflash", "eagle3", "ngram", "small-lm")
              for s in ("sharegpt", "humaneval") for t in (0, 1))


def _qwen_tokenizer_cached() -> bool:
    from dspark.engine.models import packaged_cache

    return any((packaged_cache(n) / "tokenizer.json").exists() for n in ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"))


def _driver(tmp_path, monkeypatch, **env):
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))  # the module extends it: undo afterwards
    for name in ("ONLY", "DRY_RUN", "STEPS", "TRAIN_WAIT_S", "REGEN_FROM", "BASELINES", "DRAFTER_DTYPE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RUN", str(tmp_path / "run"))
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    module = load_script("experiments/runs/qwen_coder_h200.py")
    module.RUN.mkdir(parents=True)
    return module


def _summary(tau: float, sums: list[int], rounds: list[int]) -> dict:
    return {"tau": tau, "tau_ci95": [tau - 0.1, tau + 0.1],
            "conditional_acceptance": [0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3], "per_request_tau_sum": sums,
            "per_request_rounds": rounds, "accepted_per_round": tau - 1, "verify_rate": 0.5, "tokens_per_s": 100.0}


def test_collect_merges_an_earlier_session(tmp_path, monkeypatch):
    recorded = tmp_path / "recorded" / "results.json"
    recorded.parent.mkdir()
    # an earlier session measured EAGLE-3 (and trained it); this one measures DSpark on the same prompts
    recorded.write_text(json.dumps({"eval": {"eagle3_sharegpt_T0": _summary(2.0, [8, 6, 4], [4, 3, 2])},
                                    "train": {"eagle3": {"steps": 1000}}, "sessions": [{"date": "earlier"}],
                                    "speed": {"eagle3": {"1": {"tokens_per_s": 90.0, "ratio": 0.9}}}}))
    with gzip.open(recorded.parent / "metrics_eagle3.jsonl.gz", "wt") as fh:  # recorded curves are committed gzipped
        fh.write(json.dumps({"kind": "train", "step": 1, "loss": 2.0}) + "\n")
    module = _driver(tmp_path, monkeypatch, RECORDED=str(recorded), ONLY="dspark")
    (module.RUN / "eval").mkdir()
    (module.RUN / "eval" / "dspark_sharegpt_T0.json").write_text(json.dumps(_summary(3.0, [9, 9, 6], [3, 3, 2])))
    (module.RUN / "eval" / "ngram_humaneval_T1.json").write_text(json.dumps(_summary(1.5, [3, 3], [2, 2])))
    (module.RUN / "draft_cost").mkdir()  # `dspark profile --drafter-path ...`'s table: DSpark's step 4 ms at 1 row
    (module.RUN / "draft_cost" / "dspark.json").write_text(json.dumps(
        {"draft": {"dspark/K7/123": {"batch_sizes": [1, 16], "seconds": [0.004, 0.006]}}}))
    (module.RUN / "speed" / "dspark").mkdir(parents=True)  # `dspark bench`: plain and DSpark rows of one run
    (module.RUN / "speed" / "dspark" / "bench.json").write_text(json.dumps({"rows": [
        {"method": "plain", "concurrency": 1, "tokens_per_s": 100.0, "tau": 1.0, "mean_in_flight": 1.0},
        {"method": "dspark", "concurrency": 1, "tokens_per_s": 150.0, "tau": 2.5, "mean_in_flight": 1.0}]}))
    module.collect()
    report = json.loads((module.OUT / "results.json").read_text())
    assert report["speed"]["eagle3"] == {"1": {"tokens_per_s": 90.0, "ratio": 0.9}}  # the earlier session's
    assert report["speed"]["dspark"]["1"]["ratio"] == pytest.approx(1.5)
    markdown = (module.OUT / "results.md").read_text()
    assert "| dspark | 1 | 150.0 | 100.0 | 1.50 | 2.50 |" in markdown
    assert "| dspark | 4.00 | 6.00 | 0.500 | — | — | — |" in markdown  # (3.0 - 1) / 4 ms on sharegpt/T0
    assert report["tau"] == {"eagle3/sharegpt/T0": 2.0, "dspark/sharegpt/T0": 3.0, "ngram/humaneval/T1": 1.5}
    assert report["draft_ms"] == {"dspark": {"1": pytest.approx(4.0), "16": pytest.approx(6.0)}}
    assert report["accepted_per_draft_ms"] == {"dspark/sharegpt/T0": pytest.approx((3.0 - 1) / 4.0)}
    assert report["per_position"]["dspark/sharegpt/T0"] == [0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3]
    assert report["paired"]["sharegpt_T0: dspark / eagle3"]["ratio"] == pytest.approx(3.0 / 2.0)
    assert report["train"] == {"eagle3": {"steps": 1000}}  # nothing trained here: the earlier summary stays
    assert [s.get("date") for s in report["sessions"]][0] == "earlier" and len(report["sessions"]) == 2
    assert sorted(report["missing"]) == sorted(set(KEYS) - set(report["tau"]))
    assert "| dspark | 3.000 (2.900–3.100) | — | — | — |" in (module.OUT / "results.md").read_text()
    assert (module.OUT / "training_curves.png").exists()  # from the recorded metrics_eagle3.jsonl.gz


def test_render_pairs_each_trained_drafter_once_and_adds_no_session(tmp_path, monkeypatch):
    recorded = tmp_path / "results.json"
    evals = {"dspark_sharegpt_T0": _summary(3.0, [9, 9, 6], [3, 3, 2]),
             "dflash_sharegpt_T0": _summary(2.0, [6, 6, 4], [3, 3, 2]),
             "ngram_sharegpt_T0": _summary(1.5, [3, 6, 3], [2, 3, 2])}
    recorded.write_text(json.dumps({"eval": evals, "train": {"dspark": {"steps": 2}}, "sessions": [{"date": "one"}],
                                    "settings": {"steps": 2}, "draft_ms": {}, "speed": {}}))
    module = _driver(tmp_path, monkeypatch, RECORDED=str(recorded))
    module.render()
    report = json.loads(recorded.read_text())
    assert sorted(report["paired"]) == ["sharegpt_T0: dflash / ngram", "sharegpt_T0: dspark / dflash",
                                        "sharegpt_T0: dspark / ngram"]  # not dflash / dspark as well
    assert report["paired"]["sharegpt_T0: dflash / ngram"]["ratio"] == pytest.approx((16 / 8) / (12 / 7))  # sum of tau over rounds
    assert report["sessions"] == [{"date": "one"}] and report["settings"] == {"steps": 2}
    assert "| sharegpt_T0: dflash / ngram | 1.167 |" in (tmp_path / "results.md").read_text()


def test_merge_adds_a_retrains_speed_and_session_and_keeps_the_recorded_training(tmp_path, monkeypatch):
    """`merge`: a session that retrained a recorded drafter only to time it brings back bench.json files; the
    recorded training, evaluations and other speeds stay, its rows and one sessions entry are added."""
    recorded = tmp_path / "results.json"
    evals = {"dspark_sharegpt_T0": _summary(3.0, [9, 9, 6], [3, 3, 2])}
    recorded.write_text(json.dumps({"eval": evals, "train": {"dspark": {"steps": 2000}}, "sessions": [{"date": "one"}],
                                    "settings": {"steps": 2000}, "draft_ms": {"dspark": {"1": 2.0}},
                                    "speed": {"eagle3": {"1": {"tokens_per_s": 90.0, "ratio": 0.9}}}}))
    module = _driver(tmp_path, monkeypatch, RECORDED=str(recorded), ONLY="dspark")
    (module.RUN / "speed" / "dspark@humaneval").mkdir(parents=True)
    (module.RUN / "speed" / "dspark@humaneval" / "bench.json").write_text(json.dumps({"rows": [
        {"method": "plain", "concurrency": 8, "tokens_per_s": 200.0, "tau": 1.0, "mean_in_flight": 6.0},
        {"method": "dspark", "concurrency": 8, "tokens_per_s": 150.0, "tau": 1.7, "mean_in_flight": 5.8}]}))
    (module.RUN / "draft_cost").mkdir()  # a bf16 pass's draft cost (DRAFTER_DTYPE=host): keyed dspark~host
    (module.RUN / "draft_cost" / "dspark~host.json").write_text(json.dumps(
        {"draft": {"dspark/K7/123": {"batch_sizes": [1, 16], "seconds": [0.001, 0.002]}}}))
    (module.RUN / "session.json").write_text(json.dumps({"date": "two", "gpu": "H100"}))
    module.merge()
    report = json.loads(recorded.read_text())
    assert report["speed"]["eagle3"] == {"1": {"tokens_per_s": 90.0, "ratio": 0.9}}
    assert report["speed"]["dspark@humaneval"]["8"]["ratio"] == pytest.approx(0.75)
    assert report["train"] == {"dspark": {"steps": 2000}} and report["tau"] == {"dspark/sharegpt/T0": 3.0}
    assert report["sessions"] == [{"date": "one"}, {"date": "two", "gpu": "H100"}]
    assert report["draft_ms"] == {"dspark": {"1": 2.0},
                                  "dspark~host": {"1": pytest.approx(1.0), "16": pytest.approx(2.0)}}
    assert "speed/dspark@humaneval" in report["notes"]  # the retrain's caveat travels with its rows
    assert "| dspark@humaneval | 8 | 150.0 | 200.0 | 0.75 | 1.70 |" in (tmp_path / "results.md").read_text()
    module.merge()  # again, on the same files: nothing added twice
    assert json.loads(recorded.read_text()) == report


def test_host_dtype_rows_stand_beside_the_float32_ones(tmp_path, monkeypatch):
    """DRAFTER_DTYPE=host: trained drafters decode in bf16 (`--drafter-dtype host`) and their draft cost and speed
    are keyed NAME~host, each priced against the drafter's own tau; the default keeps float32 under NAME."""
    module = _driver(tmp_path, monkeypatch, DRAFTER_DTYPE="host", ONLY="dspark")
    assert module._timed_as("dspark") == "dspark~host"
    assert module._trained("dspark")[-2:] == ("--drafter-dtype", "host")
    report = module.results({"dspark_sharegpt_T0": _summary(3.0, [9, 9, 6], [3, 3, 2])}, {}, [],
                            {"dspark": {"1": 4.0}, "dspark~host": {"1": 2.0}})
    assert report["accepted_per_draft_ms"] == {"dspark/sharegpt/T0": pytest.approx(0.5),
                                               "dspark~host/sharegpt/T0": pytest.approx(1.0)}
    plain = _driver(tmp_path / "default", monkeypatch)
    assert plain._timed_as("dspark") == "dspark" and "float32" in plain._trained("dspark")


def test_later_phases_wait_for_a_background_driver(tmp_path, monkeypatch):
    module = _driver(tmp_path, monkeypatch, WAIT_S="60")
    monkeypatch.setattr(module.base, "POLL_S", 0.2)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(2)"])
    (module.RUN / "background.pid").write_text(f"{sleeper.pid}\n")
    start = time.time()
    waiter = __import__("threading").Thread(target=sleeper.wait)  # reap it, as its parent would
    waiter.start()
    assert module.wait_for_background()
    assert time.time() - start > 1.0 and sleeper.poll() is not None
    monkeypatch.setenv("WAIT_S", "0.5")
    stuck = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        (module.RUN / "background.pid").write_text(f"{stuck.pid}\n")
        assert not module.wait_for_background()  # still running: the caller stops instead of racing it
    finally:
        stuck.kill()
        stuck.wait()


def test_unknown_phase_is_refused(tmp_path, monkeypatch):
    module = _driver(tmp_path, monkeypatch)
    with pytest.raises(SystemExit, match="unknown phase"):
        module.main(["prepare", "trian"])


@pytest.mark.slow
@pytest.mark.skipif(not _qwen_tokenizer_cached(), reason="needs the Qwen2.5 tokenizer from a converted Qwen host cache")
def test_dry_run_pipeline_writes_every_tau_key(tmp_path):
    env = dict(os.environ, DRY_RUN="1", RUN=str(tmp_path / "run"), OUT=str(tmp_path / "out"), HF_HUB_OFFLINE="1")
    for name in ("ONLY", "STEPS", "TRAIN_WAIT_S", "REGEN_FROM", "BASELINES", "RECORDED"):
        env.pop(name, None)
    phases = ["prepare", "regenerate", "train", "baselines", "evaluate", "speed", "collect"]
    done = subprocess.run([sys.executable, str(SCRIPT), *phases], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=1500)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "results.json").read_text())
    assert sorted(report["tau"]) == KEYS and report["missing"] == []
    assert all(tau >= 1.0 for tau in report["tau"].values())
    assert all(len(report["per_position"][key]) == 7 for key in KEYS)
    assert {"sharegpt_T0: dspark / eagle3", "humaneval_T1: dspark / small-lm"} <= set(report["paired"])
    assert set(report["draft_ms"]) == {"dspark", "dflash", "eagle3", "ngram", "small-lm"}
    names = {"dspark", "dflash", "eagle3", "ngram", "small-lm"}  # each against plain, on MT-Bench and HumanEval
    assert set(report["speed"]) == names | {f"{n}@humaneval" for n in names}
    assert all(sorted(by_c) == ["1", "2"] and all(row["ratio"] > 0 for row in by_c.values())
               for by_c in report["speed"].values())
    out = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert len(out) <= 8 and "sharegpt_qwen_coder_regen.jsonl.gz" in out and "results.md" in out
    # a second call finds everything done: no phase redoes work
    again = subprocess.run([sys.executable, str(SCRIPT), *phases], env=env, cwd=ROOT, capture_output=True, text=True,
                           timeout=600)
    assert again.returncode == 0 and "dspark eval" not in again.stdout and "regenerate --host" not in again.stdout
    assert "dspark bench" not in again.stdout
