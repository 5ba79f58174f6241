"""The drafter contract: what every drafter receives each round and what it returns.

Shapes: B requests, K draft positions, V vocabulary, T tokens, F = m*H concatenated host features.
Notation (DSPARK.md): p = host distribution, q = draft distribution, c = confidence.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark.sampling import SamplingConfig


@dataclass
class Proposal:
    """What a drafter proposes for one round."""

    tokens: torch.Tensor  # (B, K) long: x1..xK
    q: torch.Tensor | None = None  # (B, K, V) float32: the exact distributions x was sampled from; None = point mass
    confidence: torch.Tensor | None = None  # (B, K) in [0, 1]: P(x_k survives | x_<k survived)
    lengths: torch.Tensor | None = None  # (B,) long: valid proposals per request (<= K); None = all K


@dataclass
class DraftState:
    """The decode loop's view of the batch, handed to `Drafter.propose` each round.

    `seq[b, :seq_len[b]]` are the committed tokens (prompt + generated) of request b; the last one is the anchor
    x0, committed but not yet run through the host. `seeds` and `rounds` key the counter-based sampling noise so a
    request's draws depend only on its own seed and history, never on its batch companions.
    """

    seq: torch.Tensor  # (B, Tmax) long
    seq_len: torch.Tensor  # (B,) long
    seeds: torch.Tensor  # (B,) long
    rounds: torch.Tensor  # (B,) long: rounds done so far by each request
    sampling: SamplingConfig

    @property
    def anchor(self) -> torch.Tensor:
        """(B,) the last committed token of each request."""
        return self.seq.gather(1, (self.seq_len - 1).unsqueeze(1)).squeeze(1)


class Drafter:
    """Base class of every drafter. Subclasses set `feature_layers` and implement `propose`.

    Round protocol driven by `dspark.decode.speculative_generate`:
      begin(...)            once per batch, after the host prefilled the prompts
      observe(...)          host features of newly committed positions (prompt, then accepted tokens each round)
      propose(state, K)     draft K tokens after the anchor
      select(rows)          keep only these batch rows (finished requests leave the batch)
    """

    name: str = "drafter"
    #: attributes holding per-request state, batch-major (a KVCache's batch rows, or a tensor's dim 0). The slot
    #: engine (dspark.engine.slots) admits a request into a free slot by running begin/observe on a sub-batch and
    #: writing these rows into the full batch's state in place; the static batch is the case of one admission.
    slot_state: tuple[str, ...] = ()
    #: True when propose/observe are tensor-only (no host syncs, no Python branching on values) and update state in
    #: place: the slot engine may then capture them in a CUDA graph
    capturable: bool = False
    #: host layers whose raw outputs this drafter consumes (concatenated in this order); () = none
    feature_layers: tuple[int, ...] = ()

    def begin(self, *, host, batch_size: int, max_len: int) -> None:
        """Allocate per-batch state for `batch_size` requests of at most `max_len` positions."""

    def observe(self, *, features: torch.Tensor | None, start: torch.Tensor, n_valid: torch.Tensor,
                state: DraftState) -> None:
        """Host features (B, T, F) of positions start[b] .. start[b]+n_valid[b]-1, now committed."""

    def propose(self, state: DraftState, K: int) -> Proposal:
        raise NotImplementedError

    def select(self, rows: torch.Tensor) -> None:
        """Keep only batch rows `rows` (B',) of the per-batch state, in that order."""


@dataclass
class TrainBatch:
    """One training step's inputs, host outputs computed online (no feature cache). T tokens, B sequences.

    host_logits[b, t] is the host's next-token distribution after input_ids[b, :t+1] (it targets token t+1);
    loss_mask[b, t] = 1 where token t is an assistant (response) token, the only tokens drafted/anchored on.
    """

    input_ids: torch.Tensor  # (B, T) long
    loss_mask: torch.Tensor  # (B, T) long/bool
    document_ids: torch.Tensor  # (B, T) long: packed documents never see each other
    features: torch.Tensor | None  # (B, T, F) host taps of the drafter's feature_layers, or None
    host_logits: torch.Tensor  # (B, T, V) float
    generator: torch.Generator | None = None  # for anchor sampling, so resumed runs repeat exactly


@dataclass
class TrainOutput:
    loss: torch.Tensor  # scalar, differentiable
    metrics: dict  # str -> float: loss parts (ce, tv, conf, ...), for logging
    acceptance: torch.Tensor  # (K,) teacher-forced conditional acceptance estimate per position, in [0, 1]
