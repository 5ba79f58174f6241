"""dspark: speculative decoding research toolkit centred on DSpark (confidence-scheduled, semi-autoregressive
drafting). See README.md.

    import dspark
    host = dspark.load_host("smollm2")              # .model (transformers), .tokenizer
    out = dspark.generate(host, "ngram", ["Hello!"])  # drafter: object, registered name or checkpoint dir
"""
__version__ = "0.1.0"

from dspark.api import (Generation, encode_prompts, generate, load_host, resolve_drafter, resolve_verifier,
                        set_deterministic)

__all__ = ["Generation", "encode_prompts", "generate", "load_host", "resolve_drafter", "resolve_verifier",
           "set_deterministic", "__version__"]
