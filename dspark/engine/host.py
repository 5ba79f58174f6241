"""The host adapter: one batched, ragged forward over any Llama-family Hugging Face causal LM.

Shapes: B requests, T tokens in a step, H hidden size, F = m*H concatenated taps of m layers, V vocabulary.

`Host.step` runs the host's own modules (embedding, each decoder layer's norms, projections and MLP, rotary
embedding, final norm) against `KVCache`, verifying a different number of tokens per request in one forward.
why: transformers' Cache classes change between releases and have no per-row rollback; driving the modules
directly keeps one fixed-shape step (graph-capturable: positions and masks come from tensors, no per-request
Python) and works unchanged on transformers 5.17 and later. Logits match a plain transformers forward
(tests/test_host.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dspark.engine.attention import grouped_attention, pack_mask
from dspark.engine.compiled import COMPILE_MAX_T, CompiledLayers, auto, supported
from dspark.engine.kv_cache import KVCache
from dspark.engine.rotary import rope

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")


@dataclass
class StepOutput:
    hidden: torch.Tensor  # (B, T, H) after the final norm
    features: torch.Tensor | None  # (B, T, F) raw outputs of the tapped layers, concatenated; None without taps


def document_positions(document_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) position of each token inside its document: packed documents restart at 0."""
    B, T = document_ids.shape
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    index = torch.arange(T, device=document_ids.device).expand(B, T)
    first = torch.cummax(torch.where(starts, index, torch.zeros_like(index)), dim=1).values
    return index - first  # (B, T)


def _rms_norm(norm, x: torch.Tensor) -> torch.Tensor:
    """A Llama-family RMSNorm module applied to x: one fused kernel on CUDA, the module itself elsewhere."""
    if x.device.type != "cuda" or not hasattr(norm, "variance_epsilon"):
        return norm(x)
    # as the module: normalise in float32, back to the input dtype, then scale by the weight
    return norm.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=norm.variance_epsilon).to(x.dtype)


def _norm_one_kernel(norm, x: torch.Tensor) -> torch.Tensor:
    """A Llama-family RMSNorm module applied to x in one call (on CUDA one fused kernel, weight included), for the
    fused layers. Rounds once where the module rounds twice (normalised x to x's dtype, then times the weight):
    the same in float32, within a unit of the last place in bfloat16."""
    if not hasattr(norm, "variance_epsilon"):
        return norm(x)
    return F.rms_norm(x, (x.shape[-1],), norm.weight, eps=norm.variance_epsilon)


