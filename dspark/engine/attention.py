"""Attention over a KV cache with grouped query heads, through SDPA's fused kernels.

Shapes: B requests, T query tokens, W key positions, Hq query heads, Hkv key/value heads, g = Hq / Hkv, D head dim.

why not SDPA's own enable_gqa: with an attention mask (every step here has one) SDPA runs grouped heads only in its
math backend, which expands the keys per query head and runs the scores, mask, softmax and weighting as separate
kernels (its flash backend, the one that takes grouped heads natively, takes no mask; reported upstream, e.g.
pytorch/pytorch#139586, huggingface/transformers#39412). Packing the g query heads of one key/value head into its
query rows (g * T rows, each with its token's mask row) is the same attention, and a fused backend then runs it in
one kernel (tests/test_engine_cuda.py runs it with the math backend disallowed).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def pack_mask(mask: torch.Tensor, groups: int) -> torch.Tensor:
    """An additive mask (B, 1, T, W) for queries packed by `grouped_attention`: (B, 1, g * T, W), row j * T + t
    being token t's row for the j-th query head of a group. Build once per step, not per layer."""
    if groups == 1:
        return mask
    B, _, T, W = mask.shape
    return mask.unsqueeze(2).expand(B, 1, groups, T, W).reshape(B, 1, groups * T, W)


def grouped_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, packed_mask: torch.Tensor,
                      scale: float, packed_output: bool = False) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v for q (B, Hq, T, D) against keys, values (B, Hkv, W, D), query head h reading
    key/value head h // g (as SDPA's enable_gqa); packed_mask from pack_mask. Returns (B, Hq, T, D), or with
    `packed_output` SDPA's own (B, Hkv, g * T, D), rows j * T + t, for a caller that unpacks it (unpack_heads)."""
    B, Hq, T, D = q.shape
    Hkv = keys.shape[1]
    packed = q.reshape(B, Hkv, (Hq // Hkv) * T, D)  # query head h = kv_head * g + j -> rows j * T + t
    out = F.scaled_dot_product_attention(packed, keys, values, attn_mask=packed_mask, scale=scale)
    if packed_output:
        return out
    return out.reshape(B, Hq, T, D)  # CUDA kernels may return another layout (not viewable): then a copy


def unpack_heads(out: torch.Tensor, num_heads: int, T: int) -> torch.Tensor:
    """grouped_attention's packed output (B, Hkv, g * T, D) -> (B, T, Hq * D), the output projection's input
    (query head h = kv_head * g + j, features h * D + d). why here: in compiled code this is one copy kernel from
    whatever layout SDPA returned, where reshaping to (B, Hq, T, D) first and transposing after is two."""
    B, Hkv, _, D = out.shape
    return out.reshape(B, Hkv, num_heads // Hkv, T, D).permute(0, 3, 1, 2, 4).reshape(B, T, num_heads * D)


#: SDPA's backends by the names of torch.backends.cuda's switches (enable_<name>_sdp)
SDPA_BACKENDS = {"flash": "enable_flash_sdp", "efficient": "enable_mem_efficient_sdp", "cudnn": "enable_cudnn_sdp",
                 "math": "enable_math_sdp"}


def restrict_sdpa(backends) -> None:
    """Let SDPA choose only among `backends` (names of SDPA_BACKENDS) in this process, before anything compiles
    (torch.compile picks the kernel when it traces). For the benchmarks to compare them on one card: with a mask,
    which every step here has, SDPA prefers cuDNN on Hopper, whose call adds a memset kernel per layer; the
    memory-efficient kernel drops the memset but is slower a layer and its output needs a layout copy."""
    unknown = set(backends) - set(SDPA_BACKENDS)
    if unknown or not backends:
        raise ValueError(f"SDPA backends must be among {sorted(SDPA_BACKENDS)}, got {list(backends)}")
    for name, switch in SDPA_BACKENDS.items():
        getattr(torch.backends.cuda, switch)(name in backends)
