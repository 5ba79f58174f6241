"""Checkpoints of trainable drafters: `save_pretrained(drafter, dir)` and `from_pretrained(cls, dir, host)`.

Layout of a checkpoint directory (never pickle):
  config.json                      {"format_version", "kind", "config": the drafter's config dataclass,
                                    "host": fingerprint (vocab_size, hidden_size, num_layers, model_type,
                                    feature_layers, name)}
  model.safetensors                the drafter's state_dict, or, when larger than `max_shard_bytes`,
  model-0000i-of-0000n.safetensors + model.safetensors.index.json ({"metadata", "weight_map"}, the HF layout).
A DeepSpec-format directory (the reference implementation's layout, docs/DEEPSPEC.md) is read too: `read_config`
translates its config.json and `from_pretrained` renames its weights (drafters/deepspec.py).
The shared frozen host embedding and LM head are not in the state_dict (drafters hold them in a
`drafters.blocks.SharedHost`), so they are never saved.

The contract a drafter class meets to use this module (mix in `Checkpointable`):
  kind: str                  the name config.json records and `drafters.load_drafter` dispatches on
  config_class: type         a dataclass with `feature_layers` and host_vocab_size, host_hidden_size,
                             host_num_layers, host_model_type, host_name (filled from the host when built)
  cls(host, config)          builds the module; `self.config` holds the resolved config (`bind_host` does
                             the host part: resolve, check the host, keep the shared frozen modules)
Writes are atomic: everything goes to a temporary sibling directory which then replaces `dir`, so a crash
mid-write leaves the previous checkpoint intact.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import uuid
import warnings
from dataclasses import dataclass
from typing import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from drafters.blocks import SharedHost
from dspark.engine.models import PICKLE_PATTERNS  # the one list: weight files that are pickles, never loaded

FORMAT_VERSION = 1
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 2 * 1024 ** 3
#: config keys renamed since checkpoints and drafter_args were first written: old name -> current name
LEGACY_CONFIG_KEYS = {"gamma": "block_size"}  # DSpark / DFlash's trained block size


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: missing, corrupt, or made for another host or architecture."""



def _pickle_note(directory: Path) -> str:
    """'; it holds X, a pickle file, which is never loaded ...' when the directory has pickled weights, else ''."""
    found = sorted({p.name for pattern in PICKLE_PATTERNS for p in directory.glob(pattern) if p.is_file()})
    if not found:
        return ""
    return (f"; it holds {', '.join(found)}: pickle files, which dspark never loads (unpickling can run "
            "arbitrary code). Only safetensors weights with a JSON config.json are read; convert the weights "
            "with safetensors.torch.save_file")


def host_fingerprint(config) -> dict:
    """What a drafter's weights assume about its host, from its resolved config."""
    return {"vocab_size": config.host_vocab_size, "hidden_size": config.host_hidden_size,
            "num_layers": config.host_num_layers, "model_type": config.host_model_type,
            "feature_layers": list(config.feature_layers), "name": config.host_name}


@dataclass(kw_only=True)
class HostFields:
    """Base of a drafter config: the host fingerprint of the contract above (None until `with_host` fills it in
    from the host the drafter is built for; checked against every host the drafter meets). The subclass declares
    `feature_layers` itself, with its own default rule."""

    host_vocab_size: int | None = None  # host fingerprint, filled from the host when built
    host_hidden_size: int | None = None
    host_num_layers: int | None = None
    host_model_type: str | None = None
    host_name: str | None = None

    def __post_init__(self) -> None:
        if self.feature_layers is not None:
            self.feature_layers = tuple(self.feature_layers)  # JSON, YAML and the CLI give lists


def with_host(config, host, feature_layers):
    """`config` with the contract's host fields filled in from `host` (fields already set are kept, so a loaded
    checkpoint's fingerprint survives) and `feature_layers` as the taps when it names none."""
    return dataclasses.replace(config, feature_layers=config.feature_layers or tuple(feature_layers),
                               host_vocab_size=config.host_vocab_size or host.vocab_size,
                               host_hidden_size=config.host_hidden_size or host.hidden_size,
                               host_num_layers=config.host_num_layers or host.num_layers,
                               host_model_type=config.host_model_type or host.config.model_type,
                               host_name=config.host_name or host.name)


