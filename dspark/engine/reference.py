"""Slow, obviously correct decoders used by the tests as oracles.

They call the transformers model directly on the whole sequence every step: no cache, no batching, no drafts.
"""
from __future__ import annotations

import torch


@torch.no_grad()
def greedy(model, prompt: list[int], max_new_tokens: int, stop_token_ids: set[int] = frozenset()) -> list[int]:
    """Plain greedy decoding of one prompt with a full forward per token."""
    ids = list(prompt)
    out: list[int] = []
    for _ in range(max_new_tokens):
        logits = model(torch.tensor([ids], device=model.device)).logits[0, -1]
        t = int(logits.argmax())
        out.append(t)
        ids.append(t)
        if t in stop_token_ids:
            break
    return out


@torch.no_grad()
def next_token_logits(model, prefix: list[int]) -> torch.Tensor:
    """Float32 logits (V,) of the token after `prefix`."""
    return model(torch.tensor([prefix], device=model.device)).logits[0, -1].float()
