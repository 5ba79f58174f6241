"""The files a measuring command writes: OUT_DIR/NAME.json (its envelope: experiment, command, environment, host,
settings; then the command's own keys), NAME.md rendered from that JSON, and the PNGs the markdown links.

`dspark experiment NAME`, `dspark bench`, `dspark sweep` and `dspark report` all write and read these; a result's
`render(doc, out_dir) -> Section` is the one function that turns its JSON into markdown and PNGs, so a report
rebuilt from the JSON alone shows what the run showed.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch


@dataclass
class Section:
    """What a result renders from its JSON: markdown (tables, notes) and the PNG files it wrote."""

    title: str
    markdown: str
    images: list[Path]


def envelope(name: str, *, argv, host, options: list, prog: str | None = None) -> dict:
    """The header of every result JSON: experiment, command (`prog` and argv; default `dspark experiment NAME`),
    environment, host and the options used (the dataclasses' fields merged)."""
    from dspark.config import to_dict
    from dspark.quickstart import environment

    settings = {}
    for opts in options:
        settings.update(to_dict(opts))
    return {"experiment": name, "command": f"{prog or f'dspark experiment {name}'} " + " ".join(argv or []),
            "environment": environment(torch.device(host.device)), "host": host.name, "settings": settings}


def write_result(doc: dict, out_dir: str | Path, render: Callable[[dict, Path], Section]) -> Path:
    """Write OUT_DIR/NAME.json, the PNGs and OUT_DIR/NAME.md (from `render`); returns the JSON path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{doc['experiment']}.json"
    path.write_text(json.dumps(doc, indent=1, allow_nan=True) + "\n")
    section = render(doc, out)
    (out / f"{doc['experiment']}.md").write_text(section_markdown(doc, section, out))
    return path


def section_markdown(doc: dict, section: Section, relative_to: Path, *, level: int = 1) -> str:
    """A section as markdown: its title, the command, machine and versions, its text, then its images (linked
    relative to `relative_to`)."""
    env = doc.get("environment", {})
    where = env.get("gpu") or env.get("processor", "")
    head = (f"{'#' * level} {section.title}\n\n`{doc.get('command', '')}` — {env.get('date', '')}, {where}, "
            f"torch {env.get('torch', '')}, host `{doc.get('host', '')}`\n\n")
    images = "".join(f"\n![{p.stem}]({p.relative_to(relative_to) if p.is_relative_to(relative_to) else p})\n"
                     for p in section.images)
    return head + section.markdown + "\n" + images


def fmt_list(values: list[float]) -> str:
    """A short text form of a per-position list."""
    return " ".join("nan" if isinstance(v, float) and math.isnan(v) else f"{v:.2f}" for v in values)


def figure(width: float = 6.0, height: float = 4.0, ncols: int = 1, nrows: int = 1):
    """A matplotlib Figure without pyplot (Agg, leaves the process-wide backend alone) and its axes array."""
    from matplotlib.figure import Figure  # why here: matplotlib is slow to import and only the PNGs need it

    fig = Figure(figsize=(width, height), layout="constrained")
    return fig, fig.subplots(nrows, ncols, squeeze=False)


def plot_log_x(ax, values: list[int]) -> None:
    """A log-2 x axis labelled with the measured values (concurrency)."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(values, [str(v) for v in values])
