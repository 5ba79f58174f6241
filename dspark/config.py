"""Typed configuration: dataclasses are the CLI flags and the YAML keys, one definition per setting.

`parse((TrainConfig,), argv)` turns every field of the given dataclasses into a flag (`max_steps` ->
`--max-steps`, `--max_steps` also accepted; help from `field(metadata={"help": ...})`) and reads `--config
run.yaml`, a mapping whose keys are the same field names. Precedence: dataclass defaults < YAML < flags.
Unknown keys are errors that name the key and list the valid ones; values are checked against the field types
(int, float, bool, str, Optional[...], list[...], dict[str, ...], Literal[...] choices).

A recipe file holds several commands' settings in one YAML: top-level keys that name a command (`train`, `eval`,
`bench`, `profile`, ... : the last word of the command, so `dspark experiment concurrency` reads `concurrency`) are
sections, and `dspark <command> --config recipe.yaml` reads its own section plus those of the top-level keys that are
not sections and that the command has (settings several commands share, e.g. `host`). Other commands' sections are skipped; a recipe with no
section for the command is an error that lists the sections it has. `experiments/recipes/` holds the recorded ones.

List and mapping flags take several values and append when repeated: `--prompt A --prompt B` and
`--prompt A B` are both two prompts, `--drafter-args a=1 --drafter-args b=2` both pairs. A value is one item as
typed: `--prompt "Name three primes, please."` is one prompt; only lists of numbers may also be written
comma-separated (`--batch-sizes 1,4,16`). A flag replaces the YAML value of its key, it does not extend it.

why not transformers.HfArgumentParser: it passes YAML values into the dataclass unchecked (a quoted "1e-3" stays a
string until the optimiser fails), its unknown-key error does not list the valid keys, and flags over YAML needs
a second parse anyway. One coercion function shared by flags and YAML keeps both paths identical.

Field metadata understood here: "help" (text), "const" (the value a flag takes when given without an argument,
e.g. a bare `--resume`).
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import types
import typing
from pathlib import Path
from typing import Any, Literal, Sequence, Union

import yaml

_MISSING = object()


class ConfigError(ValueError):
    """A configuration key or value that does not fit the dataclass fields."""


def _hints(cls: type) -> dict[str, Any]:
    # why get_type_hints: with `from __future__ import annotations` field.type is a string
    return typing.get_type_hints(cls)


def _optional_inner(tp) -> Any | None:
    """X for Optional[X] / X | None, else None."""
    if typing.get_origin(tp) in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0]
    return None


def _type_name(tp) -> str:
    inner = _optional_inner(tp)
    if inner is not None:
        return f"{_type_name(inner)} or null"
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin is list:
        return f"list of {_type_name(typing.get_args(tp)[0])}"
    if origin is dict:
        return f"mapping of str to {_type_name(typing.get_args(tp)[1])}"
    return getattr(tp, "__name__", str(tp))


def coerce(value: Any, tp, key: str) -> Any:
    """Check/convert `value` (from YAML, or a string from the command line) to type `tp`; ConfigError if it does
    not fit. Strings are converted for int/float/bool/None; other mismatches are errors, never silent casts."""
    def fail():
        raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")

    inner = _optional_inner(tp)
    if inner is not None:
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            return None
        return coerce(value, inner, key)
    origin = typing.get_origin(tp)
    if origin is Literal:
        choices = typing.get_args(tp)
        for choice in choices:
            if value == choice or (isinstance(value, str) and not isinstance(choice, str) and value == str(choice)):
                return choice
        raise ConfigError(f"{key}: {value!r} is not a valid choice; choose one of {', '.join(map(repr, choices))}")
    if origin is list:
        if isinstance(value, str):  # one value; numbers may also come comma-separated ("1,4,16")
            value = _split_numbers(value) if _numeric(typing.get_args(tp)[0]) else [value]
        if not isinstance(value, (list, tuple)):
            fail()
        return [coerce(v, typing.get_args(tp)[0], f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            fail()
        return {str(k): coerce(v, typing.get_args(tp)[1], f"{key}.{k}") for k, v in value.items()}
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "yes", "1", "false", "no", "0"):
            return value.lower() in ("true", "yes", "1")
        fail()
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                fail()
        fail()
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                fail()
        fail()
    if tp is str:
        if isinstance(value, str):
            return value
        fail()
    if tp is Path:
        if isinstance(value, (str, Path)):
            return Path(value)
        fail()
    raise ConfigError(f"{key}: unsupported field type {tp!r} in the config dataclass")


def _numeric(tp) -> bool:
    """Whether list items of type `tp` are numbers: only those may be written comma-separated, since a comma can
    be part of a string (a prompt such as "Name three primes, please.") but never of a number."""
    return (_optional_inner(tp) or tp) in (int, float)


def _split_numbers(value: str) -> list[str]:
    return [v for v in value.split(",") if v.strip() != ""]


def _fields(dataclass_types: Sequence[type]) -> dict[str, tuple[type, dataclasses.Field, Any]]:
    """name -> (owning dataclass, field, resolved type); names must be unique across the dataclasses."""
    out: dict[str, tuple[type, dataclasses.Field, Any]] = {}
    for cls in dataclass_types:
        hints = _hints(cls)
        for f in dataclasses.fields(cls):
            if not f.init:
                continue
            if f.name in out:
                raise TypeError(f"field {f.name!r} is defined by both {out[f.name][0].__name__} and {cls.__name__}")
            out[f.name] = (cls, f, hints[f.name])
    return out


def _check_keys(keys, valid: Sequence[str], source: str) -> None:
    unknown = [k for k in keys if k not in valid]
    if unknown:
        key = unknown[0]
        close = difflib.get_close_matches(str(key), valid, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"unknown key {key!r} in {source}{hint}; valid keys: {', '.join(sorted(valid))}")


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return _MISSING


def build_parser(dataclass_types: Sequence[type], *, prog: str | None = None,
                 description: str | None = None) -> argparse.ArgumentParser:
    """An argparse parser with one flag per field plus `--config`; values stay raw strings (see `parse`)."""
    parser = argparse.ArgumentParser(prog=prog, description=description,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--config", help="YAML file whose keys are the field names below; flags override it")
    for name, (cls, f, tp) in _fields(dataclass_types).items():
        default = _default(f)
        help_text = f.metadata.get("help", "")
        help_text += f" [{_type_name(tp)}" + ("" if default is _MISSING else f"; default {default!r}") + "]"
        flags = [f"--{name.replace('_', '-')}"] + ([f"--{name}"] if "_" in name else [])
        kwargs: dict[str, Any] = dict(dest=name, default=argparse.SUPPRESS, help=help_text.replace("%", "%%"))
        base = _optional_inner(tp) or tp
        if typing.get_origin(base) in (list, dict):
            # a repeated flag appends: `--prompt A --prompt B` is two prompts, `--batch-sizes 1 4 --batch-sizes 16`
            # three sizes, `--drafter-args a=1 --drafter-args b=2` both pairs
            kwargs.update(nargs="*", action="extend")
        elif base is bool or "const" in f.metadata:
            # `--flag` alone means True (or the declared const); `--flag false` is also accepted
            kwargs.update(nargs="?", const=f.metadata.get("const", "true"))
        if typing.get_origin(base) is dict:
            kwargs["metavar"] = "KEY=VALUE"
        if typing.get_origin(base) is Literal:
            kwargs["metavar"] = "{" + ",".join(str(c) for c in typing.get_args(base)) + "}"
        parser.add_argument(*flags, **kwargs)
        if base is bool:
            parser.add_argument(f"--no-{name.replace('_', '-')}", dest=name, action="store_const", const="false",
                                default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    return parser


def _flag_value(raw: Any, tp) -> Any:
    """Flag strings -> the YAML-like value `coerce` expects (lists from nargs, KEY=VALUE pairs for dicts)."""
    base = _optional_inner(tp) or tp
    if typing.get_origin(base) is dict and isinstance(raw, list):
        pairs = {}
        for item in raw:
            key, sep, value = item.partition("=")
            if not sep:
                raise ConfigError(f"expected KEY=VALUE, got {item!r}")
            pairs[key] = yaml.safe_load(value)  # why: `num_layers=3` gives an int, `head=markov` a str
        return pairs
    if typing.get_origin(base) is list and isinstance(raw, list) and _numeric(typing.get_args(base)[0]):
        return [v for item in raw for v in _split_numbers(item)]  # `--batch-sizes 1,4 16` is [1, 4, 16]
    return raw


def load_yaml(path: str | Path) -> dict:
    """A YAML mapping (empty file = {}); a non-mapping document is an error."""
    with open(path) as fh:
        data = yaml.safe_load(fh)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of field names to values, got {type(data).__name__}")
    return data


#: top-level keys that make a YAML file a recipe (one section per command); see the module docstring
RECIPE_SECTIONS = frozenset({"train", "regenerate", "quickstart", "generate", "eval", "compare", "profile", "calibrate",
                             "sweep", "bench", "export", "report", "concurrency", "savings", "threshold", "length",
                             "acceptance", "simulate", "validate"})


def config_section(data: dict, prog: str | None, source: str, valid: Sequence[str]) -> dict:
    """The settings `prog` (e.g. "dspark train") reads from the YAML mapping `data`: all of it for a plain config file;
    for a recipe (a mapping with command sections), the shared top-level keys among `valid` plus the command's own
    section (whose keys are all checked)."""
    sections = sorted(k for k in data if k in RECIPE_SECTIONS and isinstance(data[k], dict))
    if not sections:
        return data
    name = (prog or "").split()[-1] if prog else None
    if name not in sections:
        raise ConfigError(f"{source} is a recipe with sections for {', '.join(sections)}, none for "
                          f"{prog or 'this command'!r}: run one of those commands with it")
    shared = {k: v for k, v in data.items() if k not in RECIPE_SECTIONS and k in valid}
    return {**shared, **data[name]}


def _build(dataclass_types: Sequence[type], values: dict[str, Any]) -> tuple:
    fields = _fields(dataclass_types)
    missing = [n for n, (_, f, _) in fields.items() if n not in values and _default(f) is _MISSING]
    if missing:
        raise ConfigError(f"missing required setting(s): {', '.join(missing)}")
    instances = []
    for cls in dataclass_types:
        kwargs = {n: values[n] for n, (owner, _, _) in fields.items() if owner is cls and n in values}
        instances.append(cls(**kwargs))
    return tuple(instances)


def parse(dataclass_types: Sequence[type], argv: Sequence[str] | None = None, *, prog: str | None = None,
          description: str | None = None) -> tuple:
    """Instances of `dataclass_types` from defaults < `--config` YAML < flags. ConfigError names bad keys/values."""
    parser = build_parser(dataclass_types, prog=prog, description=description)
    args = vars(parser.parse_args(argv))
    fields = _fields(dataclass_types)
    values: dict[str, Any] = {}
    config_path = args.pop("config", None)
    if config_path is not None:
        data = config_section(load_yaml(config_path), prog, f"config file {config_path}", list(fields))
        _check_keys(data, list(fields), f"config file {config_path}")
        values.update({k: coerce(v, fields[k][2], k) for k, v in data.items()})
    for name, raw in args.items():
        values[name] = coerce(_flag_value(raw, fields[name][2]), fields[name][2], f"--{name.replace('_', '-')}")
    return _build(dataclass_types, values)


def to_dict(instance) -> dict:
    """A dataclass instance as plain JSON/YAML-ready values (Paths as strings)."""
    def plain(v):
        if isinstance(v, Path):
            return str(v)
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        return v
    return {f.name: plain(getattr(instance, f.name)) for f in dataclasses.fields(instance) if f.init}


def from_dict(cls: type, data: dict, *, source: str = "mapping"):
    """`cls(**data)` with the same unknown-key and type checks as `parse`."""
    fields = _fields([cls])
    _check_keys(data, list(fields), source)
    return _build([cls], {k: coerce(v, fields[k][2], k) for k, v in data.items()})[0]
