"""Process-level basics: every public package imports on its own in a fresh interpreter (no import-order
dependence, no cycles), and the CPU allocator tuning is switchable."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("statement", [
    "import drafters",
    "from drafters import load_drafter",
    "from drafters.dspark import DSparkConfig",
    "import verifiers",
    "from dspark import generate, load_host",
    "import dspark.cli, dspark.training.train",
    "import dspark; dspark.api.checkpoint_dir, dspark.metrics.summarize",
])
def test_fresh_import(statement):
    done = subprocess.run([sys.executable, "-c", statement], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


def test_unknown_attribute_is_an_attribute_error():
    import dspark

    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        dspark.nope  # noqa: B018


def test_cpu_allocator_tuning_can_be_switched_off(monkeypatch):
    import platform

    import dspark

    monkeypatch.setenv("DSPARK_MALLOC_TUNING", "0")
    assert dspark.tune_cpu_allocator() is False
    monkeypatch.delenv("DSPARK_MALLOC_TUNING")
    if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
        assert dspark.tune_cpu_allocator() is True
