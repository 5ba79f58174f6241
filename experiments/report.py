"""One markdown page from a folder of experiment results, and optionally the same tables and plots in wandb.

    dspark report results/                      # writes results/report.md (+ the PNGs it links)
    dspark report results/ --report-to wandb    # also logs tables and images to a wandb run (offline by default)

Every `NAME.json` written by `dspark experiment NAME` in RESULTS_DIR (and its subfolders) becomes one section,
rendered by that runner's own `render` (the same tables and PNGs as its NAME.md). wandb runs in offline mode unless
WANDB_MODE says otherwise (nothing leaves the machine; `wandb sync` uploads later); each result's rows become a
wandb Table named after the experiment and every PNG an Image.
"""
from __future__ import annotations

import importlib
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from experiments import EXPERIMENTS
from dspark.documents import section_markdown


@dataclass
class ReportOptions:
    results_dir: str = field(metadata={"help": "folder holding NAME.json files from `dspark experiment NAME`"})
    out: str = field(default="", metadata={"help": "the markdown page (default RESULTS_DIR/report.md)"})
    report_to: Literal["none", "wandb"] = field(default="none", metadata={
        "help": "also log the tables and PNGs to wandb (offline unless WANDB_MODE is set)"})
    wandb_project: str = field(default="dspark", metadata={"help": "wandb project name"})


def find_results(folder: Path) -> list[tuple[Path, dict]]:
    """(path, document) of every experiment result JSON under `folder`, in a stable order."""
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder}: no such results folder")
    found = []
    for path in sorted(folder.rglob("*.json")):
        if path.stem not in EXPERIMENTS:
            continue
        try:
            doc = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise ValueError(f"{path}: not a result JSON ({error})") from None
        if isinstance(doc, dict) and doc.get("experiment") == path.stem:
            found.append((path, doc))
    if not found:
        raise ValueError(f"{folder} holds no experiment results (NAME.json from `dspark experiment NAME`, NAME one "
                         f"of {', '.join(EXPERIMENTS)})")
    return found


def build(folder: Path, out: Path) -> tuple[str, list]:
    """The page's markdown and [(path, doc, section)] for every result; PNGs are (re)written beside each JSON."""
    parts = [f"# dspark results: {folder}\n"]
    sections = []
    for path, doc in find_results(folder):
        render = importlib.import_module(EXPERIMENTS[doc["experiment"]]).render
        section = render(doc, path.parent)
        sections.append((path, doc, section))
        parts.append(section_markdown(doc, section, out.parent, level=2)
                     + f"\nSource: `{os.path.relpath(path, out.parent)}`\n")
    return "\n".join(parts), sections


def log_wandb(sections: list, *, project: str, folder: Path) -> str:
    """One wandb run holding a Table per result and every PNG; returns the run's local directory."""
    import wandb

    run = wandb.init(project=project, name=f"report-{folder.name}", dir=str(folder),
                     mode=os.environ.get("WANDB_MODE", "offline"), config={"results_dir": str(folder)})
    for path, doc, section in sections:
        rows = doc["rows"]
        if not rows:
            continue
        columns = [k for k in rows[0] if all(not isinstance(r.get(k), (list, dict)) for r in rows)]
        name = doc["experiment"]
        run.log({f"{name}/rows": wandb.Table(columns=columns, data=[[r.get(k) for k in columns] for r in rows]),
                 **{f"{name}/{png.stem}": wandb.Image(str(png)) for png in section.images}})
    local = run.dir
    run.finish()
    return local


def main(argv: list[str] | None = None) -> int:
    from dspark.config import parse

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and not argv[0].startswith("-"):
        argv = ["--results-dir", argv[0], *argv[1:]]  # `dspark report DIR`
    (opts,) = parse([ReportOptions], argv, prog="dspark report")
    folder = Path(opts.results_dir)
    out = Path(opts.out) if opts.out else folder / "report.md"
    page, sections = build(folder, out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page)
    print(f"wrote {out} ({len(sections)} result(s))")
    if opts.report_to == "wandb":
        print(f"logged to wandb (local run directory {log_wandb(sections, project=opts.wandb_project, folder=folder)})")
    return 0
