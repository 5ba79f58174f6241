"""JSON as every writer of the toolkit writes it: strict (an undefined number is null, never NaN), versioned files
written atomically and read back with their format and version checked."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path


def finite(value):
    """`value` with every float NaN or infinity replaced by None, through dicts, lists and tuples."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def dumps(doc, **kwargs) -> str:
    """`doc` as strict JSON: a number that is undefined in a run (NaN: the verify rate of a run that verified no
    draft, an acceptance at a position no round reached; or infinite) is written null, which every JSON parser
    reads, where json.dumps would write the non-JSON token NaN."""
    return json.dumps(finite(doc), allow_nan=False, **kwargs)


def write_json_atomic(path: str | Path, doc: dict) -> None:
    """Write `doc` as JSON through a temporary sibling and a rename: a kill mid-write leaves the old file (or none),
    never a truncated one that a later load would trip over."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(partial, "w", encoding="utf-8") as fh:
            fh.write(dumps(doc, indent=1) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


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
