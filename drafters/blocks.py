"""Decoder blocks shared by the trainable drafters: RMSNorm, SwiGLU MLP and the KV-injection attention layer.

Shapes: B requests, S block (query) slots, C context positions, T tokens of a training sequence, A anchors per
sequence, H hidden size (the host's), Hq query heads, Hkv key/value heads, D head dim, W cached positions.

KV injection (docs/DSPARK.md §2.2): queries come from the block only; keys/values are [K(H_ctx); K(H_block)] along the
sequence axis. Which keys a query may see is entirely the caller's additive mask, so one layer serves
  - DSpark/DFlash inference: the context K/V of every layer live in a preallocated `KVCache` written by position
    (rollback = moving a length, rows selectable); the block attends bidirectionally to itself and to context
    positions < anchor (`inference_mask`);
  - DSpark/DFlash training: many blocks of one sequence in one pass, block j seeing context < anchor_j of its own
    document and its own block (`block_training_mask`), no Python loop over blocks; on a GPU the same mask as a
    flex-attention BlockMask, which skips the fully masked tiles (`sparse_training_attention`);
  - MTP: a plain causal decoder layer (no context at training, its own earlier inputs as context at inference).
RoPE uses absolute positions (the host's own rotary module, so theta and any scaling match the host).
"""
from __future__ import annotations

import functools
import importlib.util
import os
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
from transformers.activations import ACT2FN

from dspark.engine.attention import grouped_attention, pack_mask
from dspark.engine.kv_cache import KVCache
from dspark.engine.rotary import rope


