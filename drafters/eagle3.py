"""EAGLE-3 drafter (DSPARK.md §2.4): one decoder layer over fused host features, drafting autoregressively.

Shapes: B requests, T tokens, K draft positions, V vocabulary, H hidden size (the host's), F = m*H concatenated
host features of m layers, N attention heads, Nkv key/value heads, D head dim, W draft-cache positions,
S = ttt_length unrolled training steps.

Position i of the layer sees x_i = [norm(embed(token_{i+1})); norm(g_i)] (2H) in its q/k/v projections, with g_i
(the residual stream) either the fused host features fc(f_i) (context positions) or the layer's own output at
i - 1 (drafted positions); its output, final-normed through the host's frozen LM head, predicts token i+2.

Decoding keeps a one-layer draft KV cache by absolute position. `observe` runs the layer over newly committed
positions from their true host features (the token after each is already committed when the loop calls it) and
keeps the output at the last one; `propose` turns that output into x1 (step 1 sits at anchor-1 with the anchor as
input token), then feeds each output back as the next position's g. Drafted positions' keys are written past the
committed context and simply overwritten by the next `observe`: rollback is by position, nothing is erased.

Training (`training_loss`) is EAGLE-3's training-time test: S unrolled steps over a whole sequence at once, step j
using step j-1's outputs as g. Step j's query at index i stands for position i+j; it attends to step-0 keys
(true features) at indices <= i of its document and to steps 1..j's keys at index i only (the diagonal), exactly
what the drafter attends to at inference after j drafted positions. Loss: soft cross-entropy against the full host
distribution, step weights step_decay**j, on response tokens.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers.activations import ACT2FN

from drafters.base import DraftState, Drafter, Proposal, TrainBatch, TrainOutput
from dspark.host import _rotate_half
from dspark.kv_cache import KVCache
from dspark.sampling import STREAM_DRAFT, process, sample


def eagle3_feature_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's low/mid/high taps: outputs of host layers 1, L//2 - 1 and L - 4 (the original code captures the
    inputs of layers 2, L//2 and L - 3). Hosts too shallow for three distinct such layers get three evenly spread
    ones (fewer when L < 3)."""
    layers = (1, num_layers // 2 - 1, num_layers - 4)
    if layers[0] < layers[1] < layers[2]:
        return layers
    m = min(3, num_layers)
    if m == 1:
        return (0,)
    return tuple(sorted({round(i * (num_layers - 1) / (m - 1)) for i in range(m)}))


@dataclass
class Eagle3Config:
    """EAGLE-3 drafter settings. The layer's shape (H, heads, MLP width, norms, RoPE) is the host's."""

    feature_layers: tuple[int, ...] | None = None  # host layers fused as context; None = eagle3_feature_layers(L)
    ttt_length: int = 7  # training-time-test unroll S (DSPARK.md: equal to gamma)
    step_decay: float = 0.8  # weight of unrolled step j is step_decay**j

    def __post_init__(self) -> None:
        if self.feature_layers is not None:
            self.feature_layers = tuple(int(i) for i in self.feature_layers)  # JSON gives lists
        if self.ttt_length < 1:
            raise ValueError(f"ttt_length must be >= 1, got {self.ttt_length}")
        if not 0.0 < self.step_decay <= 1.0:
            raise ValueError(f"step_decay must be in (0, 1], got {self.step_decay}")


class Eagle3Layer(nn.Module):
    """The decoder layer: attention from [norm(embed); norm(g)] (2H -> heads), residual stream g, SwiGLU MLP."""

    def __init__(self, host) -> None:
        super().__init__()
        H, N, Nkv, D = host.hidden_size, host.num_heads, host.num_kv_heads, host.head_dim
        config = host.config
        eps = config.rms_norm_eps
        self.num_heads, self.num_kv_heads, self.head_dim = N, Nkv, D
        self.embed_norm = nn.RMSNorm(H, eps=eps)  # EAGLE-3's input_layernorm, on the token embedding
        self.hidden_norm = nn.RMSNorm(H, eps=eps)  # on the fused features / fed-back hidden
        self.q_proj = nn.Linear(2 * H, N * D, bias=False)
        self.k_proj = nn.Linear(2 * H, Nkv * D, bias=False)
        self.v_proj = nn.Linear(2 * H, Nkv * D, bias=False)
        self.o_proj = nn.Linear(N * D, H, bias=False)
        self.post_attention_norm = nn.RMSNorm(H, eps=eps)
        self.gate_proj = nn.Linear(H, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(H, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, H, bias=False)
        self.act = ACT2FN[config.hidden_act]

    def qkv(self, embeds: torch.Tensor, g: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """embeds, g (B, T, H); cos, sin (B, T, D) -> rotated q (B, N, T, D), k and v (B, Nkv, T, D)."""
        B, T, _ = g.shape
        x = torch.cat([self.embed_norm(embeds), self.hidden_norm(g)], dim=-1)  # (B, T, 2H)
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # (B, 1, T, D)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin, v

    def finish(self, g: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """Residual stream g (B, T, H) plus attention output (B, N, T, D), then the MLP -> (B, T, H)."""
        B, T, _ = g.shape
        h = g + self.o_proj(attended.transpose(1, 2).reshape(B, T, -1))
        x = self.post_attention_norm(h)
        return h + self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Eagle3Drafter(nn.Module, Drafter):
    """EAGLE-3 over a host: trainable fc + one layer + final norm; the host's embedding and LM head, frozen and
    not part of this module's parameters or state dict."""

    name = "eagle3"

    def __init__(self, host, config: Eagle3Config | None = None) -> None:
        nn.Module.__init__(self)
        config = config or Eagle3Config()
        layers = config.feature_layers or eagle3_feature_layers(host.num_layers)
        host.check_taps(layers)
        self.config = Eagle3Config(**{**asdict(config), "feature_layers": layers})
        self.host = host  # not an nn.Module: its weights stay out of parameters() and state_dict()
        self.feature_layers = layers
        H = host.hidden_size
        self.fc = nn.Linear(len(layers) * H, H, bias=False)  # fuse m host layers (F -> H)
        self.layer = Eagle3Layer(host)
        self.norm = nn.RMSNorm(H, eps=host.config.rms_norm_eps)
        self.to(host.device)
        self.cache: KVCache | None = None
        self.last_hidden: torch.Tensor | None = None  # (B, H) layer output at the last observed position

    # -- shared pieces ---------------------------------------------------------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.host.embed_tokens(tokens).to(self.dtype)  # (B, T, H)

    def _fuse(self, features: torch.Tensor) -> torch.Tensor:
        return self.fc(features.to(self.dtype))  # (B, T, H)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """Drafter output (..., H) -> float32 logits (..., V) through the host's frozen LM head."""
        return self.host.logits(self.norm(h).to(self.host.dtype))

    # -- decoding --------------------------------------------------------------------------------------------
    def begin(self, *, host, batch_size: int, max_len: int) -> None:
        self.cache = KVCache(num_layers=1, batch_size=batch_size, num_kv_heads=self.layer.num_kv_heads,
                             max_len=max_len, head_dim=self.layer.head_dim, dtype=self.dtype, device=host.device)
        self.last_hidden = torch.zeros(batch_size, host.hidden_size, dtype=self.dtype, device=host.device)

    def _cached_step(self, g: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The layer at absolute positions (B, T) against the draft cache, writing their keys first -> (B, T, H)."""
        cos, sin = self.host.rotary(g, positions)
        q, k, v = self.layer.qkv(embeds, g, cos.to(self.dtype), sin.to(self.dtype))
        self.cache.write(0, k, v, positions)
        # why the whole cache and a causal mask by position: a fixed shape (no sync, graph-capturable), and every
        # position <= a query's was written this round or by an earlier observe, so stale drafted keys beyond it
        # are never seen
        key_pos = torch.arange(self.cache.max_len, device=positions.device)  # (W,)
        allowed = key_pos.view(1, 1, -1) <= positions.unsqueeze(-1)  # (B, T, W)
        attended = F.scaled_dot_product_attention(
            q, self.cache.k[0], self.cache.v[0], attn_mask=allowed.unsqueeze(1),
            enable_gqa=self.layer.num_heads != self.layer.num_kv_heads)  # (B, N, T, D)
        return self.layer.finish(g, attended)

    @torch.no_grad()
    def observe(self, *, features: torch.Tensor | None, start: torch.Tensor, n_valid: torch.Tensor,
                state: DraftState) -> None:
        B, T, _ = features.shape
        positions = start.unsqueeze(1) + torch.arange(T, device=start.device)  # (B, T)
        # the token after each observed position is committed by now (the loop writes seq before observing)
        following = state.seq.gather(1, (positions + 1).clamp(max=state.seq.shape[1] - 1))  # (B, T)
        h = self._cached_step(self._fuse(features), self._embed(following), positions)  # (B, T, H)
        last = h.gather(1, (n_valid - 1).clamp(min=0).view(B, 1, 1).expand(B, 1, h.shape[-1])).squeeze(1)
        self.last_hidden = torch.where((n_valid > 0).unsqueeze(1), last, self.last_hidden)  # (B, H)

    @torch.no_grad()
    def propose(self, state: DraftState, K: int) -> Proposal:
        h = self.last_hidden  # (B, H): the step-1 output, computed at anchor-1 by observe
        position = state.seq_len - 2  # (B,)
        token = state.anchor  # (B,)
        tokens, qs = [], []
        for k in range(1, K + 1):
            if k > 1:  # position anchor-2+k: input x_{k-1}, fed-back g = the previous step's output
                position = position + 1
                h = self._cached_step(h.unsqueeze(1), self._embed(token.unsqueeze(1)), position.unsqueeze(1))[:, 0]
            logits = self._logits(h)  # (B, V)
            q = process(logits, state.sampling)  # (B, V): the exact distribution x_k is drawn from
            if state.sampling.greedy:
                token = logits.argmax(-1)
            else:
                token = sample(q, state.seeds, state.rounds * 1024 + k, STREAM_DRAFT)
            tokens.append(token)
            qs.append(q)
        return Proposal(tokens=torch.stack(tokens, 1), q=torch.stack(qs, 1))  # (B, K), (B, K, V)

    def select(self, rows: torch.Tensor) -> None:
        self.cache.select(rows)
        self.last_hidden = self.last_hidden.index_select(0, rows)

    # -- training --------------------------------------------------------------------------------------------
    def _ttt_attention(self, q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                       allowed: torch.Tensor) -> torch.Tensor:
        """q (B, N, T, D) of step j = len(keys) - 1 against step-0 keys under `allowed` (B, T, T) and steps 1..j's
        keys on the diagonal only. why dot products for the diagonal: a (T, j*T) mask would be almost all zeros."""
        rep = self.layer.num_heads // self.layer.num_kv_heads
        scale = self.layer.head_dim ** -0.5
        k0, v0 = keys[0].repeat_interleave(rep, 1), values[0].repeat_interleave(rep, 1)  # (B, N, T, D)
        scores = [(q @ k0.transpose(-1, -2) * scale).masked_fill(~allowed.unsqueeze(1), float("-inf"))]  # (B,N,T,T)
        later = [v.repeat_interleave(rep, 1) for v in values[1:]]
        scores += [(q * k.repeat_interleave(rep, 1)).sum(-1, keepdim=True) * scale for k in keys[1:]]  # (B,N,T,1)
        weights = torch.cat(scores, dim=-1).softmax(-1)  # (B, N, T, T + j)
        T = q.shape[2]
        out = weights[..., :T] @ v0
        for s, v in enumerate(later):
            out = out + weights[..., T + s: T + s + 1] * v
        return out  # (B, N, T, D)

    def training_loss(self, batch: TrainBatch) -> TrainOutput:
        """Training-time test over S unrolled steps; TrainOutput.acceptance is (S,) mean 1 - ½‖q - p‖₁ per step."""
        ids, doc = batch.input_ids, batch.document_ids
        B, T = ids.shape
        index = torch.arange(T, device=ids.device)
        starts = torch.ones_like(doc, dtype=torch.bool)
        starts[:, 1:] = doc[:, 1:] != doc[:, :-1]
        first = torch.cummax(torch.where(starts, index, torch.zeros_like(index)), dim=1).values
        positions = index - first  # (B, T) position inside the document, as the host saw it
        allowed = (index.view(1, 1, T) <= index.view(1, T, 1)) & (doc.unsqueeze(2) == doc.unsqueeze(1))  # (B,T,T)
        p_all = batch.host_logits.float().softmax(-1)  # (B, T, V): p_all[:, t] targets token t+1
        mask = batch.loss_mask.bool()

        g = self._fuse(batch.features)  # (B, T, H)
        keys, values, losses, acceptance = [], [], [], []
        for j in range(self.config.ttt_length):
            # index i of step j stands for position i+j: input token i+1+j, predicts token i+2+j ~ p_all[:, i+1+j]
            inputs = F.pad(ids[:, 1 + j:], (0, 1 + j))  # (B, T)
            cos, sin = self.host.rotary(g, positions + j)
            q, k, v = self.layer.qkv(self._embed(inputs), g, cos.to(self.dtype), sin.to(self.dtype))
            keys.append(k)
            values.append(v)
            g = self.layer.finish(g, self._ttt_attention(q, keys, values, allowed))  # (B, T, H): next step's g
            logq = self._logits(g).log_softmax(-1)  # (B, T, V)
            p = F.pad(p_all[:, 1 + j:], (0, 0, 0, 1 + j))  # (B, T, V)
            valid = (F.pad(mask[:, 2 + j:], (0, 2 + j))
                     & (F.pad(doc[:, 2 + j:], (0, 2 + j), value=-1) == doc))  # (B, T): a response token, same doc
            n = valid.sum().clamp(min=1)
            ce = -(p * logq).sum(-1)  # (B, T)
            losses.append((ce * valid).sum() / n)
            with torch.no_grad():
                c = 1 - 0.5 * (logq.exp() - p).abs().sum(-1)  # (B, T) analytic acceptance
                acceptance.append((c * valid).sum() / n)
        weights = [self.config.step_decay ** j for j in range(self.config.ttt_length)]
        loss = sum(w * l for w, l in zip(weights, losses))
        metrics = {"ce": float(loss.detach())}
        metrics.update({f"ce_{j}": float(l.detach()) for j, l in enumerate(losses)})
        return TrainOutput(loss=loss, metrics=metrics, acceptance=torch.stack(acceptance))
