"""Decode steps with fewer kernels: the dense math of every decoder layer through torch.compile (inductor).

Shapes: B requests, T tokens in a step, H hidden size, Hq / Hkv query / key-value heads, D head dim, W cache
positions attended.

why: a small host's verify step is bound by the number of kernels it launches, not by its weights: even replayed
as a CUDA graph, a SmolLM2 step takes far longer than reading its weights once (benchmarks/results/round-profile/
has the kernel census, eager and compiled); a graph removes launch gaps but not kernels, and eagerly each layer
runs ~25 (norms in float32, rotary, residual adds, SiLU times up, between five GEMMs).
Inductor fuses that elementwise work into a few generated kernels around the GEMMs, which cuBLAS still runs.

The seam between layers: layer i's output projection, residual, MLP and residual are compiled together with layer
i + 1's input norm, q|k|v projection, q/k norms (Qwen3), rotary and KV-cache write (`mid`), so a residual add and the
next norm are one kernel, and so are the rotary of k and its write into the cache; the last layer's piece ends with
the final norm. The write is an `index_put_` on the whole cache tensor with the layer as an index tensor: inductor
writes a graph input in place (an in-place scatter into a view of the cache, as KVCache.write does, made it copy
that layer's cache out and back). Left outside the compiled pieces, between them: attention (SDPA, one fused kernel
with the query heads packed: dspark.engine.attention), whose packed output the next piece unpacks. Before the
first layer, a fourth piece makes the step's inputs (embedding, rotary, the packed masks: Host._inputs). The pieces
are compiled per Host and shared by all layers (the weights are arguments, the head counts constants of the closure).
Shapes: torch.compile's default, static for the first step shape and dynamic in the tokens from the second on, so a
run over several concurrencies and verify widths compiles each piece about twice, not once per shape (each
compilation costs seconds of warm-up). Only decode steps use them (Host.step: T <= COMPILE_MAX_T, and never a
prefill); prefills run the eager layers.

It pays under CUDA graphs (the slot engine's default on CUDA), where the pieces run only while a round is captured;
called eagerly, every piece also pays dynamo's guard check per call (one per layer and one per step).

Same math as Host._layer up to the rounding of fused kernels: tests/test_compiled.py compares logits and greedy
tokens with the eager step in float32 on the CPU (where inductor generates C++).
"""
from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F

from dspark.engine.attention import grouped_attention, unpack_heads
from dspark.engine.kv_cache import index_write
from dspark.engine.rotary import rope

COMPILE_MAX_T = 16  # widest step that runs compiled by default: verify widths (K + 1 <= 16), not prefills
# why raised: dynamo recompiles a piece when a guard fails (a first static shape, then a dynamic one; sizes 0 and 1
# are always their own) and by default gives up after 8, falling back to eager for good
RECOMPILE_LIMIT = 64


HAS_TRITON = importlib.util.find_spec("triton") is not None  # torch.compile's GPU backend


def auto(host) -> bool:
    """Whether a host left to choose (`Host(compile=None)`, the default) runs compiled decode steps: on CUDA, where
    the captured rounds replay them (benchmarks/results/round-profile/: faster at every concurrency and drafter there),
    when the host is supported and triton (torch.compile's GPU backend) is installed."""
    return host.device.type == "cuda" and HAS_TRITON and supported(host) is None


def supported(host) -> str | None:
    """Why `host` cannot run compiled layers, or None when it can."""
    config = host.config
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation '{config.hidden_act}' (compiled layers implement SiLU-gated MLPs)"
    for layer in host.layers:
        mlp = layer.mlp
        if not hasattr(mlp, "gate_proj") or mlp.gate_proj.bias is not None or mlp.up_proj.bias is not None:
            return "an MLP without a bias-free gate/up pair"
    return None


