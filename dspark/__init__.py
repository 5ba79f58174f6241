"""dspark: speculative decoding research toolkit centred on DSpark (confidence-scheduled, semi-autoregressive
drafting). See README.md.

    import dspark
    host = dspark.load_host("smollm2")              # .model (transformers), .tokenizer
    out = dspark.generate(host, "ngram", ["Hello!"])  # drafter: object, registered name or checkpoint dir
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

__all__ = ["Generation", "encode_prompts", "generate", "load_host", "resolve_drafter", "resolve_verifier",
           "set_deterministic", "tune_cpu_allocator", "__version__"]

if TYPE_CHECKING:
    from dspark.api import (Generation, encode_prompts, generate, load_host, resolve_drafter, resolve_verifier,
                            set_deterministic, tune_cpu_allocator)


def __getattr__(name: str):
    # why lazy (PEP 562): dspark.api imports the drafters package, whose modules import dspark.engine.sampling; an eager
    # import here made `import drafters` (or `from drafters import load_drafter`) in a fresh interpreter circular
    if name in __all__:
        return getattr(importlib.import_module("dspark.api"), name)
    try:  # submodules as attributes (`dspark.api.checkpoint_dir`), as the eager import used to provide
        return importlib.import_module(f"dspark.{name}")
    except ModuleNotFoundError as err:
        if err.name != f"dspark.{name}":
            raise
    raise AttributeError(f"module 'dspark' has no attribute {name!r}")
