"""Independent small-LM drafter (DSPARK.md §2.5): any causal LM sharing the host's tokenizer drafts K tokens
autoregressively from the committed tokens alone (no host features).

Shapes: B requests, T tokens in a step, K draft positions, V vocabulary (the host's, which the small LM must share).

The small LM runs through its own `dspark.engine.host.Host` adapter and ragged `KVCache`. Its cache holds the committed
tokens it has already fed (`cache.lengths`); a round feeds the pending committed tokens (the anchor, and on the
first round the prompt; after a round whose K drafts were all accepted also x_K, which was drafted but never fed)
as one ragged step, then drafts x2..xK one token at a time past the committed length. Drafted positions whose
tokens the host accepts keep their keys (they were computed from exactly those tokens); the rest are overwritten
next round, so rollback is moving a length.
"""
from __future__ import annotations

import os

import torch

from dspark.engine.host import Host
from dspark.engine.kv_cache import KVCache
from dspark.engine.protocol import DraftState, Drafter, Proposal


def check_same_tokenizer(tokenizer, host, *, source: str) -> None:
    """Refuse a drafter tokenizer whose token -> id map differs from the host's (same size is not enough)."""
    mine, theirs = tokenizer.get_vocab(), host.tokenizer.get_vocab()
    differ = sorted(t for t in set(mine) | set(theirs) if mine.get(t) != theirs.get(t))
    if differ:
        t = differ[0]
        raise ValueError(f"small-LM drafter tokenizer at {source} differs from host '{host.name}''s: {len(differ)} "
                         f"token(s) map to other ids (e.g. {t!r}: {mine.get(t)} in the drafter's, {theirs.get(t)} "
                         "in the host's); the drafter must share the host's tokenizer")


class SmallLMDrafter(Drafter):
    """Drafts with a small causal LM of the host's vocabulary."""

    name = "small-lm"
    slot_state = ("cache", "drafted_end")
    def __init__(self, model, host) -> None:
        if model.config.vocab_size != host.vocab_size:
            raise ValueError(f"small-LM drafter vocabulary ({model.config.vocab_size} tokens) differs from the "
                             f"host's ({host.vocab_size} tokens): the drafter must share the host's tokenizer")
        self.lm = Host(model.to(device=host.device), name="small-lm", compile=host.compile)  # as the host runs
        self.cache: KVCache | None = None
        self.drafted_end: torch.Tensor | None = None  # (B,) positions < this hold keys of committed or drafted tokens

    @classmethod
    def from_pretrained(cls, path_or_name: str | os.PathLike, host, *, dtype: torch.dtype | None = None):
        """Load the small LM the way hosts load (`dspark.engine.models`): a packaged host name such as
        `qwen2.5-coder-0.5b`, a .gguf file, a local directory, a hub id in the local HF cache (never downloads)
        or `random:<shape>`. Its vocabulary, and its tokenizer when both have one, must be the host's."""
        from dspark.engine.models import load_model_and_tokenizer

        model, tokenizer = load_model_and_tokenizer(str(path_or_name), dtype=dtype or host.dtype, device=host.device)
        drafter = cls(model, host)
        if tokenizer is not None and host.tokenizer is not None:
            check_same_tokenizer(tokenizer, host, source=str(path_or_name))
        return drafter

    def save_pretrained(self, path: str | os.PathLike) -> None:
        """Save the small LM with its own `save_pretrained` (config.json + safetensors)."""
        self.lm.model.save_pretrained(path)

    def begin(self, *, host, batch_size: int, max_len: int) -> None:
        self.cache = self.lm.new_cache(batch_size, max_len)
        self.drafted_end = torch.zeros(batch_size, dtype=torch.long, device=host.device)

    def observe(self, *, features: torch.Tensor | None, start: torch.Tensor, n_valid: torch.Tensor,
                state: DraftState) -> None:
        # positions start..start+n_valid-1 are now committed; the first min(n_acc, K-1) drafted tokens were
        # accepted, so their keys (at positions < drafted_end) are the committed tokens' keys
        self.cache.rollback(torch.minimum(start + n_valid, self.drafted_end))
        # the drafted keys past that are stale: a round without a propose (a plain round, Verifier.draft_next) must
        # not take them for the committed tokens written there since (in place: see Drafter.capturable)
        self.drafted_end.copy_(self.cache.lengths)

    @torch.no_grad()
    def propose(self, state: DraftState, K: int) -> Proposal:
        B = state.seq.shape[0]
        cache, device = self.cache, state.seq.device
        pending = state.seq_len - cache.lengths  # (B,) committed tokens not fed yet, the anchor last
        # why one sync: the ragged step's width and attention window are Python ints (eager shapes); after the
        # first round pending is 1 or 2 for a live request. An idle slot of the slot engine can have 0 (the engine's
        # warm-up proposes for idle slots): width >= 1 and the clamped gather below keep its row's shapes valid,
        # and what it drafts is never verified
        width, end = (int(x) for x in torch.stack([pending.max().clamp(min=1), state.seq_len.max()]).cpu())
        offsets = torch.arange(width, device=device)
        index = (cache.lengths.unsqueeze(1) + offsets).clamp(max=state.seq.shape[1] - 1)  # (B, width)
        out = self.lm.step(cache, state.seq.gather(1, index), pending, attend=end)
        last = (pending - 1).clamp(min=0).view(B, 1, 1).expand(B, 1, out.hidden.shape[-1])
        h = out.hidden.gather(1, last)[:, 0]  # (B, H)
        cache.advance(pending)  # every committed token is fed now
        committed = cache.lengths.clone()  # (B,)
        ones = torch.ones(B, dtype=torch.long, device=device)
        tokens, qs = [], []
        for k in range(K):
            logits = self.lm.logits(h)  # (B, V)
            q, token = state.draw(logits, k)  # q (B, V): the exact distribution x_{k+1} is drawn from
            tokens.append(token)
            qs.append(q)
            if k < K - 1:  # x_K is never fed this round: the host decides it first
                h = self.lm.step(cache, token.unsqueeze(1), ones, attend=end + k + 1).hidden[:, 0]  # (B, H)
                cache.advance(ones)
        self.drafted_end.copy_(cache.lengths)  # committed + K-1 drafted positions (in place: see Drafter.capturable)
        cache.rollback(committed)
        return Proposal(tokens=torch.stack(tokens, 1), q=torch.stack(qs, 1))  # (B, K), (B, K, V)

    def select(self, rows: torch.Tensor) -> None:
        self.cache.select(rows)
        self.drafted_end = self.drafted_end.index_select(0, rows)
