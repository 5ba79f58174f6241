"""Drafters: choose one by name with `build_drafter(name, host, ...)`, or load a trained one with
`load_drafter(path, host)` (config.json's "kind" picks the class).

Names: ngram (prompt lookup, model-free), dspark (docs/DSPARK.md §2.3), dflash (DSpark with heads off, §2.2),
mtp (MTP-1), and the other helpers' eagle3 and small-lm (registered below).
"""
from __future__ import annotations

import os
import warnings
from typing import Callable

from drafters import deepspec as _deepspec  # noqa: F401  registers the reference's checkpoint layout
from drafters.checkpoint import LEGACY_CONFIG_KEYS, CheckpointError, read_config
from drafters.dspark import DSparkConfig, DSparkDrafter, dflash_config
from drafters.eagle3 import Eagle3Config, Eagle3Drafter
from drafters.mtp import MTPConfig, MTPDrafter
from drafters.ngram import NgramDrafter
from drafters.small_lm import SmallLMDrafter
from dspark.engine.protocol import Drafter

#: checkpoint kind (config.json "kind") -> drafter class with from_pretrained(dir, host)
DRAFTER_KINDS: dict[str, type] = {
    "dspark": DSparkDrafter,
    "mtp": MTPDrafter,
    "eagle3": Eagle3Drafter,
}


def _untrained(drafter, name: str):
    warnings.warn(f"drafter '{name}' has no checkpoint: built with random weights, so acceptance will be low "
                  "(train one with `dspark train` and pass checkpoint=...)", stacklevel=3)
    return drafter


def _build_dspark(host, checkpoint, **overrides):
    if checkpoint is not None:
        return DSparkDrafter.from_pretrained(checkpoint, host, **overrides)
    return _untrained(DSparkDrafter(host, DSparkConfig(**overrides)), "dspark")


def _build_dflash(host, checkpoint, **overrides):
    config = dflash_config(**overrides)
    if checkpoint is not None:  # a DFlash checkpoint is a dspark one with the heads off
        return DSparkDrafter.from_pretrained(checkpoint, host, **{"head": config.head,
                                                                  "confidence": config.confidence, **overrides})
    return _untrained(DSparkDrafter(host, config), "dflash")


def _build_mtp(host, checkpoint, **overrides):
    if checkpoint is not None:
        return MTPDrafter.from_pretrained(checkpoint, host, **overrides)
    return _untrained(MTPDrafter(host, MTPConfig(**overrides)), "mtp")


def _build_ngram(host, checkpoint, **overrides):
    if checkpoint is not None:
        raise ValueError("the ngram drafter is model-free: it takes no checkpoint")
    return NgramDrafter(**overrides)


def _build_eagle3(host, checkpoint, **overrides):
    if checkpoint is not None:
        return Eagle3Drafter.from_pretrained(checkpoint, host, **overrides)
    return _untrained(Eagle3Drafter(host, Eagle3Config(**overrides)), "eagle3")


def _build_small_lm(host, checkpoint, **overrides):
    if checkpoint is None:
        raise ValueError("the small-lm drafter needs checkpoint=<a causal LM sharing the host's tokenizer: a packaged "
                         "host name such as qwen2.5-coder-0.5b, a .gguf file, a local model directory, or a hub id "
                         "in the local HF cache>")
    return SmallLMDrafter.from_pretrained(checkpoint, host, **overrides)


#: drafter name -> builder(host, checkpoint, **overrides)
DRAFTERS: dict[str, Callable[..., Drafter]] = {
    "ngram": _build_ngram,
    "dspark": _build_dspark,
    "dflash": _build_dflash,
    "mtp": _build_mtp,
    "eagle3": _build_eagle3,
    "small-lm": _build_small_lm,
}


def build_drafter(name: str, host, *, checkpoint: str | os.PathLike | None = None, **overrides) -> Drafter:
    """The drafter called `name` for `host`: loaded from `checkpoint` when given (overrides must then match the
    checkpoint's config), else freshly built from its config dataclass with `overrides` (random weights: warns)."""
    if name not in DRAFTERS:
        raise ValueError(f"unknown drafter '{name}'; choose one of {sorted(DRAFTERS)}")
    overrides = {LEGACY_CONFIG_KEYS.get(k, k): v for k, v in overrides.items()}
    return DRAFTERS[name](host, checkpoint, **overrides)


def for_inference(drafter, host):
    """`drafter` with its floating-point weights in the host's dtype (bf16 on a GPU host), for decoding; returned.

    why: a drafter is built with float32 master weights whatever its host's dtype (what training needs, under
    autocast), and decoding ran it so: on a bf16 host every draft step then read twice the bytes and ran float32
    GEMMs. On the Qwen2.5-Coder-1.5B host (H100) DFlash's propose took 1.82 ms where reading its weights in bf16 at
    the host's own rate would take about 0.74 ms (an estimate). Training builds and loads drafters itself
    (dspark.training.train) and never calls this."""
    import torch

    if isinstance(drafter, torch.nn.Module) and host.dtype.is_floating_point:
        drafter.to(dtype=host.dtype)  # floating tensors only (EAGLE-3's d2t stays long); a no-op where they match
    return drafter


def load_drafter(path: str | os.PathLike, host) -> Drafter:
    """A trained drafter from a `save_pretrained` directory; its config.json "kind" picks the class."""
    kind = read_config(path)["kind"]
    if kind not in DRAFTER_KINDS:
        raise CheckpointError(f"checkpoint {path} holds an unknown drafter kind '{kind}'; known kinds: "
                              f"{sorted(DRAFTER_KINDS)}")
    return DRAFTER_KINDS[kind].from_pretrained(path, host)


__all__ = ["DRAFTERS", "DRAFTER_KINDS", "CheckpointError", "DSparkConfig", "DSparkDrafter", "Drafter", "Eagle3Config",
           "Eagle3Drafter", "MTPConfig", "MTPDrafter", "NgramDrafter", "SmallLMDrafter", "build_drafter",
           "dflash_config", "for_inference", "load_drafter"]
