"""docs/DSPARK.md §5's metric vocabulary, every number computed from one rollout log (`GenerationResult`).

Shapes: N request-rounds (rows of the RoundLog), K draft positions.

Conventions (stated because papers differ):
- tau counts the bonus token: accepted + 1 per request-round; `accepted_per_round` does not.
- Conditional acceptance at k is P(x_k accepted | x_1..x_{k-1} accepted), estimated on the rows that verified
  at least k drafts (a row that verified fewer says nothing about x_k). Prefix survival at k is P(x_1..x_k all
  accepted | at least k verified). Under verify-all the two conditions are the same for every row.
- Verify rate = accepted / verified drafts; verified-token savings = 1 - verified / proposed, both over the rounds
  that drafted (a round a draft gate kept plain proposes nothing): a scheduler that drafted 2 rounds of 190 reports
  the savings of those 2, so read it beside `proposed_per_round` and the share of rounds drafted.
- Undefined values (a ratio with nothing to divide by: plain decoding's verify rate, the acceptance at a position no
  row verified) are NaN here and null in every JSON file the toolkit writes (dspark.engine.jsonio.dumps).
- Host forward passes per committed token counts each request-round and each request's prefill as one pass
  for that request (`per_request`), and each batched forward once (`batched`).
- Uncertainty: `tau_ci95` is a percentile bootstrap over requests, not rounds (a request's rounds share its
  prompt and are correlated, so resampling rounds would understate the spread). `paired_tau_ratio` compares two
  runs on the same prompts with the same resampled requests for both, which cancels most prompt-to-prompt variance.
"""
from __future__ import annotations

import math

import torch

from dspark.engine.results import GenerationResult


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


BOOTSTRAP_RESAMPLES = 2000


def per_request_sums(result: GenerationResult) -> tuple[list[int], list[int]]:
    """Per request, in prompt order: tokens committed with the bonus (sum of accepted + 1) and request-rounds."""
    log, requests = result.log, len(result.token_ids)
    request, accepted = log.column("request"), log.column("accepted")
    tau_sum = torch.bincount(request, weights=(accepted + 1).double(), minlength=requests)
    rounds = torch.bincount(request, minlength=requests)
    return [int(v) for v in tau_sum.tolist()], [int(v) for v in rounds.tolist()]


def _resampled_tau(tau_sum: torch.Tensor, rounds: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    den = rounds[index].sum(1).double()
    return torch.where(den > 0, tau_sum[index].sum(1).double() / den.clamp(min=1), torch.nan)


def _index(n: int, resamples: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)  # a fixed seed: the same run always reports the same interval
    return torch.randint(n, (resamples, n), generator=g)


def _quantiles(values: torch.Tensor, level: float) -> list[float]:
    values = values[~values.isnan()]
    if not len(values):
        return [float("nan"), float("nan")]
    lo, hi = torch.quantile(values, torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=values.dtype)).tolist()
    return [lo, hi]


def tau_interval(tau_sum: list[int], rounds: list[int], *, level: float = 0.95,
                 resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0) -> list[float]:
    """[lo, hi] percentile-bootstrap interval of tau = sum(tau_sum) / sum(rounds), resampling requests."""
    if len(tau_sum) != len(rounds):
        raise ValueError(f"{len(tau_sum)} per-request tau sums but {len(rounds)} round counts")
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    if not sum(rounds):
        return [float("nan"), float("nan")]
    a, n = torch.tensor(tau_sum, dtype=torch.float64), torch.tensor(rounds)
    return _quantiles(_resampled_tau(a, n, _index(len(a), resamples, seed)), level)


#: what an eval JSON records about the prompts it scored and how it decoded them (dspark.cli.cmd_eval):
#: two runs are paired only when they agree on every one, so what differs is the drafter (drafter, drafter_path)
PROMPT_SETTINGS = ("host", "data", "split", "heldout_fraction", "offset", "limit", "max_prompt_length", "requests")
DECODE_SETTINGS = ("max_new_tokens", "temperature", "top_p", "top_k", "seed", "draft_length", "verifier", "threshold")


