"""dspark: speculative decoding research toolkit centred on DSpark (confidence-scheduled, semi-autoregressive
drafting). See README.md.

    import dspark
    host = dspark.load_host("smollm2")              # .model (transformers), .tokenizer
    out = dspark.generate(host, "ngram", ["Hello!"])  # drafter: object, registered name or checkpoint dir
"""
from __future__ import annotations

__version__ = "0.1.0"

# Plain imports: the engine core below imports nothing above it (tests/test_layers.py), so `import drafters`
# reaching `dspark.engine` through this file no longer closes a circle.
from dspark import api, metrics  # noqa: E402 (after __version__, which the CLI reads)
from dspark.api import (Generation, encode_prompts, generate, load_host, resolve_drafter,  # noqa: E402
                        resolve_verifier, set_deterministic, tune_cpu_allocator)

__all__ = ["Generation", "encode_prompts", "generate", "load_host", "resolve_drafter", "resolve_verifier",
           "set_deterministic", "tune_cpu_allocator", "__version__"]
