"""Versioned JSON files: written atomically, read back with their format and version checked."""
from __future__ import annotations

import json
import os
from pathlib import Path


def write_json_atomic(path: str | Path, doc: dict) -> None:
    """Write `doc` as JSON through a temporary sibling and a rename: a kill mid-write leaves the old file (or none),
    never a truncated one that a later load would trip over."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(staging, "w", encoding="utf-8") as fh:
            fh.write(json.dumps(doc, indent=1) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(staging, path)
    finally:
        staging.unlink(missing_ok=True)


def read_versioned_json(path: str | Path, fmt: str, version: int, *, what: str) -> dict:
    """The JSON object in `path`, checked to be a `fmt` file of `version`; every failure names the file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{what} file {path} does not exist")
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{what} file {path} is corrupt (not valid JSON: {err})") from None
    if not isinstance(d, dict) or d.get("format") != fmt or d.get("version") != version:
        got = (d.get("format"), d.get("version")) if isinstance(d, dict) else (type(d).__name__, None)
        raise ValueError(f"{path} is not a {fmt} version {version} file (format={got[0]!r}, version={got[1]!r})")
    return d
