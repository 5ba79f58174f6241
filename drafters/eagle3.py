"""EAGLE-3 drafter (docs/DSPARK.md §2.4): one decoder layer over fused host features, drafting autoregressively.

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
distribution, step weights step_decay**j, on response tokens (tests check the unroll equals inference's).
Each step's loss is taken in checkpointed chunks of positions (drafters/losses.py): no (B, T, V) logits are kept
for backward, where autograd would otherwise hold S of them.
why explicit attention scores there: the step-0 part is a (T, T) causal score matrix and the rest one dot product per
earlier step; merging them into one softmax needs the scores, which SDPA does not return (memory O(S·T²), as in
EAGLE-3's own implementation).

Draft vocabulary (`draft_vocab` > 0, EAGLE-3's reduced vocabulary): the drafter predicts only the `draft_vocab`
host tokens most frequent as training targets, through a trainable head of its own (`draft_head`, started from
those rows of the host's LM head) and the map `d2t` from draft index to host token id, both saved with the
checkpoint; `dspark train` fills them from the training data's target tokens (`set_draft_vocab`). Training: soft
cross-entropy against the host distribution renormalised over the draft vocabulary (as EAGLE-3's training code);
the acceptance metric c* = sum_d min(q_d, p_d) keeps the host's full probabilities, so it is the acceptance the
drafter gets. Decoding: a drafted token is d2t[index]; a sampled proposal's q is the draft distribution placed on
the host vocabulary (zero elsewhere), the exact distribution the token was drawn from, so verification stays
lossless. why: with a large host vocabulary (Qwen2.5's 151,936) the full LM head dominates each of the K sequential
draft steps and each unrolled training step; the published EAGLE-3 drafts over 32k tokens for that reason.
0 (the default) keeps the host's full vocabulary through its frozen LM head.

Checkpoints (`save_pretrained` / `from_pretrained`, drafters/checkpoint.py) hold fc, the layer, the final norm and,
with a draft vocabulary, draft_head and d2t, with the host fingerprint; the host's embedding, LM head and rotary
tables are borrowed (`SharedHost`), never saved.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F

from drafters.base import TrainBatch, TrainOutput
from drafters.blocks import MLP, LayerShape, RMSNorm
from drafters.checkpoint import Checkpointable, HostFields, with_host
from drafters.losses import (LossRows, checkpointed_chunks, chunk_rows, fused_distill, per_position_mean,
                             row_weights, weight_total, weighted_mean)
from dspark.engine.attention import grouped_attention, pack_mask
from dspark.engine.host import document_positions
from dspark.engine.kv_cache import KVCache
from dspark.engine.protocol import DraftState, Drafter, Proposal
from dspark.engine.rotary import rope
from dspark.engine.sampling import argmax


def eagle3_feature_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's low/mid/high taps: outputs of host layers 1, NL//2 - 1 and NL - 4 of NL (the original code captures
    the inputs of layers 2, NL//2 and NL - 3). Hosts too shallow for three distinct such layers get three evenly
    spread ones (fewer when NL < 3)."""
    layers = (1, num_layers // 2 - 1, num_layers - 4)
    if layers[0] < layers[1] < layers[2]:
        return layers
    m = min(3, num_layers)
    if m == 1:
        return (0,)
    return tuple(sorted({round(i * (num_layers - 1) / (m - 1)) for i in range(m)}))


@dataclass
class Eagle3Config(HostFields):
    """EAGLE-3 drafter settings. The layer's shape (H, heads, MLP width, norms, RoPE) is the host's."""

    feature_layers: tuple[int, ...] | None = None  # host layers fused as context; None = eagle3_feature_layers(NL)
    ttt_length: int = 7  # training-time-test unroll S (docs/DSPARK.md: equal to the block size)
    step_decay: float = 0.8  # weight of unrolled step j is step_decay**j
    draft_vocab: int = 0  # tokens the drafter can propose (EAGLE-3's reduced vocabulary); 0 = the host's whole one

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.ttt_length < 1:
            raise ValueError(f"ttt_length must be >= 1, got {self.ttt_length}")
        if isinstance(self.draft_vocab, bool) or not isinstance(self.draft_vocab, int) or self.draft_vocab < 0:
            raise ValueError(f"draft_vocab must be a whole number >= 0 (0 = the host's vocabulary), got "
                             f"{self.draft_vocab!r}")
        if not 0.0 < self.step_decay <= 1.0:
            raise ValueError(f"step_decay must be in (0, 1], got {self.step_decay}")

    def resolved(self, host) -> "Eagle3Config":
        """This config with the host-dependent fields filled in from `host`."""
        return with_host(self, host, eagle3_feature_layers(host.num_layers))


class Eagle3Layer(nn.Module):
    """The decoder layer: attention from [norm(embed); norm(g)] (2H -> heads), residual stream g, gated MLP."""

    def __init__(self, shape: LayerShape) -> None:
        super().__init__()
        H, N, Nkv, D = shape.hidden_size, shape.num_heads, shape.num_kv_heads, shape.head_dim
        self.shape = shape
        self.embed_norm = RMSNorm(H, shape.rms_norm_eps)  # EAGLE-3's input_layernorm, on the token embedding
        self.hidden_norm = RMSNorm(H, shape.rms_norm_eps)  # on the fused features / fed-back hidden
        self.q_proj = nn.Linear(2 * H, N * D, bias=False)
        self.k_proj = nn.Linear(2 * H, Nkv * D, bias=False)
        self.v_proj = nn.Linear(2 * H, Nkv * D, bias=False)
        self.o_proj = nn.Linear(N * D, H, bias=False)
        if shape.qk_norm:  # Qwen3 hosts: per-head q/k norms, as their EAGLE-3 drafters have
            self.q_norm = RMSNorm(D, shape.rms_norm_eps)
            self.k_norm = RMSNorm(D, shape.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(H, shape.rms_norm_eps)
        self.mlp = MLP(shape)

    def qkv(self, embeds: torch.Tensor, g: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """embeds, g (B, T, H); cos, sin (B, T, D) -> rotated q (B, N, T, D), k and v (B, Nkv, T, D)."""
        B, T, _ = g.shape
        shape = self.shape
        x = torch.cat([self.embed_norm(embeds), self.hidden_norm(g)], dim=-1)  # (B, T, 2H)
        q = self.q_proj(x).view(B, T, shape.num_heads, shape.head_dim)
        k = self.k_proj(x).view(B, T, shape.num_kv_heads, shape.head_dim)
        v = self.v_proj(x).view(B, T, shape.num_kv_heads, shape.head_dim).transpose(1, 2)
        if shape.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return rope(q.transpose(1, 2), cos, sin), rope(k.transpose(1, 2), cos, sin), v

    def finish(self, g: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """Residual stream g (B, T, H) plus attention output (B, N, T, D), then the MLP -> (B, T, H)."""
        B, T, _ = g.shape
        h = g + self.o_proj(attended.transpose(1, 2).reshape(B, T, -1))
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Drafter(Checkpointable, nn.Module, Drafter):
    """EAGLE-3 over a host: trainable fc + one layer + final norm; the host's embedding and LM head, frozen and
    not part of this module's parameters or state dict."""

    name = "eagle3"
    kind = "eagle3"
    config_class = Eagle3Config
    slot_state = ("cache", "last_hidden")
    capturable = True
    admit_capturable = True
    # observe runs the layer over its positions in order within one call (each attends the cache up to its own
    # position, the keys written first), so a backlog of plain rounds observed at once is the per-round observes in
    # one forward. why: a gated EAGLE-3 otherwise runs its layer every plain round (the scheduled EAGLE-3 rows of
    # the 2026-12-06 H100 sweep, 0.84-0.96x plain, against 0.92-1.06x for DSpark, whose observe was deferred)
    observe_batched = True

    def __init__(self, host, config: Eagle3Config | None = None) -> None:
        super().__init__()
        config = self.bind_host(host, config, source="EAGLE-3 config")
        shape = LayerShape.of(host)
        H = host.hidden_size
        self.fc = nn.Linear(len(config.feature_layers) * H, H, bias=False)  # fuse m host layers (F -> H)
        self.layer = Eagle3Layer(shape)
        self.norm = RMSNorm(H, shape.rms_norm_eps)
        self.vocab_size = host.vocab_size
        n = config.draft_vocab
        if n and n >= host.vocab_size:
            raise ValueError(f"draft_vocab={n} must be smaller than the host's vocabulary ({host.vocab_size}); 0 "
                             "drafts over the whole of it")
        if n:
            # placeholders until set_draft_vocab (dspark train) or a checkpoint's own values fill them
            self.draft_head = nn.Linear(H, n, bias=False)
            self.register_buffer("d2t", torch.arange(n))
            self.set_draft_vocab(self.d2t)
        # float32 master weights whatever the host's dtype (train under autocast; cast with .to() for inference)
        self.to(device=host.device)
        self.cache: KVCache | None = None
        self.last_hidden: torch.Tensor | None = None  # (B, H) layer output at the last observed position
        self.loss_impl = "fused"  # training loss: losses.LOSS_IMPLS (TrainConfig.loss_impl)

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @torch.no_grad()
    def set_draft_vocab(self, token_ids: torch.Tensor) -> None:
        """The draft vocabulary: host token ids (draft_vocab,), distinct; draft_head starts from their rows of the
        host's LM head."""
        n = self.config.draft_vocab
        ids = torch.as_tensor(token_ids, dtype=torch.long).flatten().to(self.d2t.device)
        if ids.numel() != n or ids.unique().numel() != n or int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size:
            raise ValueError(f"a draft vocabulary is {n} distinct host token ids in [0, {self.vocab_size}), got "
                             f"{ids.numel()} ids ({ids.unique().numel()} distinct)")
        self.d2t.copy_(ids)
        head = self.shared.lm_head.weight
        if head.is_meta:  # a shape-only host (cost models): there are no rows to start from
            return
        self.draft_head.weight.copy_(head.index_select(0, ids.to(head.device)).to(self.draft_head.weight))

    def draft_vocab_from_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """The draft_vocab most counted host token ids (ties: the lower id), from counts (V,) of training
        targets; what `dspark train` passes to set_draft_vocab."""
        counts = torch.as_tensor(counts, dtype=torch.float64).flatten()
        if counts.numel() != self.vocab_size:
            raise ValueError(f"token counts cover {counts.numel()} ids, the host's vocabulary {self.vocab_size}")
        # why the tie-break term: topk's order among equal counts is not specified; lower ids win, reproducibly
        score = counts - torch.arange(counts.numel(), dtype=torch.float64) / (2 * counts.numel())
        return score.topk(self.config.draft_vocab).indices.sort().values

    def _logits(self, g: torch.Tensor) -> torch.Tensor:
        """Layer output (..., H) -> float32 logits (..., V), or (..., draft_vocab) with a draft vocabulary: own
        final norm, then the host's frozen LM head or the drafter's draft_head."""
        if self.config.draft_vocab:
            return self.draft_head(self.norm(g).to(self.draft_head.weight.dtype)).float()
        return self.shared.logits(self.norm(g))

    # ---- decoding -------------------------------------------------------------------------------------------

    def begin(self, *, host, batch_size: int, max_len: int) -> None:
        shape = self.layer.shape
        self.cache = KVCache(num_layers=1, batch_size=batch_size, num_kv_heads=shape.num_kv_heads,
                             max_len=max_len, head_dim=shape.head_dim, dtype=self.dtype, device=host.device)
        self.last_hidden = torch.zeros(batch_size, shape.hidden_size, dtype=self.dtype, device=host.device)

    def _cached_step(self, g: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The layer on g (B, T, H) and input tokens (B, T) at absolute positions (B, T) against the draft cache,
        writing their keys first -> (B, T, H)."""
        cos, sin = self.shared.rotary(g, positions)
        q, k, v = self.layer.qkv(self.shared.embed(tokens, self.dtype), g, cos.to(self.dtype), sin.to(self.dtype))
        self.cache.write(0, k, v, positions)
        # why the whole cache and a causal mask by position: a fixed shape (no sync, graph-capturable), and every
        # position <= a query's was written this round or by an earlier observe, so stale drafted keys past it
        # are never seen
        key_pos = torch.arange(self.cache.max_len, device=positions.device)  # (W,)
        allowed = key_pos.view(1, 1, -1) <= positions.unsqueeze(-1)  # (B, T, W)
        shape = self.layer.shape
        # grouped query heads packed into one fused kernel (dspark.engine.attention: enable_gqa with a mask would
        # run SDPA's math backend)
        groups = shape.num_heads // shape.num_kv_heads
        attended = grouped_attention(q, self.cache.k[0], self.cache.v[0], pack_mask(allowed.unsqueeze(1), groups),
                                     shape.head_dim ** -0.5)  # (B, N, T, D)
        return self.layer.finish(g, attended)

    @torch.no_grad()
    def observe(self, *, features: torch.Tensor | None, start: torch.Tensor, n_valid: torch.Tensor,
                state: DraftState) -> None:
        B, T, _ = features.shape
        positions = self.cache.window(start, T)  # (B, T), padding past the cache clamped
        # the token after each observed position is committed by now (the loop writes seq before observing);
        # padding slots past n_valid write keys past the context, overwritten before anything attends to them
        following = state.seq.gather(1, (positions + 1).clamp(max=state.seq.shape[1] - 1))  # (B, T)
        g = self._cached_step(self.fc(features.to(self.dtype)), following, positions)  # (B, T, H)
        last = g.gather(1, (n_valid - 1).clamp(min=0).view(B, 1, 1).expand(B, 1, g.shape[-1])).squeeze(1)
        # in place: the slot engine's captured graph keeps reading this tensor
        self.last_hidden.copy_(torch.where((n_valid > 0).unsqueeze(1), last, self.last_hidden))  # (B, H)

    @torch.no_grad()
    def propose(self, state: DraftState, K: int) -> Proposal:
        g = self.last_hidden  # (B, H): step 1's output, computed at anchor-1 (input token: the anchor) by observe
        position = state.seq_len - 2  # (B,)
        tokens, qs = [], []
        for k in range(K):
            if k > 0:  # position anchor-1+k: input x_k, and the previous step's output as its g
                position = position + 1
                g = self._cached_step(g.unsqueeze(1), tokens[-1].unsqueeze(1), position.unsqueeze(1))[:, 0]
            logits = self._logits(g)  # (B, V), or (B, draft_vocab)
            if state.sampling.greedy:  # q: the point mass on the token, which Proposal.q = None states
                token = argmax(logits)
            else:
                q, token = state.draw(logits, k)  # q (B, V): the exact distribution x_{k+1} is drawn from
                if self.config.draft_vocab:  # on the host vocabulary, zero outside the draft one
                    q = q.new_zeros(q.shape[0], self.vocab_size).index_copy_(1, self.d2t, q)
                qs.append(q)
            if self.config.draft_vocab:
                token = self.d2t[token]
            tokens.append(token)
        return Proposal(tokens=torch.stack(tokens, 1), q=torch.stack(qs, 1) if qs else None)  # (B, K), (B, K, V)

    def select(self, rows: torch.Tensor) -> None:
        self.cache.select(rows)
        self.last_hidden = self.last_hidden.index_select(0, rows)

    # ---- training -------------------------------------------------------------------------------------------

    def _ttt_attention(self, q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                       allowed: torch.Tensor) -> torch.Tensor:
        """q (B, N, T, D) of step j = len(keys) - 1 against step-0 keys under `allowed` (B, T, T) and steps 1..j's
        keys on the diagonal only. why dot products for the diagonal: a (T, j*T) mask would be almost all zeros."""
        shape = self.layer.shape
        rep = shape.num_heads // shape.num_kv_heads
        scale = shape.head_dim ** -0.5
        k0, v0 = keys[0].repeat_interleave(rep, 1), values[0].repeat_interleave(rep, 1)  # (B, N, T, D)
        scores = [(q @ k0.transpose(-1, -2) * scale).masked_fill(~allowed.unsqueeze(1), float("-inf"))]  # (B,N,T,T)
        scores += [(q * k.repeat_interleave(rep, 1)).sum(-1, keepdim=True) * scale for k in keys[1:]]  # (B,N,T,1)
        weights = torch.cat(scores, dim=-1).softmax(-1)  # (B, N, T, T + j): never all -inf (own step-0 key)
        T = q.shape[2]
        out = weights[..., :T] @ v0
        for s, v in enumerate(values[1:]):
            out = out + weights[..., T + s: T + s + 1] * v.repeat_interleave(rep, 1)
        return out  # (B, N, T, D)

    def ttt_hidden(self, input_ids: torch.Tensor, features: torch.Tensor,
                   document_ids: torch.Tensor) -> Iterator[torch.Tensor]:
        """The S unrolled steps over whole sequences (B, T): yields step j's layer output g (B, T, H), whose index i
        gives the draft distribution (`_logits`) of token i+2+j from true tokens up to i+1+j and true features up
        to i."""
        B, T = input_ids.shape
        positions = document_positions(document_ids)  # (B, T), as the host saw them
        index = torch.arange(T, device=input_ids.device)
        allowed = ((index.view(1, 1, T) <= index.view(1, T, 1))
                   & (document_ids.unsqueeze(2) == document_ids.unsqueeze(1)))  # (B, T, T) step-0 keys
        g = self.fc(features.to(self.dtype))  # (B, T, H)
        keys, values = [], []
        for j in range(self.config.ttt_length):
            # index i of step j stands for position i+j: its input token is i+1+j, its g step j-1's output at i
            inputs = F.pad(input_ids[:, 1 + j:], (0, 1 + j))  # (B, T)
            cos, sin = self.shared.rotary(g, positions + j)
            q, k, v = self.layer.qkv(self.shared.embed(inputs, self.dtype), g, cos.to(self.dtype), sin.to(self.dtype))
            keys.append(k)
            values.append(v)
            g = self.layer.finish(g, self._ttt_attention(q, keys, values, allowed))  # (B, T, H)
            yield g

    def ttt_logits(self, input_ids: torch.Tensor, features: torch.Tensor,
                   document_ids: torch.Tensor) -> Iterator[torch.Tensor]:
        """Step j's logits (B, T, V) of `ttt_hidden` (for inspection and tests; training never holds them all)."""
        for g in self.ttt_hidden(input_ids, features, document_ids):
            yield self._logits(g)

    def _step_terms(self, g: torch.Tensor, host_logits: torch.Tensor, start: int,
                    stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Soft cross-entropy and c* (B, stop - start) of layer outputs g[:, start:stop] (B, t, H) against
        host_logits[:, start:stop] (B, t, V), the host's logits of the tokens they predict. With a draft vocabulary
        (Vd tokens) the target is the host distribution renormalised over it, and c* = sum_d min(q_d, p_d) with
        the host's own p_d."""
        log_q = F.log_softmax(self._logits(g[:, start:stop]), dim=-1)  # (B, t, V) or (B, t, Vd)
        p = F.softmax(host_logits[:, start:stop].float(), dim=-1).detach()  # (B, t, V)
        if self.config.draft_vocab:
            p = p.index_select(-1, self.d2t)  # (B, t, Vd): the host's probabilities of the draft tokens
            ce = -(p * log_q).sum(-1) / p.sum(-1).clamp(min=torch.finfo(p.dtype).tiny)
            with torch.no_grad():
                accept = torch.minimum(log_q.exp(), p).sum(-1)
            return ce, accept
        ce = -(p * log_q).sum(-1)
        with torch.no_grad():
            accept = 1 - 0.5 * (log_q.exp() - p).abs().sum(-1)
        return ce, accept

    def _fused_step(self, g: torch.Tensor, host_logits: torch.Tensor, j: int,
                    coef: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Step j's share of the loss through losses.fused_distill, and its soft cross-entropy and c* (B, n),
        detached, from its layer outputs g (B, n, H) and each index's coefficient coef (B, n): index i's target is
        the host's distribution at i+1+j, over the draft vocabulary when there is one (as `_step_terms`)."""
        B, n, _ = g.shape
        T = host_logits.shape[1]
        host_rows = (torch.arange(n, device=g.device) + 1 + j + T * torch.arange(B, device=g.device).view(B, 1))
        rows = LossRows(host_logits=host_logits.flatten(0, 1), host_rows=host_rows.flatten(), ce_coef=coef.flatten(),
                        vocab_index=self.d2t if self.config.draft_vocab else None)
        head = self.draft_head.weight if self.config.draft_vocab else self.shared.lm_head.weight
        terms = fused_distill(self.norm(g).flatten(0, 1), head, rows)
        return terms.loss, terms.ce.view(B, n), terms.accept.view(B, n)

    def training_loss(self, batch: TrainBatch) -> TrainOutput:
        """Training-time test: soft cross-entropy of each unrolled step j against the host's full distribution of
        the token it predicts, weighted step_decay**j, on response tokens. TrainOutput.acceptance: (S,) mean
        c* = 1 - ½‖q - p‖₁ per step (teacher-forced tokens, self-generated features)."""
        ids, doc = batch.input_ids, batch.document_ids
        T, S = ids.shape[1], self.config.ttt_length
        mask = batch.loss_mask.bool()
        B, V = ids.shape[0], batch.host_logits.shape[-1]
        # the predicted token i+2+j exists, is a response token and lies in index i's document
        valid = torch.stack([F.pad(mask[:, 2 + j:], (0, 2 + j))
                             & (F.pad(doc[:, 2 + j:], (0, 2 + j), value=-1) == doc) for j in range(S)], -1)  # (B, T, S)
        # why a weighted mean (losses.py) rather than EAGLE-3's plain sum of per-step means: the same step weights,
        # a scale that does not depend on S or on how many tokens a batch has
        weights = self.config.step_decay ** torch.arange(S, device=ids.device, dtype=torch.float32)  # (S,)
        coef = row_weights(weights, valid)  # (B, T, S)
        rows = chunk_rows(B * V, device=ids.device)
        ce, accept, fused_loss = [], [], torch.zeros((), device=ids.device)
        for j, g in enumerate(self.ttt_hidden(ids, batch.features, doc)):
            n = max(T - 1 - j, 0)  # indices i whose host distribution host_logits[:, i+1+j] exists
            if not n:
                step_ce = step_accept = g.new_zeros(B, 0, dtype=torch.float32)
            elif self.loss_impl == "reference":
                # why chunks under checkpointing (losses.py): autograd would otherwise keep a (B, T, V) log q per
                # step, S of them, until backward. why partial, not a lambda: backward calls it again, after g and j
                # moved on
                step_ce, step_accept = checkpointed_chunks(
                    partial(self._step_terms, g, batch.host_logits[:, 1 + j:]), n, rows)  # (B, n) each
            else:
                step_loss, step_ce, step_accept = self._fused_step(g[:, :n], batch.host_logits, j, coef[:, :n, j])
                fused_loss = fused_loss + step_loss
            ce.append(F.pad(step_ce, (0, T - n)))  # (B, T)
            accept.append(F.pad(step_accept, (0, T - n)))
        ce, accept = torch.stack(ce, -1), torch.stack(accept, -1)  # (B, T, S)
        loss = weighted_mean(ce, weights, valid) if self.loss_impl == "reference" else fused_loss
        per_step = per_position_mean(ce, valid)  # (S,)
        metrics = {"ce": float(loss.detach())} | {f"ce_{j}": float(per_step[j]) for j in range(S)}
        return TrainOutput(loss=loss, metrics=metrics, acceptance=per_position_mean(accept, valid),
                           weight=weight_total(weights, valid))
