"""Independent small-LM drafter (docs/DSPARK.md §2.5): any causal LM sharing the host's tokenizer drafts K tokens
autoregressively from the committed tokens alone (no host features).

Shapes: B requests, T tokens in a step, K draft positions, V vocabulary (the host's, which the small LM must share),
W = K + 1 the width of a round's catch-up step.

The small LM runs through its own `dspark.engine.host.Host` adapter and ragged `KVCache`. Its cache holds the committed
tokens it has already fed (`cache.lengths`). The prompt is fed at admission (`prefill`); a round then feeds the
pending committed tokens (the anchor; after a round whose K drafts were all accepted also x_K, which was drafted
but never fed) as one ragged step of fixed width W, then drafts x2..xK one token at a time past the committed
length. Drafted positions whose tokens the host accepts keep their keys (they were computed from exactly those
tokens); the rest are overwritten next round, so rollback is moving a length.

Fixed shapes and no host sync, so the slot engine captures the propose step as a CUDA graph (`capturable`). More
than W pending tokens happen only after plain rounds (Verifier.draft_next) or without a prefill; an eager propose
first feeds that backlog (one device read), a captured one feeds W per round until it has caught up (its drafts
meanwhile follow an older context: still lossless, since only verified tokens are kept). "Captured" is
`dspark.engine.protocol.fixed_shapes`: the capture itself and the graph runner's warm-ups and static re-runs.
"""
from __future__ import annotations

import os

import torch

from dspark.engine.host import Host
from dspark.engine.kv_cache import KVCache
from dspark.engine.protocol import DraftState, Drafter, Proposal, fixed_shapes

SPARE_POSITIONS = 64  # cache positions past the engine's max_len (see begin); also the largest K


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
    capturable = True
    # why not compiled whole: its steps run the small LM's own Host.step (compiled piecewise when the host is); with
    # that nested in a whole-method compile, the CUDA tests of 2026-12-05 (H100) failed its greedy graph-round cases
    compile_whole = False
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
        # why spare positions: the fixed-width catch-up and the drafted keys of a row near its budget, or of an idle
        # slot frozen at its end, reach up to 2K - 2 positions past the committed length (never read, overwritten)
        self.cache = self.lm.new_cache(batch_size, max_len + SPARE_POSITIONS)
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
    def prefill(self, *, state: DraftState) -> None:
        """Feed every committed token but the anchor (the prompt), eagerly, so rounds feed only a few."""
        n = state.seq_len - 1 - self.cache.lengths
        self._feed(state, n, int(n.max()))

    def _feed(self, state: DraftState, n: torch.Tensor, width: int) -> None:
        """Feed the next n (B,) committed tokens of each row, width = max(n), in one ragged step."""
        if width > 0:
            index = (self.cache.lengths.unsqueeze(1) + torch.arange(width, device=n.device)).clamp(
                max=state.seq.shape[1] - 1)  # (B, width)
            self.lm.step(self.cache, state.seq.gather(1, index), n.clamp(min=0), compiled=False)
            self.cache.advance(n.clamp(min=0))
        self.drafted_end.copy_(self.cache.lengths)

    @torch.no_grad()
    def propose(self, state: DraftState, K: int) -> Proposal:
        if K > SPARE_POSITIONS:
            raise ValueError(f"the small-LM drafter drafts at most {SPARE_POSITIONS} tokens a round, asked for {K}")
        B = state.seq.shape[0]
        cache, device = self.cache, state.seq.device
        W, attend = K + 1, None  # None: the whole cache (fixed shapes, capturable)
        # why fixed_shapes, not "is the stream capturing": a graph runner's warm-ups must run the shapes its capture
        # runs, or torch.compile recompiles the host-step pieces inside the capture (protocol.graph_shapes)
        if not fixed_shapes(device):
            backlog = state.seq_len - cache.lengths - W  # (B,) past W only after plain rounds, or without a prefill
            width, end = (int(x) for x in torch.stack([backlog.max(), state.seq_len.max()]).cpu())  # one read
            self._feed(state, backlog, width)
            attend = end  # called eagerly: attend only the (bucketed) committed prefix, as the host step does
        # committed tokens not fed yet, the anchor last; 0 only on an idle slot proposed twice without a commit
        # (the graph runner's warm-up), whose drafts are never verified
        pending = (state.seq_len - cache.lengths).clamp(0, W)  # (B,)
        index = (cache.lengths.unsqueeze(1) + torch.arange(W, device=device)).clamp(max=state.seq.shape[1] - 1)
        out = self.lm.step(cache, state.seq.gather(1, index), pending, attend=attend)  # (B, W) fixed width
        last = (pending - 1).clamp(min=0).view(B, 1, 1).expand(B, 1, out.hidden.shape[-1])
        h = out.hidden.gather(1, last)[:, 0]  # (B, H)
        cache.advance(pending)  # the pending committed tokens are fed now
        committed = cache.lengths.clone()  # (B,)
        ones = torch.ones(B, dtype=torch.long, device=device)
        tokens, qs = [], []
        for k in range(K):
            logits = self.lm.logits(h)  # (B, V)
            q, token = state.draw(logits, k)  # q (B, V): the exact distribution x_{k+1} is drawn from
            tokens.append(token)
            qs.append(q)
            if k < K - 1:  # x_K is never fed this round: the host decides it first
                h = self.lm.step(cache, token.unsqueeze(1), ones,
                                 attend=None if attend is None else attend + k + 1).hidden[:, 0]  # (B, H)
                cache.advance(ones)
        self.drafted_end.copy_(cache.lengths)  # committed + K-1 drafted positions (in place: see Drafter.capturable)
        cache.rollback(committed)
        return Proposal(tokens=torch.stack(tokens, 1), q=torch.stack(qs, 1))  # (B, K), (B, K, V)

    def select(self, rows: torch.Tensor) -> None:
        self.cache.select(rows)
        self.drafted_end = self.drafted_end.index_select(0, rows)
