"""What a decode returns, from the eager loop (`decode.py`) and the slot engine (`run.py`) alike: the new tokens of
every request and one log row per (request, round), from which every metric of docs/DSPARK.md §5 is computed."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class RoundLog:
    """One row per (request, round): everything docs/DSPARK.md §5's metrics need. Tensors are on the CPU."""

    request: list[torch.Tensor] = field(default_factory=list)  # (B,) request index in the prompt list
    round: list[torch.Tensor] = field(default_factory=list)  # (B,) the request's round number
    proposed: list[torch.Tensor] = field(default_factory=list)  # (B,) drafts offered
    verified: list[torch.Tensor] = field(default_factory=list)  # (B,) ell: drafts the host verified
    accepted: list[torch.Tensor] = field(default_factory=list)  # (B,) drafts accepted
    committed: list[torch.Tensor] = field(default_factory=list)  # (B,) tokens committed (accepted + 1, cut at stops)
    # (B, K), or None when the drafter gives none; (B, 0) for a round the verifier did not draft in (a plain
    # round: Verifier.draft_next), which `confidences` pads with zeros (their rows verify and accept nothing)
    confidence: list[torch.Tensor | None] = field(default_factory=list)
    batch: list[int] = field(default_factory=list)  # requests in the batch that round (the load)
    time: list[float] = field(default_factory=list)  # seconds since generate() started, at the end of the round

    def column(self, name: str) -> torch.Tensor:
        """All rows of one integer column, concatenated: (N,)."""
        parts = getattr(self, name)
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)

    def per_round(self, name: str) -> list[torch.Tensor]:
        """One integer column split into rounds, (batch[i],) each, whether it was logged per round (the eager
        loop) or as one tensor at the end (the slot engine)."""
        return list(self.column(name).split(self.batch))

    def confidences(self) -> torch.Tensor | None:
        """(N, K) confidences of every row, or None when the drafter gave none."""
        if not self.confidence or any(c is None for c in self.confidence):
            return None
        K = max(c.shape[1] for c in self.confidence)
        if K == 0:
            return None
        return torch.cat([c if c.shape[1] == K else c.new_zeros(c.shape[0], K) for c in self.confidence])

    def extend(self, other: "RoundLog") -> None:
        for name in ("request", "round", "proposed", "verified", "accepted", "committed", "confidence", "batch",
                     "time"):
            getattr(self, name).extend(getattr(other, name))


@dataclass
class GenerationResult:
    token_ids: list[list[int]]  # new tokens of each request, in prompt order
    finish_reasons: list[str]  # "stop" (a stop token was generated) or "length"
    log: RoundLog
    seconds: float
    rounds: int  # loop iterations (batched rounds), prefill excluded
    latency: list[float] = field(default_factory=list)  # per request: seconds from its admission to its end
    batches: int = 1  # prefill forwards: static batches, or groups of arrivals admitted together
    ttft: list[float] = field(default_factory=list)  # per request: seconds from its admission to its first token
    engine: dict = field(default_factory=dict)  # slot engine: graphs, warmup_s, stage_s, in_flight, admissions

    @property
    def stats(self) -> dict:
        """tau (accepted + 1 per request-round), rounds, tokens_per_s and token counts."""
        accepted = self.log.column("accepted").float()
        new_tokens = sum(len(t) for t in self.token_ids)
        return {
            "tau": float((accepted + 1).mean()) if len(accepted) else float("nan"),
            "rounds": self.rounds,
            "tokens_per_s": new_tokens / self.seconds if self.seconds > 0 else float("nan"),
            "new_tokens": new_tokens,
            "seconds": self.seconds,
        }
