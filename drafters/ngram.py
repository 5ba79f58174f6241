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

    def __init__(self, *, max_ngram: int = 3, min_ngram: int = 1, full_width: bool = False) -> None:
        """full_width: state every proposal as K wide (Proposal.width = K) though the lookups' lengths vary. Then the
        verify forward is always K + 1 wide (the lengths still mask what is verified: the same tokens), but its
        width is known without reading the device, so on CUDA each round is launched before the last one's copy is
        read (serve.overlap_allowed); without it the round waits for that copy (the width rides in it). Which pays
        depends on the host's cost of a wider forward against a launch gap (benchmarks/speed.py times both)."""
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        if not isinstance(full_width, bool):
            raise ValueError(f"full_width must be true or false, got {full_width!r}")
        self.max_ngram, self.min_ngram, self.full_width = max_ngram, min_ngram, full_width

    capturable = True

    def propose(self, state: DraftState, K: int) -> Proposal:
        """The latest earlier match of the trailing n-gram, longest n first, for every row at once on the device.

        why tensors rather than a per-request search: no device-to-host copy per round and a fixed shape, so the
        slot engine can capture it; `_lookup` is the plain-Python statement of the same rule (tests compare them).
        """
        seq, length = state.seq, state.seq_len  # (B, T), (B,)
        B, T = seq.shape
        cont = torch.full((B,), -1, dtype=torch.long, device=seq.device)  # (B,) where the continuation starts
        for n in range(min(self.max_ngram, T - 1), self.min_ngram - 1, -1):
            windows = seq.unfold(1, n, 1)  # (B, T-n+1, n): windows[b, s] = seq[b, s:s+n]
            tail = seq.gather(1, (length - n).clamp(min=0).unsqueeze(1) + torch.arange(n, device=seq.device))
            start = torch.arange(T - n + 1, device=seq.device)  # (T-n+1,)
            ok = (windows == tail.unsqueeze(1)).all(-1) & (start <= (length - n - 1).unsqueeze(1))
            ok &= (length - 1 >= n).unsqueeze(1)  # the tail must leave an earlier token to match against
            latest = torch.where(ok, start, -1).max(1).values  # (B,) -1 = no match at this n
            cont = torch.where((cont < 0) & (latest >= 0), latest + n, cont)
        lengths = torch.where(cont >= 0, (length - cont).clamp(0, K), 0)  # (B,)
        offsets = torch.arange(K, device=seq.device)
        tokens = seq.gather(1, (cont.clamp(min=0).unsqueeze(1) + offsets).clamp(max=T - 1))  # (B, K)
        tokens = torch.where(offsets < lengths.unsqueeze(1), tokens, 0)
        return Proposal(tokens=tokens, lengths=lengths, width=K if self.full_width else None)

    def _lookup(self, ids: list[int], K: int) -> list[int]:
        for n in range(min(self.max_ngram, len(ids) - 1), self.min_ngram - 1, -1):
            tail = ids[-n:]
            for start in range(len(ids) - n - 1, -1, -1):  # latest earlier occurrence first
                if ids[start: start + n] == tail:
                    return ids[start + n: start + n + K]
        return []
