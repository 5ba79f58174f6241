"""MTP-1 drafter (docs/DSPARK.md §2.5): a DeepSeek-V3-style multi-token-prediction module drafting one token per round.

Shapes: B requests, T tokens, K draft positions requested, V vocabulary, H hidden size (the host's), F = m*H
concatenated host features (default m = 1: the host's last layer), W cached positions.

Position i of the module sees u_i = proj([norm(embed(x_{i+1})); norm(f_i)]) (H + F -> H), f_i the host features
at i, and runs one causal decoder layer of the host's shape (the `InjectionLayer` with its own earlier inputs as
context), final norm, frozen shared LM head: it predicts x_{i+2}. Drafting for anchor x0 at position a uses
u_{a-1} = [embed(x0); f_{a-1}] and attends to u_0..u_{a-1}, whose keys/values `observe` keeps in a one-layer
`KVCache` by position (the token after each observed position is already committed when the loop calls observe).

Proposal: exactly one draft per round. The proposal keeps the loop's (B, K) shape with lengths = min(K, 1);
padded slots hold token 0 with a point-mass q, which is never verified (the loop clips ell to lengths).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from drafters.base import TrainBatch, TrainOutput
from drafters.blocks import InjectionStack, LayerShape, RMSNorm, cached_context, causal_mask, inference_mask
from drafters.checkpoint import Checkpointable, HostFields, with_host
from drafters.losses import (DistillTerms, LossRows, distill_terms, fused_distill, per_position_mean, row_weights,
                             weight_total, weighted_mean)
from dspark.engine.host import document_positions
from dspark.engine.kv_cache import KVCache
from dspark.engine.protocol import DraftState, Drafter, Proposal
from dspark.engine.sampling import argmax


@dataclass
class MTPConfig(HostFields):
    """MTP-1 settings. The decoder layer copies the host's layer shape."""

    feature_layers: tuple[int, ...] | None = None  # host layers fed as f_i; None = (NL - 1,), the last layer
    ce_weight: float = 0.1
    tv_weight: float = 0.9

    def resolved(self, host) -> "MTPConfig":
        """This config with the host-dependent fields filled in from `host`."""
        return with_host(self, host, (host.num_layers - 1,))


