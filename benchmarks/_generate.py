"""What the decoding benchmarks share: transformers `generate()` timed one prompt at a time (concurrency 1)."""
from __future__ import annotations

import time

import torch


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def hf_decode(model, prompts: list[list[int]], *, new: int, **kwargs) -> dict:
    """transformers generate() greedy, one prompt at a time, after an untimed call on the first prompt (warm-up).
    tokens/s over the timed calls, their seconds and new tokens, and every prompt's new token ids. `kwargs` go to
    generate (assistant_model=, prompt_lookup_num_tokens=, custom_generate=, ...)."""
    device = next(model.parameters()).device
    tokens, seconds, outputs = 0, 0.0, []
    for i, p in enumerate([prompts[0], *prompts]):
        x = torch.tensor([p], device=device)
        sync()
        start = time.perf_counter()
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new, do_sample=False,
                             pad_token_id=0, **kwargs)
        sync()
        if i:
            seconds += time.perf_counter() - start
            tokens += out.shape[1] - x.shape[1]
            outputs.append(out[0, x.shape[1]:].tolist())
    return {"tokens_per_s": tokens / seconds if seconds > 0 else None, "seconds": seconds, "new_tokens": tokens,
            "token_ids": outputs}
