"""Rotary position embedding, applied with the host's own cos/sin (its theta and any scaling).

Shapes: B requests, T tokens, D head dim.
"""
from __future__ import annotations

import torch


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, heads, T, D) by cos/sin (B, T, D) of its absolute positions (from the host's rotary module,
    so theta and any scaling are the host's). The host step and every drafter rotate through this one function."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # (B, 1, T, D)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin
