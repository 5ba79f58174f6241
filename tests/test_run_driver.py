"""experiments/runs/smollm2_h200.py `train` (issue 19, item 11): the trainings run one after another, and a training
that dies the same way twice stops the driver with the cause instead of being restarted in vain.

The driver's scheduling on the CPU: its training command is replaced by small Python processes that finish (write the
final metrics record and checkpoint, as `dspark train` does) or die the way the H200's DSpark process did.
"""
from __future__ import annotations

import json
import os
import sys

import pytest

from conftest import load_script

FINISH = """
import json, pathlib, sys, time
out, events, steps = pathlib.Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
with open(events, "a") as fh: fh.write(f"start {out.name} {time.time()}\\n")
time.sleep(0.6)
out.mkdir(parents=True, exist_ok=True)
(out / f"checkpoint-{steps:08d}").mkdir()
(out / "metrics.jsonl").write_text(json.dumps({"kind": "train", "step": steps}) + "\\n")
with open(events, "a") as fh: fh.write(f"end {out.name} {time.time()}\\n")
"""
OOM = """
import pathlib, sys
events = sys.argv[2]
with open(events, "a") as fh: fh.write("oom\\n")
n = len(pathlib.Path(events).read_text().split())
print("Traceback (most recent call last):")
print('  File "dspark/training/train.py", line 1, in train')
print(f"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate {n}.50 GiB. GPU 0 has a total capacity of "
      f"139.72 GiB of which 1.{n} GiB is free. Process {4000 + n} has 112.11 GiB memory in use.")
sys.exit(1)
"""


@pytest.fixture
def driver(tmp_path, monkeypatch):
    """The driver module with RUN in tmp_path, its fake trainings and a short poll."""
    monkeypatch.setenv("RUN", str(tmp_path / "run"))
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))  # the module extends it: undo afterwards
    for name in ("ONLY", "SIDE_BY_SIDE", "DRY_RUN", "STEPS", "TRAIN_WAIT_S"):
        monkeypatch.delenv(name, raising=False)
    module = load_script("experiments/runs/smollm2_h200.py")
    module.RUN.mkdir(parents=True)
    monkeypatch.setattr(module, "POLL_S", 0.2)
    events = tmp_path / "events.txt"
    events.touch()
    scripts = {}

    def command(name, args, memory_share):
        return [sys.executable, "-c", scripts.get(name, FINISH), str(module.RUN / name), str(events), str(module.STEPS)]

    monkeypatch.setattr(module, "_train_command", command)
    return module, scripts, events


def test_trainings_run_one_after_another(driver):
    module, _, events = driver
    module.train()
    assert all(module._finished(name) for name in module.DRAFTERS)
    log = [line.split() for line in events.read_text().splitlines()]
    assert [(kind, name) for kind, name, _ in log] == [(kind, name) for name in module.DRAFTERS
                                                       for kind in ("start", "end")]  # never two at once
    module.train()  # everything finished: nothing starts again
    assert len(events.read_text().splitlines()) == 2 * len(module.DRAFTERS)


def test_a_restart_that_dies_the_same_way_stops_with_the_cause(driver):
    module, scripts, events = driver
    scripts["dspark"] = OOM
    with pytest.raises(SystemExit) as stop:
        module.train()
    message = str(stop.value)
    assert "dspark" in message and "failed twice the same way" in message
    assert "torch.OutOfMemoryError: CUDA out of memory" in message and "112.11 GiB memory in use" in message
    assert events.read_text().split() == ["oom", "oom"]  # the first attempt and one restart, no more
    assert not (module.RUN / "dflash").exists()  # the next in turn never started next to it
    recorded = json.loads((module.RUN / "train_failures.json").read_text())["dspark"]
    assert len(recorded) == 2 and module.same_failure(*recorded) and recorded[0] != recorded[1]


def test_failure_causes(driver):
    module = driver[0]
    assert module.failure_cause("step 3\nTraceback (most recent call last):\n  File x\nValueError: bad row\n") == \
        "ValueError: bad row"
    assert "no Python error" in module.failure_cause("train dspark: 10%|#  | 2/20\n")
    assert not module.same_failure("torch.OutOfMemoryError: CUDA out of memory", "ValueError: bad row")


def test_side_by_side_caps_each_process_memory(tmp_path, monkeypatch):
    monkeypatch.setenv("RUN", str(tmp_path / "run"))
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    module = load_script("experiments/runs/smollm2_h200.py", "smollm2_h200_share")
    cmd = module._train_command("eagle3", ["ttt_length=7"], 0.317)
    assert "torch.cuda.set_per_process_memory_fraction(0.317)" in cmd[2]
    assert cmd[-2:] == ["--drafter-args", "ttt_length=7"]
    assert module._train_command("eagle3", [], None)[1:3] == ["-m", "dspark.training.train"]
