"""Temperature / top-k / top-p processing and counter-based, batch-invariant sampling.

Shapes: B requests, K positions, V vocabulary.

Randomness is a pure function of (seed, counter, stream, index) computed with an integer hash (splitmix64), not a
stateful generator. why: a request's draws must not depend on which other requests share its batch, the same code
must run inside a captured CUDA graph (no generator state, no host sync), and every round needs fresh noise
for losslessness. Sampling from probabilities is the exponential race argmax_v p_v / E_v, E ~ Exp(1), which is an
exact draw from p and needs no cumulative sum or sync.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# Streams keep the noise of different decisions independent.
STREAM_SAMPLE = 1  # plain decoding and the bonus token
STREAM_DRAFT = 2  # drafter sampling x_k ~ q_k
STREAM_ACCEPT = 3  # the uniform u_k of the acceptance test
STREAM_RESIDUAL = 4  # resampling from norm(max(p - q, 0))
STREAM_ANCHOR = 5  # training: the anchor positions of a packed row (drafters/dspark.py sample_anchors)

_M1 = -0x40A7B892E31B1A47  # 0xbf58476d1ce4e5b9 as a signed int64
_M2 = -0x6B2FB644ECCEEE15  # 0x94d049bb133111eb as a signed int64
_GOLD = -0x61C8864680B583EB  # 0x9e3779b97f4a7c15 as a signed int64


@dataclass(frozen=True)
class SamplingConfig:
    """How tokens are drawn. temperature 0 is greedy; top_k 0 and top_p 1 are off."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        t, p, k = self.temperature, self.top_p, self.top_k
        if not isinstance(t, (int, float)) or math.isnan(t) or math.isinf(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        if not isinstance(p, (int, float)) or math.isnan(p) or not (0.0 < p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {p!r}")
        if not isinstance(k, int) or isinstance(k, bool) or k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {k!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64 finaliser on int64 (wrapping arithmetic)."""
    x = x ^ _shr(x, 30)
    x = x * _M1
    x = x ^ _shr(x, 27)
    x = x * _M2
    return x ^ _shr(x, 31)


def uniform(seeds: torch.Tensor, counter: torch.Tensor, stream: int, n: int | None = None) -> torch.Tensor:
    """Uniform(0, 1) float32 noise keyed by (seed, counter, stream[, index]).

    seeds (B,) and counter (B, ...) long; returns counter.shape, or counter.shape + (n,) when n is given.
    """
    key = _mix(seeds.reshape(seeds.shape + (1,) * (counter.dim() - 1)) * _GOLD + stream)
    key = _mix(key ^ (counter * _M2 + 0x632BE59BD9B4E019))
    if n is not None:
        idx = torch.arange(n, device=counter.device, dtype=torch.long)
        key = _mix(key.unsqueeze(-1) ^ (idx * _GOLD))
    # 53 random bits -> (0, 1) in float64, then float32 clamped away from 0 and 1
    u = (_shr(key, 11).to(torch.float64) + 0.5) / float(1 << 53)
    return u.to(torch.float32).clamp_(1e-12, 1 - 1e-7)


# why not x.argmax(-1) alone: inductor never splits an arg-reduction (torch/_inductor/ir.py, num_splits), so under
# torch.compile a row of a large vocabulary is reduced by one program, and in the compiled rounds of a host with a
# vocabulary of Qwen2.5's size the argmaxes of a propose (DSpark's seven) become a large share of it. Two stages,
# the max of each of 128 chunks of a row and then the first chunk holding the row's max, spread a row over 128
# programs and give the same first maximal index; compiled and replayed in CUDA graphs they are several times
# faster at 1 and 8 rows and about even at 64 (benchmarks/argmax_split.py measures both). With more rows one stage
# has programs enough.
_ARGMAX_CHUNKS = 128
_ARGMAX_MIN_VOCAB = 16384  # shorter rows stay one stage: one program reduces them in a few microseconds
_ARGMAX_MAX_ROWS = 64


def argmax(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, -1) for x (..., V): (...,) long, the first maximal index of each row (NaN counts as the
    largest); in two stages (above) for at most 64 rows of V >= 16,384 that split into at least 8 equal chunks."""
    V = x.shape[-1]
    chunks = math.gcd(V, _ARGMAX_CHUNKS)
    if chunks < 8 or V < _ARGMAX_MIN_VOCAB or x.numel() > _ARGMAX_MAX_ROWS * V:
        return x.argmax(-1)
    width = V // chunks
    best, index = x.reshape(*x.shape[:-1], chunks, width).max(-1)  # (..., chunks) each chunk's max, first index
    chunk = best.argmax(-1, keepdim=True)  # (..., 1) the first chunk holding the row's max holds its first index
    return (chunk * width + index.gather(-1, chunk)).squeeze(-1)


def process(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """Host logits (..., V) -> the distribution p that sampling targets (float32, rows sum to 1).

    Greedy gives the one-hot of the argmax. Order as in transformers: temperature, top-k, top-p.
    """
    logits = logits.float()
    if cfg.greedy:
        return torch.nn.functional.one_hot(argmax(logits), logits.shape[-1]).float()
    logits = logits / cfg.temperature
    if cfg.top_k and cfg.top_k < logits.shape[-1]:
        kth = logits.topk(cfg.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if cfg.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=False)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop_sorted = cum <= 1 - cfg.top_p
        drop_sorted[..., -1] = False  # always keep the most likely token
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def sample(probs: torch.Tensor, seeds: torch.Tensor, counter: torch.Tensor, stream: int) -> torch.Tensor:
    """Exact draw from probs (B, ..., V) by the exponential race; counter (B, ...) keys the noise. Returns (B, ...)."""
    e = -torch.log(uniform(seeds, counter, stream, probs.shape[-1]))  # Exp(1), (B, ..., V)
    return argmax(probs / e)


def check_finite(x: torch.Tensor, what: str, *, round_index: int | None = None,
                 request_ids: torch.Tensor | None = None) -> None:
    """Raise FloatingPointError naming the round and requests when x (B, ...) holds NaN or Inf."""
    bad = ~torch.isfinite(x).reshape(x.shape[0], -1).all(-1)
    if bool(bad.any()):
        rows = bad.nonzero().flatten()
        ids = (request_ids[rows] if request_ids is not None else rows).tolist()
        where = f" in round {round_index}" if round_index is not None else ""
        raise FloatingPointError(f"non-finite values (NaN/Inf) in {what}{where} for request(s) {ids}")