def check_pairable(a: dict, b: dict) -> None:
    """ValueError naming the first setting two eval results differ in (a setting one of them lacks counts as
    different: it was written before that setting was recorded, so the pairing cannot be checked)."""
    for group, keys in (("are not over the same prompts", PROMPT_SETTINGS),
                        ("were not decoded the same way", DECODE_SETTINGS)):
        for key in keys:
            if (key in a) != (key in b) or a.get(key) != b.get(key):
                shown = [repr(m[key]) if key in m else "(not recorded)" for m in (a, b)]
                raise ValueError(f"{group}: {key} {shown[0]} vs {shown[1]}")


def paired_tau_ratio(a: dict, b: dict, *, level: float = 0.95, resamples: int = BOOTSTRAP_RESAMPLES,
                     seed: int = 0) -> dict:
    """tau(a) / tau(b) for two `summarize` outputs over the same prompts, with a paired bootstrap interval.

    Both runs are resampled with the same requests, so a prompt that is easy for both moves both taus together.
    `p_not_above` is the fraction of resamples with ratio <= 1 (small: a is reliably above b). Results that differ
    in a setting of `check_pairable` are refused."""
    for name, m in (("first", a), ("second", b)):
        if "per_request_tau_sum" not in m:
            raise ValueError(f"the {name} result has no per-request sums (written before they were recorded?)")
    if len(a["per_request_rounds"]) != len(b["per_request_rounds"]):
        raise ValueError(f"not the same prompts: {len(a['per_request_rounds'])} vs {len(b['per_request_rounds'])} "
                         "requests")
    check_pairable(a, b)
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    if not sum(a["per_request_rounds"]) or not sum(b["per_request_rounds"]):
        raise ValueError("a result with no request-rounds has no tau to compare")
    index = _index(len(a["per_request_rounds"]), resamples, seed)
    taus = [_resampled_tau(torch.tensor(m["per_request_tau_sum"], dtype=torch.float64),
                           torch.tensor(m["per_request_rounds"]), index) for m in (a, b)]
    ratio = taus[0] / taus[1]
    tau_a = sum(a["per_request_tau_sum"]) / sum(a["per_request_rounds"])
    tau_b = sum(b["per_request_tau_sum"]) / sum(b["per_request_rounds"])
    finite = ratio[~ratio.isnan()]
    return {"ratio": tau_a / tau_b, "ci": _quantiles(ratio, level), "level": level, "tau": [tau_a, tau_b],
            "p_not_above": float((finite <= 1).double().mean()) if len(finite) else float("nan"),
            "requests": len(a["per_request_rounds"]), "resamples": resamples}


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
    tau_sum, rounds = per_request_sums(result)
    out.update(tau_ci95=tau_interval(tau_sum, rounds), per_request_tau_sum=tau_sum, per_request_rounds=rounds)
    return out


def break_even(rows: list[dict], *, x: str = "concurrency") -> dict[str, int | None]:
    """Per method, the smallest `x` (concurrency) at which it is no faster than plain decoding (speedup <= 1), None
    when it is faster at every x measured. rows: {"method", x, "speedup" (tokens/s over plain's at that x)}."""
    out: dict[str, int | None] = {}
    for method in dict.fromkeys(r["method"] for r in rows):
        slower = [r[x] for r in rows if r["method"] == method and r["speedup"] <= 1.0]
        out[method] = min(slower) if slower else None
    return out


def markdown_table(rows: list[dict], columns: list[tuple[str, str]]) -> str:
    """A GitHub-markdown table: `columns` are (key, header); floats printed with 3 decimals, undefined values (NaN,
    None) as a dash."""
    def cell(value) -> str:
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return "–"  # undefined in this run (see the module docstring)
        if isinstance(value, float):
            return f"{value:.3f}"
        return str(value)

    lines = ["| " + " | ".join(h for _, h in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r.get(k, "")) for k, _ in columns) + " |" for r in rows]
    return "\n".join(lines)