def _rope_rolled(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """rope(x, cos, sin) in three kernels instead of five: rotate_half(x) * sin = roll(x, D/2) * signed_sin, with
    signed_sin = sin with its first half negated (`_signed_sin`, once per step). x (B, heads, T, D)."""
    return torch.addcmul(x * cos.unsqueeze(1), x.roll(x.shape[-1] // 2, dims=-1), signed_sin.unsqueeze(1))


def _linear_plus(x: torch.Tensor, y: torch.Tensor, linear) -> torch.Tensor:
    """x + linear(y) for x (B, T, H), y (B, T, I): one GEMM with the residual as its input (addmm) where the
    projection has no bias. Rounds once where x + linear(y) rounds twice (the same in float32)."""
    if linear.bias is not None:
        return x + linear(y)
    B, T, H = x.shape
    return torch.addmm(x.reshape(B * T, H), y.reshape(B * T, -1), linear.weight.t()).view(B, T, H)


def _signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """sin (..., D) with its first half negated: rotate_half(x) = cat(-x2, x1) = roll(x, D/2) * [-1, +1]."""
    half = sin.shape[-1] // 2
    return torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)


def _bucket(n: int, size: int = 64) -> int:
    """Round n up to a multiple of `size`. why: the eager path attends over a prefix of the cache; bucketing keeps
    the set of shapes small (for kernel caches and later graph capture)."""
    return -(-n // size) * size


class Host:
    """A frozen causal LM with a ragged verify step, hidden-layer taps and its embedding/LM head for drafters."""

    def __init__(self, model, tokenizer=None, *, name: str = "host", compile: bool | None = None) -> None:
        config = model.config
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"host architecture '{config.model_type}' is not supported; supported model types: "
                             f"{', '.join(SUPPORTED_MODEL_TYPES)} (Llama/Qwen2/Qwen3/Mistral family)")
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.name = name
        self.config = config
        inner = model.model
        self.embed_tokens = inner.embed_tokens
        self.layers = inner.layers
        self.final_norm = inner.norm
        self.rotary = inner.rotary_emb
        self.lm_head = model.lm_head
        self.vocab_size = config.vocab_size
        self.hidden_size = config.hidden_size
        self.num_layers = config.num_hidden_layers
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = self.layers[0].self_attn.head_dim
        self.max_context = config.max_position_embeddings
        self.windows = self._sliding_windows(config)
        # decode steps (T <= COMPILE_MAX_T) through torch.compile'd layer pieces (dspark.engine.compiled), and the
        # drafter's propose and observe with them: True / False, or None = on CUDA when supported (`compiling`)
        self.compile = compile
        if compile and supported(self) is not None:
            raise ValueError(f"host '{name}' cannot run compiled layers: {supported(self)}")

    def _sliding_windows(self, config) -> list[int | None]:
        """Per-layer sliding-window size (None = full attention), as the config declares it."""
        window = config.sliding_window if "sliding_window" in config.to_dict() else None
        layer_types = config.to_dict().get("layer_types")
        if layer_types is not None:
            return [window if kind == "sliding_attention" else None for kind in layer_types]
        if config.model_type == "mistral":
            return [window] * self.num_layers
        return [None] * self.num_layers

    @property
    def compiling(self) -> bool:
        """Whether decode steps run compiled: `compile` when set, else dspark.engine.compiled.auto (CUDA)."""
        return auto(self) if self.compile is None else self.compile

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def stop_token_ids(self) -> set[int]:
        """End-of-sequence ids from the generation config, the model config and the tokenizer."""
        ids: set[int] = set()
        sources = [self.model.generation_config.eos_token_id, self.config.eos_token_id]
        if self.tokenizer is not None:
            sources.append(self.tokenizer.eos_token_id)
        for eos in sources:
            if eos is None:
                continue
            ids.update(eos if isinstance(eos, (list, tuple)) else [eos])
        return ids

    def new_cache(self, batch_size: int, max_len: int) -> KVCache:
        """A zeroed cache for `batch_size` requests of at most `max_len` positions."""
        return KVCache(num_layers=self.num_layers, batch_size=batch_size, num_kv_heads=self.num_kv_heads,
                       max_len=max_len, head_dim=self.head_dim, dtype=self.dtype, device=self.device)

    def check_taps(self, taps: tuple[int, ...]) -> None:
        if len(set(taps)) != len(taps):
            raise ValueError(f"feature layers {list(taps)} repeat a layer")
        bad = [i for i in taps if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"feature layers {bad} do not exist in host '{self.name}' "
                             f"({self.num_layers} layers, valid 0..{self.num_layers - 1})")

    @torch.no_grad()
    def step(self, cache: KVCache, tokens: torch.Tensor, n_valid: torch.Tensor, *, taps: tuple[int, ...] = (),
             attend: int | None = None, fused: bool | None = None, compiled: bool | None = None) -> StepOutput:
        """One forward of tokens (B, T) at positions cache.lengths + t; the first n_valid[b] of row b are real.

        Writes the KV of all T tokens (padding too, harmlessly, past the valid end) and does not advance the
        cache. `attend` (a Python int) limits attention to the first `attend` cache positions (eager speed on
        long caches); None attends over the whole cache (fixed shape, for graph capture). `fused` runs each layer
        with fewer kernels (_fused_layer); None = on CUDA only. `compiled` runs the torch.compile'd layers instead
        (dspark.engine.compiled); None = when `self.compiling` and the step is decode-sized (T <=
        COMPILE_MAX_T). Prefills pass False: every prompt length would be one more compilation.
        """
        B, T = tokens.shape
        positions = cache.positions(T)  # (B, T)
        if positions.device.type == "cpu" and int(positions[:, -1].max()) >= cache.max_len:
            raise ValueError(f"KV cache of {cache.max_len} positions is full: a step of {T} tokens at length "
                             f"{int(cache.lengths.max())} does not fit")
        W = cache.max_len if attend is None else min(cache.max_len, _bucket(attend))
        key_pos = torch.arange(W, device=tokens.device).expand(B, W)  # (B, W)

        def kv(i: int, k: torch.Tensor, v: torch.Tensor):
            cache.write(i, k, v, positions)
            return cache.k[i][:, :, :W], cache.v[i][:, :, :W]  # (B, Hkv, W, D)

        fused = tokens.device.type == "cuda" if fused is None else fused
        compiled = self.compiling and T <= COMPILE_MAX_T if compiled is None else compiled
        return self._run(tokens, positions, key_pos, None, kv, taps, fused=fused, compiled=compiled, cache=cache)

    def forward(self, tokens: torch.Tensor, *, document_ids: torch.Tensor | None = None,
                taps: tuple[int, ...] = ()) -> StepOutput:
        """Cache-free causal forward of tokens (B, T) for training: every position sees the earlier positions of
        its own document (document_ids (B, T); packed sequences restart positions per document). Differentiable
        through nothing (the host is frozen) but usable under autocast."""
        B, T = tokens.shape
        if document_ids is None:
            document_ids = torch.zeros(B, T, dtype=torch.long, device=tokens.device)
        positions = document_positions(document_ids)  # (B, T) position inside the document
        index = torch.arange(T, device=tokens.device).expand(B, T)
        same_doc = document_ids.unsqueeze(2) == document_ids.unsqueeze(1)  # (B, T, T)
        with torch.no_grad():
            return self._run(tokens, positions, index, same_doc, lambda i, k, v: (k, v), taps, key_is_query=True)

    def _inputs(self, tokens, positions, key_pos, same_doc=None, key_is_query: bool = False, pack: bool = False):
        """(x (B, T, H) the embedded tokens, cos, sin (B, T, D), each attention window's additive mask (B, 1, T, W),
        and with `pack` those masks through attention.pack_mask, else None)."""
        T = tokens.shape[1]
        x = self.embed_tokens(tokens)  # (B, T, H)
        cos, sin = self.rotary(x, positions)  # (B, T, D)
        query_pos = key_pos[:, :T] if key_is_query else positions  # index used for causality
        causal = key_pos.unsqueeze(1) <= query_pos.unsqueeze(-1)  # (B, T, W)
        if same_doc is not None:
            causal = causal & same_doc
        masks: dict[int | None, torch.Tensor] = {}
        for window in self.windows:
            if window not in masks:
                allowed = causal if window is None else causal & (key_pos.unsqueeze(1) > query_pos.unsqueeze(-1) - window)
                # additive mask (0 / very negative): works with every SDPA backend and never yields NaN, since
                # every query attends at least to its own position
                masks[window] = torch.zeros(allowed.shape, dtype=x.dtype, device=x.device).masked_fill_(
                    ~allowed, torch.finfo(x.dtype).min).unsqueeze(1)  # (B, 1, T, W)
        packed = None
        if pack:
            groups = self.num_heads // self.num_kv_heads
            packed = {window: pack_mask(mask, groups) for window, mask in masks.items()}
        return x, cos, sin, masks, packed

    def _run(self, tokens, positions, key_pos, same_doc, kv, taps, key_is_query: bool = False,
             fused: bool = False, compiled: bool = False, cache: KVCache | None = None) -> StepOutput:
        """The layers: queries at `positions` (B, T); keys at `key_pos` (B, W) from kv(layer, k, v). `compiled`
        (decode steps, which pass their `cache`) writes the keys and values inside the compiled pieces instead."""
        # compiled and fused layers attend through dspark.engine.attention: their masks are packed once per step
        if compiled:  # decode steps: the inputs and the layers through compiled pieces (dspark.engine.compiled)
            layers = self._compiled_layers()
            x, cos, sin, _, packed = layers.inputs(self, tokens, positions, key_pos)
            hidden, tapped = layers.run(self, x, cos, sin, packed, cache, positions, key_pos.shape[1], taps)
            return StepOutput(hidden=hidden, features=self._features(tapped, taps))
        x, cos, sin, masks, packed = self._inputs(tokens, positions, key_pos, same_doc, key_is_query, pack=fused)
        if fused:
            tapped, signed_sin = [], _signed_sin(sin)
            for i, layer in enumerate(self.layers):
                x = self._fused_layer(i, layer, x, cos, signed_sin, packed[self.windows[i]], kv)
                if i in taps:
                    tapped.append(x)
            hidden = _norm_one_kernel(self.final_norm, x)
        else:
            tapped = []
            for i, layer in enumerate(self.layers):
                x = self._layer(i, layer, x, cos, sin, masks[self.windows[i]], kv)
                if i in taps:
                    tapped.append(x)
            hidden = self.final_norm(x)
        return StepOutput(hidden=hidden, features=self._features(tapped, taps))

    @staticmethod
    def _features(tapped: list[torch.Tensor], taps: tuple[int, ...]) -> torch.Tensor | None:
        """The tapped layers' outputs (in layer order) concatenated in the order `taps` names them: (B, T, F)."""
        if not taps:
            return None
        order = {layer_index: n for n, layer_index in enumerate(sorted(taps))}
        return torch.cat([tapped[order[i]] for i in taps], dim=-1)

    def _layer(self, i: int, layer, x, cos, sin, mask, kv) -> torch.Tensor:
        """Decoder layer i on x (B, T, H) through its own modules (the reference path; CPU)."""
        B, T, _ = x.shape
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        q = attn.q_proj(h).view(B, T, self.num_heads, self.head_dim)
        k = attn.k_proj(h).view(B, T, self.num_kv_heads, self.head_dim)
        v = attn.v_proj(h).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if self.config.model_type == "qwen3":
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # (B, heads, T, D)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        return self._attend_and_mlp(i, layer, x, q, k, v, mask, kv, mlp=lambda y: layer.mlp(y))

    def _attend_and_mlp(self, i, layer, x, q, k, v, mask, kv, mlp) -> torch.Tensor:
        B, T, _ = x.shape
        attn = layer.self_attn
        keys, values = kv(i, k, v)
        o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask.to(q.dtype), scale=attn.scaling,
                                           enable_gqa=self.num_heads != self.num_kv_heads)
        x = x + attn.o_proj(o.transpose(1, 2).reshape(B, T, -1))
        return x + mlp(_rms_norm(layer.post_attention_layernorm, x))

    def _fused_layer(self, i: int, layer, x, cos, signed_sin, packed_mask, kv) -> torch.Tensor:
        """The same layer with fewer kernels (CUDA): one q|k|v projection, one gate|up projection, each RMSNorm one
        call with its weight, one rotary over q and k together (rolled: `_rope_rolled`), grouped query heads packed
        into one fused attention kernel (dspark.engine.attention; `packed_mask` from pack_mask), and the residual
        adds in the output projections' GEMMs (addmm). why: a small host's step is bound by the number of kernels
        it launches (~26 per layer before these, by count), not by its weights; a CUDA graph removes launch gaps but
        not kernels. Same math as _layer up to the rounding of the fused kernels (tests/test_engine.py compares both
        in float32 and bfloat16). `signed_sin`: the step's sin through _signed_sin."""
        B, T, _ = x.shape
        attn, mlp, (w_qkv, b_qkv, w_gu) = layer.self_attn, layer.mlp, self._fused_weights(i)
        Hq, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = F.linear(_norm_one_kernel(layer.input_layernorm, x), w_qkv, b_qkv).view(B, T, Hq + 2 * Hkv, D)
        qkv = qkv.transpose(1, 2)  # (B, Hq + 2 Hkv, T, D)
        qk, v = qkv[:, : Hq + Hkv], qkv[:, Hq + Hkv:]
        if self.config.model_type == "qwen3":
            qk = torch.cat([attn.q_norm(qk[:, :Hq].transpose(1, 2)).transpose(1, 2),
                            attn.k_norm(qk[:, Hq:].transpose(1, 2)).transpose(1, 2)], dim=1)
        qk = _rope_rolled(qk, cos, signed_sin)  # q and k rotated together
        keys, values = kv(i, qk[:, Hq:], v)
        o = grouped_attention(qk[:, :Hq], keys, values, packed_mask, attn.scaling)  # (B, Hq, T, D)
        x = _linear_plus(x, o.transpose(1, 2).reshape(B, T, Hq * D), attn.o_proj)
        h = _norm_one_kernel(layer.post_attention_layernorm, x)
        if w_gu is None:
            return x + mlp(h)
        gate, up = F.linear(h, w_gu).chunk(2, dim=-1)
        return _linear_plus(x, mlp.act_fn(gate) * up, mlp.down_proj)

    def _compiled_layers(self) -> CompiledLayers:
        """The compiled layer pieces (built on first use, rebuilt when the weights moved device or dtype)."""
        weight = self.layers[0].self_attn.q_proj.weight
        key = (weight.device, weight.dtype)  # as _fused_weights keys its cache
        compiled = self.__dict__.get("_compiled")
        if compiled is None or compiled.key != key:
            self._fused_weights(0)  # gathers at the current device and dtype
            compiled = self._compiled = CompiledLayers(self)
        return compiled

    def _fused_weights(self, i: int):
        """(q|k|v weight, its bias or None, gate|up weight or None) of layer i, concatenated once per device and
        dtype (the host is frozen: its weights never change after loading)."""
        layer = self.layers[i]
        key = (layer.self_attn.q_proj.weight.device, layer.self_attn.q_proj.weight.dtype)
        cache = self.__dict__.setdefault("_fused", {})
        if cache.get("key") != key:
            cache.clear()
            cache["key"] = key
        if i not in cache:
            a, mlp = layer.self_attn, layer.mlp
            projections = (a.q_proj, a.k_proj, a.v_proj)
            bias = None if a.q_proj.bias is None else torch.cat([p.bias for p in projections])
            gate_up = None
            if hasattr(mlp, "gate_proj") and mlp.gate_proj.bias is None and mlp.up_proj.bias is None:
                gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
            cache[i] = (torch.cat([p.weight for p in projections]), bias, gate_up)
        return cache[i]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM head on final-normed hidden (..., H) -> float32 logits (..., V)."""
        return self.lm_head(hidden).float()
