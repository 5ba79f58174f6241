"""DSpark drafter (docs/DSPARK.md §2.1-2.3, §3): a parallel KV-injection backbone plus a light sequential head.
DFlash is the same drafter with the head and the confidence off: `dflash_config()`.

Shapes: B requests, K draft positions this round (K <= S), S = block_size slots per block (the trained block size),
V vocabulary, H hidden size (the host's), F = m*H concatenated host features, r head rank, T training tokens,
A anchors.
Notation: x0 anchor, x_k drafts, U_k backbone logits, B_k head bias, q_k = softmax(U_k + B_k) draft distribution,
c_k confidence, p_k host distribution.

One round: the block [x0, mask, ..., mask] (S slots, at absolute positions anchor..anchor+S-1) runs through
the backbone ONCE, attending to the context K/V of positions < anchor; then a cheap loop over k samples
x_k ~ q_k(· | x0, x<k) left to right through the head, B_k depending on x_{k-1} (and, for the RNN head, a state).

Design choices:
  - The mask slots use one learned embedding (initialised to the mean host token embedding): not every host has a
    spare token id to reserve, and the slot needs no meaning beyond "unknown token here". With `mask_token_id` set
    they are instead the host's frozen embedding of that token, as DeepSpec does (docs/DEEPSPEC.md): serving
    engines that embed the block with the target's own embedding then draft exactly as here.
  - The backbone always runs the trained block of block_size slots (the block attends bidirectionally, so its hidden
    states depend on the number of slots) and the head drafts the first K; K > block_size is refused, since positions
    past block_size were never trained.
  - The context cache is a `dspark.engine.kv_cache.KVCache` with one entry per backbone layer: observe() writes
    K(H_ctx), V(H_ctx) of newly committed positions by absolute position and sets each row's length, so rejected
    positions are simply overwritten next round.
  - Confidence for head "none" reads [h_k] only (there is no W1 table to embed x_{k-1}); DFlash turns it off.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn as nn

from drafters.base import TrainBatch, TrainOutput
from drafters.blocks import (InjectionStack, LayerShape, RMSNorm, block_training_mask, cached_block_mask,
                             sparse_training_attention)
from drafters.checkpoint import Checkpointable, HostFields, with_host
from drafters.losses import (LossRows, checkpointed_chunks, chunk_rows, confidence_bce, distill_terms, fused_distill,
                             per_position_mean, position_weights, row_weights, weight_total, weighted_mean)
from dspark.engine.host import document_positions
from dspark.engine.kv_cache import KVCache, aligned_length
from dspark.engine.protocol import DraftState, Drafter, Proposal
from dspark.engine.sampling import STREAM_ANCHOR, argmax, uniform

HEADS = ("markov", "gated", "rnn", "none")


def spread_layers(num_layers: int, m: int) -> tuple[int, ...]:
    """m host layers spread evenly from layer 1 to the third-from-last (docs/DSPARK.md §2.1: [1, 9, 17, 25, 33] of 36);
    fewer, distinct ones on hosts too shallow for m."""
    first = min(1, num_layers - 1)
    last = max(num_layers - 3, first)
    if m == 1:
        return (first,)
    return tuple(sorted({round(first + i * (last - first) / (m - 1)) for i in range(m)}))


@dataclass
class DSparkConfig(HostFields):
    """DSpark / DFlash drafter settings. The backbone layers copy the host's layer shape."""

    feature_layers: tuple[int, ...] | None = None  # host layers whose outputs form H_ctx; None = spread_layers(NL, m)
    num_feature_layers: int = 5  # m, used when feature_layers is None
    num_layers: int = 3  # N backbone layers
    block_size: int = 7  # block size: slots trained per block; inference drafts K <= block_size of them
    head: str = "markov"  # sequential head: markov | gated | rnn | none (none = DFlash)
    rank: int = 256  # r of W1 (V x r) and W2 (r x V)
    confidence: bool = True  # train and emit c_k
    max_anchors: int = 512  # anchors per training sequence (fewer when fewer response tokens)
    decay: float = 4.0  # position weights w_k = exp(-k / decay)
    ce_weight: float = 0.1
    tv_weight: float = 0.9
    conf_weight: float = 1.0
    # None: a learned mask embedding; a token id: the host's frozen embedding of that token (DeepSpec's way; on Qwen3
    # 151669, the first row past the tokenizer), which engines that borrow the target's embedding reproduce
    mask_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.head not in HEADS:
            raise ValueError(f"head must be one of {HEADS}, got {self.head!r}")
        for name in ("num_feature_layers", "num_layers", "block_size", "rank", "max_anchors"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        super().__post_init__()

    def resolved(self, host) -> "DSparkConfig":
        """This config with the host-dependent fields filled in from `host`."""
        return with_host(self, host, spread_layers(host.num_layers, self.num_feature_layers))


def variant_name(head: str) -> str:
    """What a DSpark-class drafter is called in reports: "dflash" with no sequential head, else "dspark"."""
    return "dflash" if head == "none" else "dspark"


def dflash_config(**overrides) -> DSparkConfig:
    """DFlash (docs/DSPARK.md §2.2): the DSpark drafter with no sequential head, no confidence, and L = L_ce."""
    return DSparkConfig(**{"head": "none", "confidence": False, "ce_weight": 1.0, "tv_weight": 0.0,
                           "conf_weight": 0.0, **overrides})


@dataclass
class HeadStep:
    u: torch.Tensor | None  # (..., r) the head's output, B_k = W2 u; None for head "none"
    conf_logit: torch.Tensor | None  # (...,) logit of c_k; None without confidence
    state: torch.Tensor | None  # (..., r) RNN state s_k; None for the other heads


@dataclass
class BlockLogits:
    """Teacher-forced outputs of A blocks of block_size slots per sequence."""

    q_logits: torch.Tensor  # (B, A, S, V) U_k + B_k
    conf_logits: torch.Tensor | None  # (B, A, S)


class DSparkDrafter(Checkpointable, nn.Module, Drafter):
    """The DSpark (or, by configuration, DFlash) drafter over a frozen host."""

    kind = "dspark"
    config_class = DSparkConfig
    slot_state = ("cache",)
    capturable = True
    admit_capturable = True
    observe_batched = True  # observe projects each position's features into the cache on their own (write_context)

    def __init__(self, host, config: DSparkConfig | None = None) -> None:
        super().__init__()
        config = self.bind_host(host, config, source="DSpark config")
        self.name = variant_name(config.head)
        shape = LayerShape.of(host)
        H, V, r, m = host.hidden_size, host.vocab_size, config.rank, len(config.feature_layers)
        self.fc = nn.Linear(m * H, H, bias=False)
        self.context_norm = RMSNorm(H, shape.rms_norm_eps)
        if config.mask_token_id is None:
            self.mask_embedding = nn.Parameter(host.embed_tokens.weight.detach().float().mean(0).clone())  # (H,)
        elif not 0 <= config.mask_token_id < V:
            raise ValueError(f"mask_token_id {config.mask_token_id} is outside the host's vocabulary (0..{V - 1})")
        self.backbone = InjectionStack(shape, config.num_layers)
        if config.head != "none":
            self.W1 = nn.Embedding(V, r)
            self.W2 = nn.Linear(r, V, bias=False)
            nn.init.normal_(self.W1.weight, std=0.02)
            nn.init.normal_(self.W2.weight, std=0.02)
        if config.head == "gated":
            self.gate = nn.Linear(H + r, r)  # W_g
        if config.head == "rnn":
            self.rnn = nn.Linear(2 * r + H, 3 * r)
        if config.confidence:
            self.confidence_head = nn.Linear(H + (r if config.head != "none" else 0), 1)
        # float32 master weights whatever the host's dtype (train under autocast; cast with .to() for inference)
        self.to(device=host.device)
        self.cache: KVCache | None = None
        # training attention: None = sparse_training_attention decides per call; True / False force it (tests)
        self.sparse_attention: bool | None = None
        self.loss_impl = "fused"  # training loss: losses.LOSS_IMPLS (TrainConfig.loss_impl)

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    # ---- the sequential head (docs/DSPARK.md §2.3) --------------------------------------------------------------

    def head_step(self, prev: torch.Tensor, h: torch.Tensor, state: torch.Tensor | None,
                  conf_hidden: torch.Tensor | None = None) -> HeadStep:
        """One position k: the input u_k of B_k = W2 u_k and c_k from x_{k-1} (...,) and the backbone hidden h_k
        (..., H). conf_hidden: h_k's part of the confidence logit with the bias (`confidence_hidden`), computed
        beforehand for every k."""
        cfg = self.config
        e = None if cfg.head == "none" else self.W1(prev)  # (..., r) W1[x_{k-1}]
        u = None
        if cfg.head == "markov":
            u = e
        elif cfg.head == "gated":
            u = torch.sigmoid(self.gate(torch.cat([h, e], dim=-1))) * e  # (..., r)
        elif cfg.head == "rnn":
            if state is None:
                state = h.new_zeros(h.shape[:-1] + (cfg.rank,))  # s_0 = 0
            g, c, o = self.rnn(torch.cat([state, e, h], dim=-1)).chunk(3, dim=-1)  # (..., r) each
            state = torch.sigmoid(g) * state + (1 - torch.sigmoid(g)) * torch.tanh(c)
            u = torch.tanh(o)
        conf = None
        if cfg.confidence and conf_hidden is not None:  # the same linear map, split: h's part given, e's added
            w_e = self.confidence_head.weight[0, h.shape[-1]:]  # (r,)
            conf = conf_hidden if e is None else conf_hidden + (e * w_e).sum(-1)
        elif cfg.confidence:
            conf = self.confidence_head(h if e is None else torch.cat([h, e], dim=-1)).squeeze(-1)  # (...,)
        return HeadStep(u=u, conf_logit=conf, state=state)

    def head_bias(self, u: torch.Tensor) -> torch.Tensor:
        """B_k = W2 u_k: (..., r) -> float32 (..., V)."""
        return self.W2(u).float()

    def confidence_hidden(self, h: torch.Tensor) -> torch.Tensor:
        """The hidden states' part of the confidence logits, bias included: h (..., H) -> (...,). why split off in
        decoding: the head's linear over [h_k; e_k] was, at each of the K sequential steps, a concatenation and a
        matrix-vector product (cuBLAS's dot and reduce kernels every step on CUDA, 14 of DSpark's 149-kernel compiled
        propose: benchmarks/h100/compiled_round/round_profile.json); h's part is one product for every k at once,
        and e's a dot product that inductor can fuse with e's lookup."""
        head = self.confidence_head
        return h @ head.weight[0, : h.shape[-1]] + head.bias[0]

    def _block_input(self, anchor_tokens: torch.Tensor) -> torch.Tensor:
        """[embed(x0), mask, ..., mask] for anchors (...,): (..., S, H)."""
        x0 = self.shared.embed(anchor_tokens, self.dtype).unsqueeze(-2)  # (..., 1, H)
        mask_id = self.config.mask_token_id
        mask = (self.mask_embedding if mask_id is None
                else self.shared.embed(torch.tensor(mask_id, device=x0.device), self.dtype))  # (H,)
        masks = mask.expand(x0.shape[:-2] + (self.config.block_size - 1, x0.shape[-1]))
        return torch.cat([x0, masks], dim=-2)

    # ---- decoding -------------------------------------------------------------------------------------------

    def begin(self, *, host, batch_size: int, max_len: int) -> None:
        # room for a block past the longest context (propose writes it there), aligned as the engine's own caches
        width = aligned_length(max_len + self.config.block_size)
        self.cache = KVCache(num_layers=self.config.num_layers, batch_size=batch_size,
                             num_kv_heads=host.num_kv_heads, max_len=width, head_dim=host.head_dim,
                             dtype=self.dtype, device=host.device)

    @torch.no_grad()
    def observe(self, *, features: torch.Tensor | None, start: torch.Tensor, n_valid: torch.Tensor,
                state: DraftState) -> None:
        T = features.shape[1]
        positions = self.cache.window(start, T)  # (B, T), padding past the cache clamped
        ctx = self.context_norm(self.fc(features.to(self.dtype)))  # (B, T, H) H_ctx
        cos, sin = self.shared.rotary(ctx, positions)
        # padding rows past n_valid are written too: they sit at or past the new length, masked until overwritten
        self.backbone.write_context(self.cache, ctx, cos, sin, positions)
        self.cache.rollback(start + n_valid)

    @torch.no_grad()
    def propose(self, state: DraftState, K: int) -> Proposal:
        cfg, block_size = self.config, self.config.block_size
        if K > block_size:
            raise ValueError(f"draft_length K={K} exceeds the drafter's trained block_size={block_size}")
        anchor = state.anchor  # (B,)
        B = anchor.shape[0]
        x = self._block_input(anchor)  # (B, S, H)
        positions = self.cache.lengths.unsqueeze(1) + torch.arange(block_size, device=anchor.device)  # (B, S)
        cos, sin = self.shared.rotary(x, positions)
        mask = cached_block_mask(self.cache.lengths, width=self.cache.max_len, block=block_size, dtype=x.dtype)
        # the block's keys go into the cache at its positions, past the context (cached_block_mask)
        h = self.backbone(x, cos=cos, sin=sin, context=None, mask=mask, cache=(self.cache, positions))  # (B, γ, H)
        U = self.shared.logits(h[:, :K])  # (B, K, V)

        greedy = state.sampling.greedy
        q = None if greedy else U.new_zeros(U.shape)  # (B, K, V)
        # why lists stacked at the end rather than writes into (B, K) tensors: compiled, a step's argmax can write
        # straight into the stacked result (EAGLE-3's did in the H100 census, benchmarks/h100/compiled_round/
        # round_profile.json), where DSpark's writes into slices showed as kernels of their own
        tokens, confs = [], []
        prev, s = anchor, None
        conf_h = self.confidence_hidden(h[:, :K]) if cfg.confidence else None  # (B, K)
        # why a Python loop: x_k depends on the sampled x_{k-1}; each step is only the head (K small)
        for k in range(K):
            step = self.head_step(prev, h[:, k], s, None if conf_h is None else conf_h[:, k])
            logits = U[:, k] if step.u is None else U[:, k] + self.head_bias(step.u)  # (B, V)
            if greedy:
                prev = argmax(logits)
            else:
                q[:, k], prev = state.draw(logits, k)
            tokens.append(prev)
            if cfg.confidence:
                confs.append(torch.sigmoid(step.conf_logit.float()))
            s = step.state
        c = (torch.stack(confs, 1) if confs else U.new_zeros(B, 0)) if cfg.confidence else None  # (B, K)
        return Proposal(tokens=torch.stack(tokens, 1) if tokens else anchor.new_zeros(B, 0), q=q, confidence=c)

    def select(self, rows: torch.Tensor) -> None:
        self.cache.select(rows)

    # ---- training (docs/DSPARK.md §3) ------------------------------------------------------------------------

    def block_hidden(self, *, input_ids: torch.Tensor, features: torch.Tensor, document_ids: torch.Tensor,
                     anchors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Backbone hidden states h (B, A, S, H) of every block anchored at anchors (B, A), in one backbone pass
        over all blocks of all sequences (the block attention mask keeps them apart), and each slot's teacher-forced
        previous token prev (B, A, S): the true token at anchor + k (x0 = the anchor for k = 0)."""
        block_size = self.config.block_size
        B, A = anchors.shape
        T = input_ids.shape[1]
        doc_pos = document_positions(document_ids)  # (B, T)
        ctx = self.context_norm(self.fc(features.to(self.dtype)))  # (B, T, H)
        ctx_cos, ctx_sin = self.shared.rotary(ctx, doc_pos)
        x = self._block_input(input_ids.gather(1, anchors)).flatten(1, 2)  # (B, A*S, H)
        k = torch.arange(block_size, device=anchors.device)
        slot_pos = (doc_pos.gather(1, anchors).unsqueeze(2) + k).flatten(1)  # (B, A*S)
        cos, sin = self.shared.rotary(x, slot_pos)
        mask = block_training_mask(anchors, block_size=block_size, document_ids=document_ids, dtype=x.dtype,
                                   sparse=sparse_training_attention(x) if self.sparse_attention is None
                                   else self.sparse_attention)
        h = self.backbone(x, cos=cos, sin=sin, context=self.backbone.context_kv(ctx, ctx_cos, ctx_sin), mask=mask)
        prev = input_ids.gather(1, (anchors.unsqueeze(2) + k).clamp(max=T - 1).flatten(1)).view(B, A, block_size)
        return h.view(B, A, block_size, -1), prev

    def head_logits(self, h: torch.Tensor, prev: torch.Tensor) -> BlockLogits:
        """Teacher-forced q logits (..., S, V) and confidence logits of blocks from their backbone hidden states
        h (..., S, H) and previous tokens prev (..., S)."""
        U = self.shared.logits(h)  # (..., S, V)
        u, conf = self.head_inputs(h, prev)
        return BlockLogits(q_logits=U if u is None else U + self.head_bias(u), conf_logits=conf)

    def head_inputs(self, h: torch.Tensor, prev: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Teacher-forced head outputs u (..., S, r) (B_k = W2 u_k; None for head "none") and confidence logits
        (..., S) (None without confidence) of blocks from h (..., S, H) and prev (..., S)."""
        us, confs, s = [], [], None
        for j in range(self.config.block_size):  # why a loop: the RNN state is sequential; S is small, the heads cheap
            step = self.head_step(prev[..., j], h[..., j, :], s)
            us.append(step.u)
            confs.append(step.conf_logit)
            s = step.state
        u = None if us[0] is None else torch.stack(us, dim=-2)
        return u, torch.stack(confs, dim=-1) if self.config.confidence else None

    def block_logits(self, *, input_ids: torch.Tensor, features: torch.Tensor, document_ids: torch.Tensor,
                     anchors: torch.Tensor) -> BlockLogits:
        """Teacher-forced q logits (B, A, S, V) and confidence logits (B, A, S) of every block anchored at
        anchors (B, A). For inspection and tests: training never holds all of them (`training_loss`)."""
        return self.head_logits(*self.block_hidden(input_ids=input_ids, features=features,
                                                   document_ids=document_ids, anchors=anchors))

    def _block_terms(self, h: torch.Tensor, prev: torch.Tensor, slot: torch.Tensor, targets: torch.Tensor,
                     host_logits: torch.Tensor, start: int, stop: int) -> tuple:
        """Loss terms (B, a, S) of the blocks start..stop-1 (a of them) of h (B, A, S, H), prev, slot and
        targets (B, A, S), and their confidence logits (B, a, S) or None."""
        out = self.head_logits(h[:, start:stop], prev[:, start:stop])
        B, a, block_size, V = out.q_logits.shape
        # the host's logits at each slot's input position: a copy per slot, but only of this chunk's slots
        index = slot[:, start:stop].reshape(B, a * block_size, 1).expand(B, a * block_size, V)
        p_logits = host_logits.gather(1, index).view(B, a, block_size, V)
        terms = distill_terms(out.q_logits, p_logits, targets[:, start:stop])
        return terms.ce, terms.tv, terms.accept, out.conf_logits

    def _fused_loss(self, h: torch.Tensor, prev: torch.Tensor, slot: torch.Tensor, targets: torch.Tensor,
                    coef: torch.Tensor, host_logits: torch.Tensor) -> tuple:
        """ce_weight·L_ce + tv_weight·L_tv of every block through losses.fused_distill, from h (B, A, S, H), prev,
        slot, targets and each entry's share of the weighted mean coef (B, A, S); with the per-entry ce, tv and c*
        (B, A, S), detached, and the confidence logits (B, A, S) or None."""
        cfg = self.config
        u, conf = self.head_inputs(h, prev)
        B, T, _ = host_logits.shape
        rows = LossRows(host_logits=host_logits.flatten(0, 1),
                        host_rows=(slot + T * torch.arange(B, device=slot.device).view(B, 1, 1)).flatten(),
                        ce_coef=(cfg.ce_weight * coef).flatten(), tv_coef=(cfg.tv_weight * coef).flatten(),
                        targets=targets.flatten())
        terms = fused_distill(h.flatten(0, 2), self.shared.lm_head.weight, rows,
                              bias_input=None if u is None else u.flatten(0, 2),
                              bias_weight=None if u is None else self.W2.weight)
        return (terms.loss, terms.ce.view(slot.shape), terms.tv.view(slot.shape), terms.accept.view(slot.shape),
                conf)

    def training_loss(self, batch: TrainBatch) -> TrainOutput:
        """L = ce_weight·L_ce + tv_weight·L_tv + conf_weight·L_conf over randomly anchored blocks."""
        cfg, block_size = self.config, self.config.block_size
        anchors, anchor_ok = sample_anchors(batch.loss_mask, batch.document_ids, max_anchors=cfg.max_anchors,
                                            generator=batch.generator, seeds=batch.anchor_seeds)  # (B, A)
        h, prev = self.block_hidden(input_ids=batch.input_ids, features=batch.features,
                                    document_ids=batch.document_ids, anchors=anchors)  # (B, A, S, H)
        B, A = anchors.shape
        T, V = batch.input_ids.shape[1], batch.host_logits.shape[-1]
        slot = anchors.unsqueeze(2) + torch.arange(block_size, device=anchors.device)  # (B, A, S) input position
        target = slot + 1  # position of x*_k, predicted from the host's logits at `slot`
        in_range = target < T
        slot, target = slot.clamp(max=T - 1), target.clamp(max=T - 1)
        same_doc = batch.document_ids.gather(1, target.flatten(1)).view(B, A, block_size) == \
            batch.document_ids.gather(1, anchors).unsqueeze(2)
        response = batch.loss_mask.gather(1, target.flatten(1)).view(B, A, block_size).bool()
        # a block stops at the end of its response / document: later slots are never drafted there
        valid = (in_range & same_doc & response).long().cumprod(2).bool() & anchor_ok.unsqueeze(2)
        targets = batch.input_ids.gather(1, target.flatten(1)).view(B, A, block_size)  # x*_k
        w = position_weights(block_size, decay=cfg.decay, device=anchors.device)
        if self.loss_impl == "reference":
            # why chunks of blocks under checkpointing (losses.py): the (B, A, S, V) logits, log q, q, p and q - p
            # of all blocks at once would be kept for backward (several GB at 2048 tokens x 512 anchors)
            ce_terms, tv_terms, accept, conf_logits = checkpointed_chunks(
                partial(self._block_terms, h, prev, slot, targets, batch.host_logits), A,
                chunk_rows(B * block_size * V, device=h.device))
            ce, tv = weighted_mean(ce_terms, w, valid), weighted_mean(tv_terms, w, valid)
            loss = cfg.ce_weight * ce + cfg.tv_weight * tv
        else:
            loss, ce_terms, tv_terms, accept, conf_logits = self._fused_loss(h, prev, slot, targets,
                                                                             row_weights(w, valid), batch.host_logits)
            ce, tv = weighted_mean(ce_terms, w, valid), weighted_mean(tv_terms, w, valid)  # detached: metrics
        parts = {"ce": ce, "tv": tv}
        if cfg.confidence:
            parts["conf"] = weighted_mean(confidence_bce(conf_logits, accept), w, valid)
            loss = loss + cfg.conf_weight * parts["conf"]
        acceptance = per_position_mean(accept, valid)  # (S,)
        parts.update(loss=loss, acceptance=acceptance.mean(), anchors=anchor_ok.sum().float())
        values = torch.stack([v.detach().float() for v in parts.values()]).tolist()  # one sync for all metrics
        return TrainOutput(loss=loss, metrics=dict(zip(parts, values)), acceptance=acceptance,
                           weight=weight_total(w, valid))


def sample_anchors(loss_mask: torch.Tensor, document_ids: torch.Tensor, *, max_anchors: int,
                   generator: torch.Generator | None, seeds: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to max_anchors anchor positions per sequence, without replacement, among positions whose next token is a
    response token of the same document. Returns anchors (B, A) ascending and anchor_ok (B, A) (False = padding
    for sequences with fewer candidates). seeds (B,) long: row b's scores are counter-based noise keyed by (seeds[b],
    position), so its anchors do not depend on the other rows, the padding or the device; else `generator`."""
    B, T = loss_mask.shape
    candidate = torch.zeros(B, T, dtype=torch.bool, device=loss_mask.device)  # (B, T)
    candidate[:, :-1] = loss_mask[:, 1:].bool() & (document_ids[:, 1:] == document_ids[:, :-1])
    A = max(1, min(max_anchors, int(candidate.sum(1).max())))
    if seeds is not None:
        positions = torch.arange(T, device=loss_mask.device).expand(B, T)
        scores = uniform(seeds.to(loss_mask.device), positions, STREAM_ANCHOR)  # (B, T) in (0, 1)
    else:
        device = generator.device if generator is not None else loss_mask.device
        scores = torch.rand(B, T, generator=generator, device=device).to(loss_mask.device)  # (B, T) in [0, 1)
    top = scores.masked_fill(~candidate, -1.0).topk(A, dim=1)  # random subset of the candidates
    anchors, order = top.indices.sort(dim=1)
    return anchors, top.values.gather(1, order) >= 0
