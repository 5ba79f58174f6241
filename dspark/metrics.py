"""DSPARK.md §5's metric vocabulary, every number computed from one rollout log (`GenerationResult`).

Shapes: N request-rounds (rows of the RoundLog), K draft positions.

Conventions (stated because papers differ):
- tau counts the bonus token: accepted + 1 per request-round; `accepted_per_round` does not.
- Conditional acceptance at k is P(x_k accepted | x_1..x_{k-1} accepted), estimated on the rows that verified
  at least k drafts (a row that verified fewer says nothing about x_k). Prefix survival at k is P(x_1..x_k all
  accepted | at least k verified). Under verify-all the two conditions are the same for every row.
- Verify rate = accepted / verified drafts; verified-token savings = 1 - verified / proposed.
- Host forward passes per committed token counts each request-round and each request's prefill as one pass
  for that request (`per_request`), and each batched forward once (`batched`).
"""
from __future__ import annotations

import math

import torch

from dspark.decode import GenerationResult


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def position_acceptance(verified: torch.Tensor, accepted: torch.Tensor, K: int) -> dict[str, list[float]]:
    """Per-position conditional acceptance and prefix survival from (N,) verified and accepted counts."""
    conditional, survival, support = [], [], []
    for k in range(1, K + 1):
        seen = verified >= k
        reached = seen & (accepted >= k - 1)
        survived = seen & (accepted >= k)
        conditional.append(_ratio(float(survived.sum()), float(reached.sum())))
        survival.append(_ratio(float(survived.sum()), float(seen.sum())))
        support.append(int(seen.sum()))
    return {"conditional_acceptance": conditional, "prefix_survival": survival, "rows_verifying_k": support}


def summarize(result: GenerationResult, *, draft_length: int | None = None) -> dict:
    """Every §5 metric of one run as a flat, JSON-ready dict (per-position lists indexed from position 1)."""
    log = result.log
    proposed, verified = log.column("proposed"), log.column("verified")
    accepted, committed = log.column("accepted"), log.column("committed")
    K = draft_length if draft_length is not None else (int(proposed.max()) if len(proposed) else 0)
    requests = len(result.token_ids)
    new_tokens = sum(len(t) for t in result.token_ids)
    row_passes = len(accepted) + requests  # each request-round, plus each request's prefill
    batched_passes = result.rounds + result.batches
    per_request_tps = [len(t) / s for t, s in zip(result.token_ids, result.latency) if s > 0]
    out = {
        "requests": requests,
        "new_tokens": new_tokens,
        "request_rounds": len(accepted),
        "rounds": result.rounds,
        "draft_length": K,
        "tau": float((accepted + 1).float().mean()) if len(accepted) else float("nan"),
        "accepted_per_round": float(accepted.float().mean()) if len(accepted) else float("nan"),
        "proposed_per_round": float(proposed.float().mean()) if len(proposed) else float("nan"),
        "verified_per_round": float(verified.float().mean()) if len(verified) else float("nan"),
        "verify_rate": _ratio(float(accepted.sum()), float(verified.sum())),
        "verified_token_savings": 1.0 - _ratio(float(verified.sum()), float(proposed.sum()))
        if float(proposed.sum()) else float("nan"),
        "committed_tokens": int(committed.sum()),
        "seconds": result.seconds,
        "tokens_per_s": _ratio(new_tokens, result.seconds),
        "tokens_per_s_per_request": sum(per_request_tps) / len(per_request_tps) if per_request_tps else float("nan"),
        "forward_passes_per_token_per_request": _ratio(row_passes, new_tokens),
        "forward_passes_per_token_batched": _ratio(batched_passes, new_tokens),
        "mean_batch": sum(log.batch) / len(log.batch) if log.batch else float("nan"),
    }
    out.update(position_acceptance(verified, accepted, K))
    return out


def expected_tau(conditional: list[float]) -> float:
    """tau implied by per-position conditional acceptances under verify-all: 1 + sum_k prod_{i<=k} alpha_i."""
    total, survive = 1.0, 1.0
    for alpha in conditional:
        if math.isnan(alpha):
            break
        survive *= alpha
        total += survive
    return total


def markdown_table(rows: list[dict], columns: list[tuple[str, str]]) -> str:
    """A GitHub-markdown table: `columns` are (key, header); floats printed with 3 decimals."""
    def cell(value) -> str:
        if isinstance(value, float):
            return "nan" if math.isnan(value) else f"{value:.3f}"
        return str(value)

    lines = ["| " + " | ".join(h for _, h in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r.get(k, "")) for k, _ in columns) + " |" for r in rows]
    return "\n".join(lines)
