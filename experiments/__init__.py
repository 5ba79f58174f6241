"""Experiment runners, one module per question; `dspark experiment NAME ...` runs `experiments.NAME.main`.

The package never imports this one: `dspark experiment` and `dspark report` reach it through the `dspark.commands`
entry points that pyproject.toml registers (an installed checkout); without an install (e.g. a copied tree on a GPU
machine), `python -m experiments NAME ...` and `python -m experiments report DIR` do the same. experiments/README.md
lists each runner, its command and what it writes.
"""
from __future__ import annotations

import importlib

#: experiment name -> module under experiments/ with main(argv) -> int
EXPERIMENTS = {
    "concurrency": "experiments.concurrency",
    "savings": "experiments.savings",
    "threshold": "experiments.threshold",
    "length": "experiments.length",
    "acceptance": "experiments.acceptance",
    "simulate": "experiments.simulator",
    "simulator_validation": "experiments.validate",
}


def main(argv: list[str]) -> int:
    """`NAME [flags]`: run one experiment (NAME from EXPERIMENTS)."""
    if not argv or argv[0] in ("-h", "--help"):
        print("dspark experiment NAME [flags]; NAME is one of " + ", ".join(EXPERIMENTS)
              + " (see experiments/README.md); `dspark experiment NAME --help` lists its flags")
        return 0 if argv else 2
    if argv[0] not in EXPERIMENTS:
        raise ValueError(f"unknown experiment {argv[0]!r}; choose one of {', '.join(EXPERIMENTS)}")
    return importlib.import_module(EXPERIMENTS[argv[0]]).main(argv[1:])
