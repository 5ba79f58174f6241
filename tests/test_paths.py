"""Every repository path that the docs, the results and the recipes name exists: the README, docs/, benchmarks/ and
experiments/ (markdown, YAML, JSON and the scripts' docstrings) may not point at a file that was moved or removed."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOP = ("benchmarks", "experiments", "docs", "tests", "dspark", "drafters", "verifiers", "scripts", ".ci")
# a path into the tree: one of the top-level folders, then path characters; a placeholder (<name>, *, {}) is no path.
# Under the package folders only file names count (`dspark/K7/...` and `dspark/sharegpt/T0` are result keys).
MENTION = re.compile(r"(?<![\w./~-])((?:%s)/[\w./-]*[\w/])" % "|".join(re.escape(t) for t in TOP))
FILE = re.compile(r"\.(py|md|json|yaml|yml|png|sh|gz|jsonl|csv|txt|toml|log)$")
PACKAGES = ("dspark/", "drafters/", "verifiers/")
TEST = re.compile(r"(tests/[\w/]+\.py)::(\w+)")  # a named test: its file must define it
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")  # markdown links, relative to the file that holds them
SUFFIXES = {".md", ".yaml", ".yml", ".json", ".py", ".sh", ".toml"}


def tracked() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "README.md", "docs", "benchmarks", "experiments"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout.split()
    return [ROOT / p for p in out if Path(p).suffix in SUFFIXES and (ROOT / p).exists()]


def missing_paths(path: Path) -> list[str]:
    text = path.read_text(encoding="utf-8", errors="replace")
    bad = []
    for m in MENTION.finditer(text):
        name = m.group(1).rstrip(".")
        if name.startswith(PACKAGES) and not FILE.search(name):
            continue
        after = text[m.end():m.end() + 3].lstrip("-_.")
        if not (ROOT / name).exists() and not after[:1] in ("<", "*", "{", "$"):
            bad.append(name)
    for m in TEST.finditer(text):
        test_file = ROOT / m.group(1)
        if test_file.exists() and not re.search(rf"^\s*def {m.group(2)}\(", test_file.read_text(), flags=re.M):
            bad.append(f"{m.group(1)}::{m.group(2)}")
    if path.suffix == ".md":
        for m in LINK.finditer(text):
            target = m.group(1)
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (path.parent / target).exists():
                bad.append(target)
    return bad


def test_no_doc_result_or_recipe_names_a_path_that_is_not_there():
    files = tracked()
    assert any(f.name == "README.md" for f in files) and any(f.suffix == ".yaml" for f in files)
    problems = {str(f.relative_to(ROOT)): bad for f in files if (bad := missing_paths(f))}
    assert not problems, problems


def test_the_checker_sees_a_missing_path(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("see benchmarks/results/nowhere/README.md and [the table](absent.md), not docs/<name>.md nor "
                   "experiments/recipes/smollm2-$D.yaml or experiments/recipes/x-*.yaml; tests/test_paths.py::no_such_test\n")
    assert missing_paths(doc) == ["benchmarks/results/nowhere/README.md", "tests/test_paths.py::no_such_test",
                                  "absent.md"]
