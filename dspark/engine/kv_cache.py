"""Preallocated, position-indexed KV cache with per-request lengths.

Shapes: NL layers, B requests, Hkv key/value heads, Tmax positions, D head dim, T tokens in a step.

`lengths[b]` is the number of committed positions of request b. A step writes keys/values for its T tokens at
positions lengths[b] + t whatever is valid (padding writes garbage past the valid end, which no valid query ever
attends to and the next step overwrites). Rolling back rejected drafts is therefore only moving a length: nothing
is erased. why: fixed shapes, no per-request Python loop and no bookkeeping outside tensors, so a captured CUDA
graph of the step replays exactly.
"""
from __future__ import annotations

import torch


def aligned_length(n: int) -> int:
    """n positions rounded up to a multiple of 64, the width every decode cache is allocated with. why: a captured
    round attends over the whole cache, and SDPA's fused kernels copy a padded mask per call (each layer) when the
    key length is not a multiple of their alignment (16 or more)."""
    return -(-n // 64) * 64


def slot_cache_length(longest: int, K: int) -> int:
    """Positions per slot of the slot engine's cache for requests whose prompt plus new-token budget is at most
    `longest`, drafting K tokens a round: room for a round of K drafts and the bonus token past the budget,
    aligned. The cost profiles allocate the same (verifiers.cost_model), so that they time the forwards the engine
    runs: a captured round attends over the whole cache, whose length is part of its cost."""
    return aligned_length(longest + K + 2)


class KVCache:
    """Keys and values of every layer for a batch of requests."""

    def __init__(self, *, num_layers: int, batch_size: int, num_kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        shape = (num_layers, batch_size, num_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # (NL, B, Hkv, Tmax, D)
        self.v = torch.zeros(shape, dtype=dtype, device=device)  # (NL, B, Hkv, Tmax, D)
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)  # (B,)

    @property
    def batch_size(self) -> int:
        return self.k.shape[1]

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    def positions(self, T: int) -> torch.Tensor:
        """(B, T) absolute positions of the next T tokens of every request."""
        return self.lengths.unsqueeze(1) + torch.arange(T, device=self.lengths.device)

    def window(self, start: torch.Tensor, T: int) -> torch.Tensor:
        """(B, T) positions start[b] .. start[b] + T - 1 of a write, those past the cache clamped to its last one.
        why: a drafter's observe writes padding rows past n_valid too, and a backlog observed in one call
        (Drafter.observe_batched) may pad past the end; the last position is never a committed one (a cache is
        sized with room beyond the longest context), so the clamped padding lands where nothing reads it."""
        return (start.unsqueeze(1) + torch.arange(T, device=start.device)).clamp(max=self.max_len - 1)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        """Store k, v (B, Hkv, T, D) of `layer` at `positions` (B, T)."""
        if torch.compiler.is_compiling():  # traced by torch.compile (a compiled drafter's propose or observe)
            index_write(self.k, layer, positions, k)
            index_write(self.v, layer, positions, v)
            return
        index = positions[:, None, :, None].expand_as(k)  # (B, Hkv, T, D)
        self.k[layer].scatter_(2, index, k)
        self.v[layer].scatter_(2, index, v)

    def advance(self, n: torch.Tensor) -> None:
        """Commit n (B,) more positions of each request (the rest of the last step is left to be overwritten)."""
        self.lengths += n

    def rollback(self, lengths: torch.Tensor) -> None:
        """Set every request's committed length to `lengths` (B,), dropping later positions."""
        self.lengths.copy_(lengths)

    def head(self, n: int) -> KVCache:
        """The first n batch rows as a cache of their own whose tensors are views of this one's (writes go here)."""
        part = KVCache.__new__(KVCache)
        part.k, part.v, part.lengths = self.k[:, :n], self.v[:, :n], self.lengths[:n]
        return part

    def select(self, rows: torch.Tensor) -> None:
        """Keep only batch rows `rows` (B',), in that order."""
        self.k = self.k.index_select(1, rows)
        self.v = self.v.index_select(1, rows)
        self.lengths = self.lengths.index_select(0, rows)


def index_write(cache: torch.Tensor, layer: int | torch.Tensor, positions: torch.Tensor, values: torch.Tensor) -> None:
    """cache (NL, B, Hkv, Tmax, D)[layer, b, :, positions[b, t]] = values[b, :, t] for values (B, Hkv, T, D): the
    write of KVCache.write as one index_put_ on the whole tensor, for code that torch.compile traces. why: inductor
    writes a mutated graph input in place, but a mutated view of one (the eager path's scatter into cache[layer])
    it copies out and back: the layer's whole cache, twice per write. `layer` may be a 0-dim index tensor (one
    compilation for every layer) or an int (made a tensor in the traced code, no kernel)."""
    B, _, T, _ = values.shape
    device = values.device
    if not isinstance(layer, torch.Tensor):
        layer = torch.full((), layer, dtype=torch.long, device=device)
    rows = torch.arange(B, device=device).view(B, 1, 1)
    heads = torch.arange(values.shape[1], device=device).view(1, -1, 1)
    cache.index_put_((layer, rows, heads, positions.reshape(B, 1, T)), values)