class CompiledLayers:
    """The compiled pieces for one host, and its per-layer weights in the order the pieces take them."""

    def __init__(self, host) -> None:
        reason = supported(host)
        if reason is not None:
            raise ValueError(f"host '{host.name}' cannot run compiled layers: {reason}")
        eps, Hq, Hkv, D = host.config.rms_norm_eps, host.num_heads, host.num_kv_heads, host.head_dim
        qk_norm = host.config.model_type == "qwen3"

        def rms(x, weight):  # as transformers' RMSNorm: normalise in float32, back to x's dtype, then scale
            xf = x.float()
            return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)

        def attn_in(x, cos, sin, norm, w_qkv, b_qkv, q_norm, k_norm, cache_k, cache_v, layer, positions):
            """q (B, Hq, T, D) of layer `layer` (a 0-dim tensor), its keys and values written into the cache."""
            B, T, _ = x.shape
            q, k, v = F.linear(rms(x, norm), w_qkv, b_qkv).view(B, T, Hq + 2 * Hkv, D).split([Hq, Hkv, Hkv], 2)
            if qk_norm:
                q, k = rms(q, q_norm), rms(k, k_norm)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, heads, T, D)
            # the KV-cache write inside the compiled piece, in place and fused with the rotary that makes k (the
            # layer an index tensor: one compilation serves every layer)
            index_write(cache_k, layer, positions, rope(k, cos, sin))
            index_write(cache_v, layer, positions, v)
            # why contiguous: rotary writes q in this layout at no cost, and grouped_attention's packing of the query
            # heads is then a view; from the transposed layout it is a copy kernel per layer whenever T > 1 (a
            # verify step; at T = 1 both layouts are the same)
            return rope(q, cos, sin).contiguous()

        def attn_out_mlp(x, o, w_o, b_o, norm, w_gu, w_down, b_down):
            # o: grouped_attention's packed output (B, Hkv, g * T, D)
            x = x + F.linear(unpack_heads(o, Hq, x.shape[1]), w_o, b_o)
            gate, up = F.linear(rms(x, norm), w_gu).chunk(2, dim=-1)
            return x + F.linear(F.silu(gate) * up, w_down, b_down)

        def mid(x, o, cos, sin, post, pre, write):
            x = attn_out_mlp(x, o, *post)
            return x, attn_in(x, cos, sin, *pre, *write)

        def last(x, o, post, final_norm):
            x = attn_out_mlp(x, o, *post)
            return x, rms(x, final_norm)

        def inputs(host, tokens, positions, key_pos):  # Host._inputs of a decode step: embedding, rotary, masks
            return host._inputs(tokens, positions, key_pos, pack=True)

        self.first, self.mid, self.last = (torch.compile(f) for f in (attn_in, mid, last))
        self.inputs = compiled(inputs)  # Host._inputs of a decode step: the embedding, rotary and masks compiled
        self.pre, self.post = [], []
        for i, layer in enumerate(host.layers):
            a, mlp = layer.self_attn, layer.mlp
            w_qkv, b_qkv, w_gu = host._fused_weights(i)
            self.pre.append((layer.input_layernorm.weight, w_qkv, b_qkv,
                             a.q_norm.weight if qk_norm else None, a.k_norm.weight if qk_norm else None))
            self.post.append((a.o_proj.weight, a.o_proj.bias, layer.post_attention_layernorm.weight, w_gu,
                              mlp.down_proj.weight, mlp.down_proj.bias))
        self.final_norm = host.final_norm.weight
        self.num_layers = len(host.layers)
        weight = host.layers[0].self_attn.q_proj.weight
        self.key = (weight.device, weight.dtype)  # the device and dtype the weights were gathered at

    def run(self, host, x, cos, sin, packed, cache, positions, W, taps):
        """Every layer on x (B, T, H) at `positions` (B, T), writing their keys and values into `cache` (a KVCache)
        and attending over its first W positions: (final-normed hidden, the tapped layers' outputs in layer
        order). packed: each attention window's mask through attention.pack_mask."""
        n, tapped = len(host.layers), []
        layers = self._layer_index(x.device)
        write = lambda i: (cache.k, cache.v, layers[i], positions)  # noqa: E731
        with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
            q = self.first(x, cos, sin, *self.pre[0], *write(0))
            for i, layer in enumerate(host.layers):
                keys, values = cache.k[i][:, :, :W], cache.v[i][:, :, :W]  # (B, Hkv, W, D)
                o = grouped_attention(q, keys, values, packed[host.windows[i]], layer.self_attn.scaling,
                                      packed_output=True)
                if i + 1 < n:
                    x, q = self.mid(x, o, cos, sin, self.post[i], self.pre[i + 1], write(i + 1))
                    hidden = None
                else:
                    x, hidden = self.last(x, o, self.post[i], self.final_norm)
                if i in taps:
                    tapped.append(x)
        return hidden, tapped

    def _layer_index(self, device) -> list[torch.Tensor]:
        """Each layer's index as a 0-dim tensor on `device` (made once): the compiled pieces take the layer as a
        tensor, not a Python int they would specialise on (a compilation per layer)."""
        index = self.__dict__.get("_index")
        if index is None or index[0].device != device:
            index = self._index = [torch.tensor(i, device=device) for i in range(self.num_layers)]
        return index