@dataclass(frozen=True)
class LayerShape:
    """The host's decoder-layer shape, which every drafter layer copies."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    hidden_act: str
    qk_norm: bool  # Qwen3-style RMSNorm of q and k per head

    @classmethod
    def of(cls, host) -> "LayerShape":
        config = host.config
        return cls(hidden_size=host.hidden_size, num_heads=host.num_heads, num_kv_heads=host.num_kv_heads,
                   head_dim=host.head_dim, intermediate_size=config.intermediate_size,
                   rms_norm_eps=config.rms_norm_eps, hidden_act=config.hidden_act,
                   qk_norm=config.model_type == "qwen3")


@dataclass
class SharedHost:
    """Frozen host modules a drafter borrows. Held in a plain dataclass, never registered as submodules, so they
    stay out of the drafter's parameters (hence the optimizer), state_dict and checkpoints."""

    embed_tokens: nn.Module  # token ids -> (..., H)
    lm_head: nn.Module  # (..., H) -> (..., V)
    rotary: nn.Module  # (x, positions (B, T)) -> cos, sin (B, T, D)

    @classmethod
    def of(cls, host) -> "SharedHost":
        return cls(embed_tokens=host.embed_tokens, lm_head=host.lm_head, rotary=host.rotary)

    def embed(self, tokens: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Frozen host embedding of token ids (...,) -> (..., H) in the drafter's dtype."""
        return self.embed_tokens(tokens).to(dtype)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Frozen LM head on final-normed drafter hidden (..., H) -> float32 logits (..., V). why the cast: the
        drafter keeps float32 master weights while the host may run in bf16."""
        return self.lm_head(h.to(self.lm_head.weight.dtype)).float()


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 like the Llama/Qwen hosts (stable under bf16)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class MLP(nn.Module):
    """The host's gated MLP: down(act(gate(x)) * up(x))."""

    def __init__(self, shape: LayerShape) -> None:
        super().__init__()
        H, I = shape.hidden_size, shape.intermediate_size
        self.gate_proj = nn.Linear(H, I, bias=False)
        self.up_proj = nn.Linear(H, I, bias=False)
        self.down_proj = nn.Linear(I, H, bias=False)
        self.act = ACT2FN[shape.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Boolean (B, S, W) -> additive (B, 1, S, W): 0 where allowed, the dtype's minimum elsewhere. why additive:
    every SDPA backend takes it, and a finite minimum never yields NaN (every query sees at least its own slot)."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min).unsqueeze(1)


class InjectionLayer(nn.Module):
    """A decoder layer of the host's shape whose attention keys/values are [K(context); K(block)]."""

    def __init__(self, shape: LayerShape, *, norm_context: bool = False) -> None:
        super().__init__()
        H, D = shape.hidden_size, shape.head_dim
        self.shape = shape
        # why: DFlash's context H_ctx is already normed by the drafter's context norm and is shared by all layers;
        # a plain decoder layer (MTP) instead sees its own earlier inputs, which go through its input norm
        self.norm_context = norm_context
        self.input_layernorm = RMSNorm(H, shape.rms_norm_eps)
        self.q_proj = nn.Linear(H, shape.num_heads * D, bias=False)
        self.k_proj = nn.Linear(H, shape.num_kv_heads * D, bias=False)
        self.v_proj = nn.Linear(H, shape.num_kv_heads * D, bias=False)
        self.o_proj = nn.Linear(shape.num_heads * D, H, bias=False)
        if shape.qk_norm:
            self.q_norm = RMSNorm(D, shape.rms_norm_eps)
            self.k_norm = RMSNorm(D, shape.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(H, shape.rms_norm_eps)
        self.mlp = MLP(shape)

    def _kv(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        B, T, _ = h.shape
        k = self.k_proj(h).view(B, T, self.shape.num_kv_heads, self.shape.head_dim)
        if self.shape.qk_norm:
            k = self.k_norm(k)
        v = self.v_proj(h).view(B, T, self.shape.num_kv_heads, self.shape.head_dim).transpose(1, 2)
        return rope(k.transpose(1, 2), cos, sin), v  # (B, Hkv, T, D) each

    def context_kv(self, ctx: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Keys and values (B, Hkv, C, D) of context ctx (B, C, H) at the positions cos/sin (B, C, D) encode."""
        return self._kv(self.input_layernorm(ctx) if self.norm_context else ctx, cos, sin)

    def forward(self, x: torch.Tensor, *, cos: torch.Tensor, sin: torch.Tensor,
                context: tuple[torch.Tensor, torch.Tensor] | None, mask: torch.Tensor | BlockMask,
                cache: tuple[KVCache, int, torch.Tensor] | None = None) -> torch.Tensor:
        """Block x (B, S, H) -> (B, S, H). context: (k, v) (B, Hkv, C, D) or None; mask additive (B, 1, S, C+S),
        or the BlockMask of the same allowed keys (`block_training_mask(..., sparse=True)`). In decoding, `cache`
        = (KVCache, this layer's index, the block's positions (B, S)) instead of context: the block's keys and
        values are written into the cache at those positions and the attention reads the cache alone, mask
        (B, 1, S, W) over its W positions (`cached_block_mask`)."""
        B, S, _ = x.shape
        shape = self.shape
        h = self.input_layernorm(x)
        q = self.q_proj(h).view(B, S, shape.num_heads, shape.head_dim)
        if shape.qk_norm:
            q = self.q_norm(q)
        q = rope(q.transpose(1, 2), cos, sin)  # (B, Hq, S, D)
        k, v = self._kv(h, cos, sin)  # (B, Hkv, S, D)
        if cache is not None:
            kv, index, positions = cache
            kv.write(index, k, v, positions)
            k, v = kv.k[index], kv.v[index]  # (B, Hkv, W, D)
        elif context is not None:
            k = torch.cat([context[0], k], dim=2)  # (B, Hkv, C+S, D)
            v = torch.cat([context[1], v], dim=2)
        gqa = shape.num_heads != shape.num_kv_heads
        if isinstance(mask, BlockMask):  # sparse training mask: the same keys allowed, masked tiles skipped
            o = _flex_attention(q.device.type)(q, k, v, block_mask=mask, scale=shape.head_dim ** -0.5,
                                               enable_gqa=gqa)
        elif gqa and not torch.is_grad_enabled():  # decoding: one fused kernel (dspark.engine.attention)
            groups = shape.num_heads // shape.num_kv_heads
            o = grouped_attention(q, k, v, pack_mask(mask.to(q.dtype), groups), shape.head_dim ** -0.5)
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.to(q.dtype), scale=shape.head_dim ** -0.5,
                                               enable_gqa=gqa)
        x = x + self.o_proj(o.transpose(1, 2).reshape(B, S, -1))
        return x + self.mlp(self.post_attention_layernorm(x))


class InjectionStack(nn.Module):
    """N injection layers and a final norm: the drafter backbone. One call = one backbone run."""

    def __init__(self, shape: LayerShape, num_layers: int, *, norm_context: bool = False) -> None:
        super().__init__()
        self.layers = nn.ModuleList(InjectionLayer(shape, norm_context=norm_context) for _ in range(num_layers))
        self.norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)

    def context_kv(self, ctx: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Per-layer (k, v) (B, Hkv, C, D) of context ctx (B, C, H)."""
        return [layer.context_kv(ctx, cos, sin) for layer in self.layers]

    @torch.no_grad()
    def init_from_host(self, host_layers) -> list[str]:
        """Copy the weights of the host's last len(self.layers) decoder layers (HF Llama / Qwen2 / Qwen3 names) into
        these layers, in order; returns what had no counterpart here and was left out (Qwen2's attention biases).
        A training-time initialisation (TrainConfig.init_layers_from_host), not an architecture change: the
        checkpoint is the same layers' weights either way."""
        dropped = []
        for mine, theirs in zip(self.layers, list(host_layers)[-len(self.layers):]):
            own = dict(mine.named_parameters())
            for name, weight in theirs.named_parameters():
                key = name.removeprefix("self_attn.")
                if key not in own or own[key].shape != weight.shape:
                    dropped.append(name)
                    continue
                own[key].copy_(weight.detach().to(own[key].dtype))
        return sorted(set(dropped))

    def write_context(self, cache: KVCache, ctx: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      positions: torch.Tensor) -> None:
        """Project ctx (B, T, H) into every layer's context K/V and store them at `positions` (B, T)."""
        for i, (k, v) in enumerate(self.context_kv(ctx, cos, sin)):
            cache.write(i, k, v, positions)

    def forward(self, x: torch.Tensor, *, cos: torch.Tensor, sin: torch.Tensor,
                context: list[tuple[torch.Tensor, torch.Tensor]] | None,
                mask: torch.Tensor | BlockMask, cache: tuple[KVCache, torch.Tensor] | None = None) -> torch.Tensor:
        """Block x (B, S, H) -> final-normed hidden (B, S, H). context: per-layer (k, v) or None; or, decoding,
        cache = (KVCache of every layer's context, the block's positions (B, S)): InjectionLayer's `cache`."""
        for i, layer in enumerate(self.layers):
            x = layer(x, cos=cos, sin=sin, context=None if context is None else context[i], mask=mask,
                      cache=None if cache is None else (cache[0], i, cache[1]))
        return self.norm(x)


def cached_context(cache: KVCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every layer's (k, v) (B, Hkv, W, D) over the whole cache. why the whole cache: a fixed shape (capturable);
    positions at or past each row's length are masked, so stale or padding entries never leak."""
    return [(cache.k[i], cache.v[i]) for i in range(cache.k.shape[0])]


def cached_block_mask(context_len: torch.Tensor, *, width: int, block: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive (B, 1, S, W) for S = `block` slots written into a cache of W positions at context_len + s: the
    same keys as inference_mask's (cached positions < context_len (B,) and the whole block), where they sit then.
    why a block in the cache: attending over [context; block] concatenates every layer's whole cache at each
    propose (a copy of the cache per layer and round), and W + S keys, unaligned, make SDPA pad the mask per call.
    The block's positions are past the context: every other read masks them until observe overwrites them with
    committed context (the drafter's cache holds a block of room past its longest context, DSparkDrafter.begin)."""
    key_pos = torch.arange(width, device=context_len.device)  # (W,)
    start = context_len.unsqueeze(1)  # (B, 1)
    allowed = key_pos < start + block  # (B, W): the context, then the block right after it
    return additive_mask(allowed.unsqueeze(1).expand(-1, block, width), dtype)


def inference_mask(context_len: torch.Tensor, *, width: int, block: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive (B, 1, S, W+S) for S = `block` slots: cached positions < context_len (B,) and the whole block."""
    B = context_len.shape[0]
    key_pos = torch.arange(width, device=context_len.device)  # (W,)
    ctx_ok = (key_pos < context_len.unsqueeze(1)).unsqueeze(1).expand(B, block, width)  # (B, S, W)
    blk_ok = torch.ones(B, block, block, dtype=torch.bool, device=context_len.device)  # (B, S, S)
    return additive_mask(torch.cat([ctx_ok, blk_ok], dim=-1), dtype)


_HAS_TRITON = importlib.util.find_spec("triton") is not None  # torch.compile's GPU backend


def sparse_training_attention(x: torch.Tensor) -> bool:
    """Whether block training on x uses the flex-attention BlockMask: on CUDA in 16-bit (bf16 / fp16 autocast, as
    `dspark train --bf16` runs), unless DSPARK_SPARSE_ATTENTION=0 (or `dspark train --sparse-attention false`, which
    sets the drafter's `sparse_attention` to False).

    why: the dense mask makes every block query score all T + A*S keys, of which it may see at most T + S (its own
    block's S among the A*S block slots, and only context before its anchor), so the cost grows as A^2; flex
    attention skips the fully masked 128 x 128 tiles (benchmarks/RESULTS.md has the measured step times).
    why not elsewhere: on a CPU flex attention has no compiled kernel and no backward; on the H200 (torch 2.11)
    inductor found no flex kernel configuration for fp32 inputs; without triton torch.compile has no GPU backend."""
    if x.device.type != "cuda" or os.environ.get("DSPARK_SPARSE_ATTENTION", "1") == "0" or not _HAS_TRITON:
        return False
    half = (torch.bfloat16, torch.float16)
    return x.dtype in half or (torch.is_autocast_enabled("cuda") and torch.get_autocast_dtype("cuda") in half)


@functools.cache
def _flex_attention(device_type: str):
    """flex_attention, compiled where a compiled kernel exists (CUDA); eager elsewhere (tests: same numbers)."""
    return torch.compile(flex_attention) if device_type == "cuda" else flex_attention


def block_training_mask(anchors: torch.Tensor, *, block_size: int, document_ids: torch.Tensor, dtype: torch.dtype,
                        sparse: bool = False) -> torch.Tensor | BlockMask:
    """Additive (B, 1, A*S, T + A*S) for A blocks of S = block_size slots laid out anchor-major; with sparse=True the
    flex-attention BlockMask of exactly the same allowed keys.

    Block j (anchored at anchors[b, j]) sees context positions t < anchor_j of the anchor's own document and the
    S slots of its own block (bidirectionally), nothing of the other blocks.
    """
    B, A = anchors.shape
    T = document_ids.shape[1]
    anchor_doc = document_ids.gather(1, anchors)  # (B, A)
    if sparse:
        slot_anchor = anchors.repeat_interleave(block_size, dim=1)  # (B, A*S) the anchor of each query slot
        slot_doc = anchor_doc.repeat_interleave(block_size, dim=1)  # (B, A*S)

        def allowed(b, h, q, kv):  # flex mask_mod: scalar indices in, bool out (flex vectorises it)
            t = kv.clamp(max=T - 1)
            context = (kv < T) & (t < slot_anchor[b, q]) & (document_ids[b, t] == slot_doc[b, q])
            return context | ((kv >= T) & ((kv - T) // block_size == q // block_size))

        return create_block_mask(allowed, B, None, A * block_size, T + A * block_size, device=anchors.device)
    t = torch.arange(T, device=anchors.device)
    ctx_ok = (t.view(1, 1, T) < anchors.unsqueeze(2)) & (document_ids.unsqueeze(1) == anchor_doc.unsqueeze(2))
    ctx_ok = ctx_ok.repeat_interleave(block_size, dim=1)  # (B, A*S, T)
    block_of = torch.arange(A, device=anchors.device).repeat_interleave(block_size)  # (A*S,)
    blk_ok = (block_of.unsqueeze(1) == block_of.unsqueeze(0)).expand(B, A * block_size, A * block_size)
    return additive_mask(torch.cat([ctx_ok, blk_ok], dim=-1), dtype)


def causal_mask(document_ids: torch.Tensor, *, dtype: torch.dtype) -> torch.Tensor:
    """Additive (B, 1, T, T): each position sees the earlier positions of its own document and itself."""
    T = document_ids.shape[1]
    t = torch.arange(T, device=document_ids.device)
    allowed = (t.view(1, T) <= t.view(T, 1)) & (document_ids.unsqueeze(2) == document_ids.unsqueeze(1))
    return additive_mask(allowed, dtype)