class MTPDrafter(Checkpointable, nn.Module, Drafter):
    """One MTP module over a frozen host: one draft per round."""

    kind = "mtp"
    config_class = MTPConfig
    name = "mtp"
    slot_state = ("cache", "last")
    capturable = True
    admit_capturable = True

    def __init__(self, host, config: MTPConfig | None = None) -> None:
        super().__init__()
        config = self.bind_host(host, config, source="MTP config")
        shape = LayerShape.of(host)
        H, F = host.hidden_size, len(config.feature_layers) * host.hidden_size
        self.embed_norm = RMSNorm(H, shape.rms_norm_eps)
        self.feature_norm = RMSNorm(F, shape.rms_norm_eps)
        self.proj = nn.Linear(H + F, H, bias=False)
        self.block = InjectionStack(shape, 1, norm_context=True)
        # float32 master weights whatever the host's dtype (train under autocast; cast with .to() for inference)
        self.to(device=host.device)
        self.cache: KVCache | None = None
        self.last: torch.Tensor | None = None  # (B, H) u at the last observed position of each row
        self.loss_impl = "fused"  # training loss: losses.LOSS_IMPLS (TrainConfig.loss_impl)

    @property
    def dtype(self) -> torch.dtype:
        return self.proj.weight.dtype

    def inputs(self, next_tokens: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """u_i = proj([norm(embed(x_{i+1})); norm(f_i)]) from x_{i+1} (B, T) and f_i (B, T, F): (B, T, H)."""
        e = self.embed_norm(self.shared.embed(next_tokens, self.dtype))
        return self.proj(torch.cat([e, self.feature_norm(features.to(self.dtype))], dim=-1))

    # ---- decoding -------------------------------------------------------------------------------------------

    def begin(self, *, host, batch_size: int, max_len: int) -> None:
        self.cache = KVCache(num_layers=1, batch_size=batch_size, num_kv_heads=host.num_kv_heads, max_len=max_len,
                             head_dim=host.head_dim, dtype=self.dtype, device=host.device)
        self.last = torch.zeros(batch_size, host.hidden_size, dtype=self.dtype, device=host.device)

    @torch.no_grad()
    def observe(self, *, features: torch.Tensor | None, start: torch.Tensor, n_valid: torch.Tensor,
                state: DraftState) -> None:
        B, T, _ = features.shape
        positions = start.unsqueeze(1) + torch.arange(T, device=start.device)  # (B, T)
        nxt = state.seq.gather(1, (positions + 1).clamp(max=state.seq.shape[1] - 1))  # (B, T) x_{i+1}, committed
        u = self.inputs(nxt, features)  # (B, T, H)
        cos, sin = self.shared.rotary(u, positions)
        self.block.write_context(self.cache, u, cos, sin, positions)
        self.cache.rollback(start + n_valid)
        last = u.gather(1, (n_valid - 1).clamp(min=0).view(B, 1, 1).expand(B, 1, u.shape[-1])).squeeze(1)  # (B, H)
        # rows that observed nothing (idle slots of the slot engine) keep theirs; in place for captured graphs
        self.last.copy_(torch.where((n_valid > 0).unsqueeze(1), last, self.last))

    @torch.no_grad()
    def propose(self, state: DraftState, K: int) -> Proposal:
        B = self.last.shape[0]
        tokens = state.seq.new_zeros(B, K)  # (B, K)
        if K == 0:
            return Proposal(tokens=tokens)
        at = self.cache.lengths - 1  # (B,) position a-1 of u_{a-1}
        x = self.last.unsqueeze(1)  # (B, 1, H)
        cos, sin = self.shared.rotary(x, at.unsqueeze(1))
        # causal over u_0..u_{a-1}: the cached u_{a-1} is masked and the block's own slot stands for it
        mask = inference_mask(at, width=self.cache.max_len, block=1, dtype=x.dtype)
        h = self.block(x, cos=cos, sin=sin, context=cached_context(self.cache), mask=mask)  # (B, 1, H)
        U = self.shared.logits(h[:, 0])  # (B, V)
        lengths = torch.ones(B, dtype=torch.long, device=tokens.device)
        if state.sampling.greedy:
            tokens[:, 0] = argmax(U)
            return Proposal(tokens=tokens, lengths=lengths, width=1)
        q = U.new_zeros(B, K, U.shape[-1])  # (B, K, V)
        q[:, 1:, 0] = 1.0  # padded slots: point mass on their token 0, never verified
        q[:, 0], tokens[:, 0] = state.draw(U, 0)
        return Proposal(tokens=tokens, q=q, lengths=lengths, width=1)

    def select(self, rows: torch.Tensor) -> None:
        self.cache.select(rows)
        self.last = self.last.index_select(0, rows)

    # ---- training -------------------------------------------------------------------------------------------

    def training_loss(self, batch: TrainBatch) -> TrainOutput:
        """ce_weight·CE + tv_weight·‖q - p‖₁ of the x_{i+2} prediction at every position i with a response target."""
        cfg = self.config
        ids, doc = batch.input_ids, batch.document_ids
        n = ids.shape[1] - 2  # positions i with a target x_{i+2}
        u = self.inputs(ids[:, 1:n + 1], batch.features[:, :n])  # (B, n, H)
        cos, sin = self.shared.rotary(u, document_positions(doc)[:, :n])
        h = self.block(u, cos=cos, sin=sin, context=None, mask=causal_mask(doc[:, :n], dtype=u.dtype))
        # host_logits[t] targets token t+1, so p for x_{i+2} is at i+1; a target across a document edge is no target
        valid = (batch.loss_mask[:, 2:].bool() & (doc[:, 2:] == doc[:, :n])).unsqueeze(2)  # (B, n, 1)
        w = torch.ones(1, device=ids.device)
        if self.loss_impl == "reference":
            terms = distill_terms(self.shared.logits(h).unsqueeze(2), batch.host_logits[:, 1:n + 1].unsqueeze(2),
                                  ids[:, 2:].unsqueeze(2))  # (B, n, 1)
            ce, tv = weighted_mean(terms.ce, w, valid), weighted_mean(terms.tv, w, valid)
            loss = cfg.ce_weight * ce + cfg.tv_weight * tv
        else:
            B, T = ids.shape
            coef = row_weights(w, valid).flatten()  # (B*n,)
            host_rows = torch.arange(1, n + 1, device=ids.device) + T * torch.arange(B, device=ids.device).view(B, 1)
            terms = fused_distill(h.flatten(0, 1), self.shared.lm_head.weight, LossRows(
                host_logits=batch.host_logits.flatten(0, 1), host_rows=host_rows.flatten(),
                ce_coef=cfg.ce_weight * coef, tv_coef=cfg.tv_weight * coef, targets=ids[:, 2:].flatten()))
            loss = terms.loss
            terms = DistillTerms(ce=terms.ce.view(B, n, 1), tv=terms.tv.view(B, n, 1),
                                 accept=terms.accept.view(B, n, 1))  # detached
            ce, tv = weighted_mean(terms.ce, w, valid), weighted_mean(terms.tv, w, valid)
        acceptance = per_position_mean(terms.accept, valid)  # (1,)
        parts = {"ce": ce, "tv": tv, "loss": loss, "acceptance": acceptance[0]}
        values = torch.stack([v.detach().float() for v in parts.values()]).tolist()  # one sync for all metrics
        return TrainOutput(loss=loss, metrics=dict(zip(parts, values)), acceptance=acceptance,
                           weight=weight_total(w, valid))