def drafter_fn(drafter, method: str, host, greedy: bool = True):
    """The drafter's `propose` or `observe` as the engine runs it over `host`: through torch.compile when the host
    runs compiled (Host.compiling), the drafter is tensor-only (`capturable`) and allows it (`compile_whole`), and,
    for propose, decoding is greedy; else the eager method. Compiled once per
    drafter object and method (kept on it) and shared by every run.

    why: a captured round's propose stage is a chain of small kernels (a drafter's layers, then K sequential head or
    draft steps over the vocabulary; the n-gram's unfold-compare-max per n), and observe (in the accept stage)
    projects the new features through every drafter layer into its cache; like the host's step they are bound by
    the number of kernels (benchmarks/results/round-profile/ counts them, eager and compiled), and inductor fuses
    the elementwise work around the GEMMs. why greedy only for propose: the sampled path's counter-based noise
    (int64 splitmix64 over the vocabulary) crashes inductor's CPU code generation (torch 2.13), and the speed claims
    are greedy; sampled proposals run the eager method.

    Same math as the eager methods up to the rounding of fused kernels: tests/test_compiled.py compares the tokens
    in float32 on the CPU."""
    eager = getattr(drafter, method)
    whole = getattr(drafter, "capturable", False) and getattr(drafter, "compile_whole", True)
    if not (host.compiling and whole) or (method == "propose" and not greedy):
        return eager
    key = f"_compiled_{method}"
    if key not in drafter.__dict__:
        drafter.__dict__[key] = compiled(eager)
    return drafter.__dict__[key]


def commit_fn(commit, host, greedy: bool):
    """dspark.engine.round._commit (acceptance and the commit of tokens) as the engine runs it over `host`: through
    torch.compile (compiled once per process) when the host runs compiled and decoding is greedy, else itself.
    why: like the other stages, a round's accept is a chain of small kernels (argmax over the vocabulary, the
    accepted-prefix count, the scatter of the new tokens, the packing of the round's output;
    benchmarks/results/round-profile/ counts them), which inductor fuses. Greedy only, as drafter_fn's propose."""
    if not (host.compiling and greedy):
        return commit
    if commit not in _COMPILED:
        _COMPILED[commit] = compiled(commit)
    return _COMPILED[commit]


_COMPILED: dict = {}  # commit_fn's compiled functions, by the function compiled


def set_inductor(settings) -> dict:
    """Set torch._inductor.config options for this process from "key=value" strings (values as Python literals,
    e.g. "combo_kernels=True"), before anything compiles; returns them parsed. For the benchmarks to try inductor's
    options on one card (benchmarks/round_profile.py and speed.py, --inductor); an unknown key is an error."""
    import ast

    import torch._inductor.config as config

    parsed = {}
    for item in settings:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"inductor settings are key=value, got {item!r}")
        try:
            parsed[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            raise ValueError(f"inductor setting {key}: {value!r} is not a Python literal") from None
    for key, value in parsed.items():
        if key not in config._config:  # config's own list of options (dotted for sub-configs, e.g. triton.cudagraphs)
            raise ValueError(f"torch._inductor.config has no option {key!r}")
        owner, _, attr = key.rpartition(".")
        setattr(getattr(config, owner) if owner else config, attr, value)
    return parsed


def compiled(fn):
    """torch.compile(fn), called with dynamo's recompile limit raised to RECOMPILE_LIMIT (see there)."""
    inner = torch.compile(fn)

    def run(*args, **kwargs):
        with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
            return inner(*args, **kwargs)

    return run