def check_host(fingerprint: dict, host, *, source: str) -> None:
    """Refuse a host the fingerprint was not made for; messages name both values."""
    for key, have in (("vocab_size", host.vocab_size), ("hidden_size", host.hidden_size),
                      ("num_layers", host.num_layers)):
        want = fingerprint[key]
        if want is not None and want != have:
            raise CheckpointError(f"{source} was made for a host with {key}={want}, but host '{host.name}' has "
                                  f"{key}={have}")
    bad = [i for i in fingerprint["feature_layers"] if not 0 <= i < host.num_layers]
    if bad:
        raise CheckpointError(f"{source} reads host feature layers {list(fingerprint['feature_layers'])}, but "
                              f"{bad} do not exist in host '{host.name}' ({host.num_layers} layers)")
    if fingerprint["model_type"] not in (None, host.config.model_type):
        warnings.warn(f"{source} was made for a '{fingerprint['model_type']}' host; host '{host.name}' is "
                      f"'{host.config.model_type}' (same shapes, so loading anyway)", stacklevel=3)


def config_from_dict(config_class, values: dict, *, source: str):
    """The config dataclass from JSON values; unknown keys are errors; JSON lists become tuples."""
    names = {f.name for f in dataclasses.fields(config_class)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise CheckpointError(f"{source}: unknown {config_class.__name__} keys {unknown}")
    return config_class(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()})


def _write_weights(tensors: dict[str, torch.Tensor], directory: Path, max_shard_bytes: int) -> None:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        t = tensors[name]
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(directory / WEIGHTS_NAME), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(directory / file), metadata={"format": "pt"})
        weight_map.update({name: file for name in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (directory / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                   indent=2))


def save_pretrained(drafter, directory: str | os.PathLike, *,
                    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> Path:
    """Write config.json and the weights of `drafter` to `directory`, atomically replacing what was there."""
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise CheckpointError(f"cannot save a checkpoint to {directory}: it exists and is not a directory")
    directory.parent.mkdir(parents=True, exist_ok=True)
    tag = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp = directory.parent / f".{directory.name}.tmp-{tag}"
    tmp.mkdir()
    try:
        config = {"format_version": FORMAT_VERSION, "kind": drafter.kind,
                  "config": dataclasses.asdict(drafter.config), "host": host_fingerprint(drafter.config)}
        (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2))
        # why clone: safetensors refuses views and shared storage; a CPU copy also frees the device for training
        tensors = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in drafter.state_dict().items()}
        _write_weights(tensors, tmp, max_shard_bytes)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = directory.parent / f".{directory.name}.old-{tag}"
    if directory.exists():
        os.rename(directory, old)  # why two renames: POSIX cannot atomically replace a non-empty directory
    os.rename(tmp, directory)
    shutil.rmtree(old, ignore_errors=True)
    return directory


@dataclass(frozen=True)
class ForeignLayout:
    """How to read a checkpoint written by another project: `detect(config.json)`; `to_config` gives our config
    dict, keeping the raw config under the layout's name; `to_tensors` renames its weights to ours.
    why a registry: the layout modules build on this one (its errors, its weight writer), so this module must not
    import them; each registers itself when the drafters package is imported."""

    detect: Callable[[dict], bool]
    to_config: Callable[..., dict]
    to_tensors: Callable[..., dict]


FOREIGN_LAYOUTS: dict[str, ForeignLayout] = {}


