"""Prompt-lookup (n-gram) drafter: model-free, proposes the continuation of the latest earlier match of the
trailing n-gram in the request's own tokens (prompt and output), longest n first.

Deterministic: q is a point mass on each proposed token (Proposal.q = None), so rejection sampling accepts x_k
with probability p_k(x_k) and stays lossless. Requests without a match propose nothing (lengths 0).
"""
from __future__ import annotations

import torch

from dspark.engine.protocol import DraftState, Drafter, Proposal


class NgramDrafter(Drafter):
    name = "ngram"

    def __init__(self, *, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, state: DraftState, K: int) -> Proposal:
        # why a Python loop: matching is a search over each request's own history on the CPU, cheap next to a
        # host forward, and has no fixed-shape tensor form worth capturing
        seq, seq_len = state.seq.cpu(), state.seq_len.cpu()
        B = seq.shape[0]
        tokens = torch.zeros(B, K, dtype=torch.long)
        lengths = torch.zeros(B, dtype=torch.long)
        for b in range(B):
            found = self._lookup(seq[b, : int(seq_len[b])].tolist(), K)
            tokens[b, : len(found)] = torch.tensor(found, dtype=torch.long)
            lengths[b] = len(found)
        device = state.seq.device
        return Proposal(tokens=tokens.to(device), lengths=lengths.to(device), width=int(lengths.max()) if B else 0)

    def _lookup(self, ids: list[int], K: int) -> list[int]:
        for n in range(min(self.max_ngram, len(ids) - 1), self.min_ngram - 1, -1):
            tail = ids[-n:]
            for start in range(len(ids) - n - 1, -1, -1):  # latest earlier occurrence first
                if ids[start: start + n] == tail:
                    return ids[start + n: start + n + K]
        return []