def read_config(directory: str | os.PathLike) -> dict:
    """Parse and validate config.json of a checkpoint directory."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"no drafter checkpoint at {directory}: directory does not exist")
    path = directory / CONFIG_NAME
    if not path.is_file():
        raise CheckpointError(f"no drafter checkpoint at {directory}: {CONFIG_NAME} is missing"
                              + _pickle_note(directory))
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"cannot parse {path}: {e}") from e
    for layout in FOREIGN_LAYOUTS.values():  # another project's layout, e.g. the reference's (docs/DEEPSPEC.md)
        if isinstance(config, dict) and layout.detect(config):
            return layout.to_config(config, source=str(path))
    missing = [k for k in ("format_version", "kind", "config", "host") if k not in config]
    if missing:
        raise CheckpointError(f"{path} is not a drafter config: missing keys {missing}")
    if config["format_version"] != FORMAT_VERSION:
        raise CheckpointError(f"{path} has format_version {config['format_version']}; this version reads "
                              f"{FORMAT_VERSION}")
    config["config"] = {LEGACY_CONFIG_KEYS.get(k, k): v for k, v in config["config"].items()}
    return config


def _read_weights(directory: Path) -> dict[str, torch.Tensor]:
    index = directory / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"cannot parse {index}: {e}") from e
        files = sorted(set(weight_map.values()))
    elif (directory / WEIGHTS_NAME).is_file():
        weight_map, files = None, [WEIGHTS_NAME]
    else:
        raise CheckpointError(f"no weights in {directory}: expected {WEIGHTS_NAME} or {INDEX_NAME}"
                              + _pickle_note(directory))
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        path = directory / file
        if not path.is_file():
            raise CheckpointError(f"weight shard {path} listed in {INDEX_NAME} is missing")
        try:
            shard = load_file(str(path))
        except Exception as e:  # why broad: safetensors raises its own error types (and OSError) on bad files
            raise CheckpointError(f"cannot read {path}: corrupt or truncated safetensors file ({e})") from e
        if weight_map is not None:
            stray = sorted(k for k in shard if weight_map.get(k) != file)
            if stray:
                raise CheckpointError(f"{path} holds tensors {stray} that {INDEX_NAME} does not map to it")
        tensors.update(shard)
    return tensors


def from_pretrained(cls, directory: str | os.PathLike, host, **expected):
    """Build `cls` from a checkpoint for `host`. `expected` config values (e.g. feature_layers=...) must match
    the checkpoint's, since its weights were trained for them."""
    directory = Path(directory)
    saved = read_config(directory)
    source = f"checkpoint {directory}"
    if saved["kind"] != cls.kind:
        raise CheckpointError(f"{source} holds a '{saved['kind']}' drafter, not '{cls.kind}'")
    config = config_from_dict(cls.config_class, saved["config"], source=source)
    for key, want in expected.items():
        if key not in saved["config"]:
            raise CheckpointError(f"{source}: unknown {cls.config_class.__name__} key '{key}'")
        have = getattr(config, key)
        if (tuple(want) if isinstance(want, list) else want) != have:
            raise CheckpointError(f"{source} has {key}={have!r}, but {key}={want!r} was requested")
    fingerprint = saved["host"]
    if fingerprint != host_fingerprint(config):
        raise CheckpointError(f"{source}: the host fingerprint {fingerprint} disagrees with its own config "
                              f"{host_fingerprint(config)}")
    check_host(fingerprint, host, source=source)
    drafter = cls(host, config)
    tensors = _read_weights(directory)
    for name, layout in FOREIGN_LAYOUTS.items():  # its names -> ours (and any frozen copies checked against the host)
        if name in saved:
            tensors = layout.to_tensors(drafter, tensors, saved[name], host, source=source)
    own = drafter.state_dict()
    missing, unexpected = sorted(set(own) - set(tensors)), sorted(set(tensors) - set(own))
    if missing or unexpected:
        raise CheckpointError(f"{source} does not fit a '{cls.kind}' drafter of its config: missing tensors "
                              f"{missing}, unexpected tensors {unexpected}")
    wrong = [f"{k} {tuple(tensors[k].shape)} vs {tuple(v.shape)}" for k, v in own.items()
             if tensors[k].shape != v.shape]
    if wrong:
        raise CheckpointError(f"{source}: tensor shapes differ from the config's (saved vs expected): {wrong}")
    drafter.load_state_dict(tensors, strict=True)
    return drafter


class Checkpointable:
    """Mixin giving a drafter `save_pretrained(dir)` and `from_pretrained(dir, host)` (see the module contract)."""

    kind: str
    config_class: type

    def save_pretrained(self, directory: str | os.PathLike, *,
                        max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> Path:
        """Write this drafter's checkpoint to `directory` (atomic replace)."""
        return save_pretrained(self, directory, max_shard_bytes=max_shard_bytes)

    def bind_host(self, host, config, *, source: str):
        """Resolve `config` (None: the defaults) for `host`, refuse a host it does not fit, and keep the config, its
        feature layers and the host's frozen shared modules on `self`. Returns the resolved config; call it right
        after `nn.Module.__init__`."""
        config = (config or self.config_class()).resolved(host)
        check_host(host_fingerprint(config), host, source=source)
        host.check_taps(config.feature_layers)
        self.config, self.feature_layers = config, config.feature_layers
        self.shared = SharedHost.of(host)
        return config

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike, host, **expected):
        """Load a checkpoint of this kind for `host`; `expected` config values must match the checkpoint's."""
        return from_pretrained(cls, directory, host, **expected)
