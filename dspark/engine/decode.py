"""The decode loop: batched speculative decoding, and plain decoding as its zero-draft case.

Shapes: B requests in the batch, K draft positions, V vocabulary, F concatenated host features, Tmax positions.

One round (docs/DSPARK.md §1): 1 draft, 2 schedule, 3 verify, 4 accept, 5 commit. Differences between methods live in
drafters and verifiers, never here. Plain decoding is the same loop with a drafter that proposes nothing (K = 0):
each round verifies only the anchor and draws the next token from p.

Noise keys (see dspark.engine.sampling): the acceptance test of a draft and the draw of the token after the accepted
ones are keyed by the absolute position of the token decided, which each position gets exactly once; drafters key
theirs by (round, k). A request's output therefore depends only on its prompt, seed and the policies, never on its
batch companions (up to float reassociation in batched kernels).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import torch
from tqdm.auto import tqdm

from dspark.engine.acceptance import expected_accepted, greedy_accept, rejection_sample
from dspark.engine.protocol import DraftState, Drafter, NoDrafter, Proposal, VerifyAll
from dspark.engine.results import GenerationResult, RoundLog
from dspark.engine.run import run_slots
from dspark.engine.sampling import (STREAM_ACCEPT, STREAM_SAMPLE, SamplingConfig, argmax, check_finite, process,
                                    sample, uniform)


def _check_engine(engine: str, concurrency: int | None) -> None:
    if engine not in ("slots", "eager"):
        raise ValueError(f"engine must be 'slots' or 'eager', got {engine!r}")
    if concurrency is not None and (isinstance(concurrency, bool) or not isinstance(concurrency, int)
                                    or concurrency < 1):
        raise ValueError(f"concurrency must be an integer >= 1, got {concurrency!r}")
    if concurrency is not None and engine == "eager":
        raise ValueError("continuous batching (concurrency) needs engine='slots'")


def _per_request(value, n: int, what: str) -> list:
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{what} has {len(value)} entries for {n} prompts")
        return list(value)
    return [value] * n


def validate_prompts(host, prompts: Sequence[Sequence[int]], max_new_tokens: list[int]) -> None:
    """Clear errors for empty prompts, bad token ids and requests that do not fit the host's context."""
    if len(prompts) == 0:
        raise ValueError("no prompts given")
    for i, (prompt, new) in enumerate(zip(prompts, max_new_tokens)):
        if len(prompt) == 0:
            raise ValueError(f"prompt {i} is empty: every prompt needs at least one token")
        if isinstance(new, bool) or not isinstance(new, int) or new < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {new!r} for prompt {i}")
        if min(prompt) < 0 or max(prompt) >= host.vocab_size:
            raise ValueError(f"prompt {i} has token ids outside the host vocabulary [0, {host.vocab_size})")
        if len(prompt) + new > host.max_context:
            raise ValueError(f"prompt {i} has {len(prompt)} tokens; with max_new_tokens={new} it needs "
                             f"{len(prompt) + new} positions, beyond the host's context of {host.max_context}")


def generate(host, prompts: Sequence[Sequence[int]], *, drafter: Drafter | None = None, verifier=None,
             draft_length: int = 7, max_new_tokens: int | Sequence[int] = 128,
             sampling: SamplingConfig = SamplingConfig(), seed: int = 0, seeds: Sequence[int] | None = None,
             stop_token_ids: Iterable[int] | None = None, batch_size: int | None = None, progress: bool = False,
             on_tokens: Callable[[int, list[int]], None] | None = None, concurrency: int | None = None,
             engine: str = "slots", graphs: bool | str | None = None, timing: bool = False,
             overlap: bool | None = None) -> GenerationResult:
    """Decode every prompt (lists of token ids); speculative when `drafter` is given, plain otherwise.

    Requests run in static batches of `batch_size` (default: all at once), or, with `concurrency` C, continuously:
    C slots, a queued request entering as soon as one frees. Request i is seeded with seeds[i] (default seed + i).
    `on_tokens(i, new_ids)` is called as tokens of request i are committed (for streaming); when it returns True,
    request i finishes there (reason "stop"), which is how external stopping rules plug in.

    engine "slots" is the slot engine (dspark.engine: fixed shapes, a few verify widths, one device-to-host copy
    per round on CUDA, two in a round after an admission when the verify width depends on device values and in
    every round of the (unlagged) scheduler; CUDA graphs on CUDA unless graphs=False ("static": the graph path
    without capture, any device); timing splits its rounds' time on the device by stage; `overlap`: each round launched
    before the last one is committed, dspark.engine.serve.overlap_allowed: None = on CUDA); "eager" is the
    reference loop below, the oracle the engine is tested against.
    """
    _check_engine(engine, concurrency)
    if overlap and engine == "eager":
        raise ValueError("overlapped rounds (overlap=True) need engine='slots'")
    n = len(prompts)
    limits = _per_request(max_new_tokens, n, "max_new_tokens")
    validate_prompts(host, prompts, limits)
    drafter = drafter or NoDrafter()
    K = 0 if isinstance(drafter, NoDrafter) else draft_length
    if not isinstance(drafter, NoDrafter) and (isinstance(K, bool) or not isinstance(K, int) or K < 1):
        raise ValueError(f"draft_length (gamma) must be an integer >= 1, got {draft_length!r}")
    host.check_taps(drafter.feature_layers)
    if verifier is None:
        verifier = VerifyAll()
    verifier.bind(drafter=drafter, K=K)
    seeds = list(seeds) if seeds is not None else [seed + i for i in range(n)]
    if len(seeds) != n:
        raise ValueError(f"seeds has {len(seeds)} entries for {n} prompts")
    stops = set(host.stop_token_ids if stop_token_ids is None else stop_token_ids)
    batch_size = batch_size or n
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")

    bar = tqdm(total=sum(limits), desc="decode", unit="tok", disable=not progress)
    if engine == "slots":
        return run_slots(host, prompts, drafter=drafter, verifier=verifier, K=K, limits=limits, sampling=sampling,
                         seeds=seeds, stops=stops, batch_size=batch_size, concurrency=concurrency, bar=bar,
                         on_tokens=on_tokens, graphs=graphs, timing=timing, overlap=overlap)
    sink = _Sink(outputs=[[] for _ in range(n)], reasons=["length"] * n, latency=[0.0] * n, log=RoundLog(),
                 stops=stops, bar=bar, on_tokens=on_tokens, t0=time.perf_counter())
    rounds = 0
    for lo in range(0, n, batch_size):
        ids = list(range(lo, min(n, lo + batch_size)))
        rounds += _decode_batch(host, [list(prompts[i]) for i in ids], ids, drafter=drafter, verifier=verifier,
                                K=K, limits=[limits[i] for i in ids], sampling=sampling,
                                seeds=[seeds[i] for i in ids], sink=sink)
    seconds = time.perf_counter() - sink.t0
    bar.close()
    return GenerationResult(token_ids=sink.outputs, finish_reasons=sink.reasons, log=sink.log, seconds=seconds,
                            rounds=rounds, latency=sink.latency, batches=-(-n // batch_size))


@dataclass
class _Sink:
    """Where the eager loop writes what it decodes (indexed by request), and its progress bar and callback."""

    outputs: list[list[int]]
    reasons: list[str]
    latency: list[float]
    log: RoundLog
    stops: set[int]
    bar: object
    on_tokens: Callable[[int, list[int]], bool | None] | None
    t0: float  # generate()'s start, for the log's time column


@dataclass
class _Batch:
    """The live rows of one static batch: the host cache, the drafters' view, and CPU mirrors of each row's
    request index, tokens it may still produce and cache length (for the attention window)."""

    cache: object
    state: DraftState
    request: torch.Tensor  # (B,) CPU
    remaining: torch.Tensor  # (B,) CPU
    cache_len: torch.Tensor  # (B,) CPU
    live: torch.Tensor  # (B,) bool CPU
    start: float  # perf_counter() at the batch's start (latencies count from it)
    rounds: int = 0


def _decode_batch(host, prompts, ids, *, drafter, verifier, K, limits, sampling, seeds, sink: _Sink) -> int:
    """Decode one batch to completion, writing into `sink`; returns the number of rounds."""
    batch = _prefill(host, prompts, ids, drafter=drafter, verifier=verifier, K=K, limits=limits, sampling=sampling,
                     seeds=seeds, sink=sink)
    while _retire(batch, drafter, verifier, host.device):
        _round(host, batch, drafter=drafter, verifier=verifier, K=K, sampling=sampling, sink=sink)
    return batch.rounds


def _prefill(host, prompts, ids, *, drafter, verifier, K, limits, sampling, seeds, sink: _Sink) -> _Batch:
    """The whole prompts through the host, then the first new token from p at the last prompt position; the
    drafter and verifier begin and observe the prompts' features."""
    device, B = host.device, len(prompts)
    start = time.perf_counter()
    plen = torch.tensor([len(p) for p in prompts])
    max_len = int(plen.max()) + max(limits) + K + 2
    request = torch.tensor(ids)  # (B,) request index of each live row
    seq = torch.zeros(B, max_len, dtype=torch.long)  # (B, Tmax)
    for b, p in enumerate(prompts):
        seq[b, : len(p)] = torch.tensor(p)
    seq = seq.to(device)
    cache = host.new_cache(B, max_len)
    state = DraftState(seq=seq, seq_len=plen.to(device).clone(), seeds=torch.tensor(seeds, device=device),
                       rounds=torch.zeros(B, dtype=torch.long, device=device), sampling=sampling)
    out = host.step(cache, seq[:, : int(plen.max())], plen.to(device), taps=drafter.feature_layers,
                    attend=int(plen.max()), compiled=False)
    cache.advance(plen.to(device))
    last = out.hidden.gather(1, (plen.to(device) - 1).view(B, 1, 1).expand(B, 1, out.hidden.shape[-1]))
    first_logits = host.logits(last[:, 0])  # (B, V)
    # why: argmax / sampling of NaN logits returns some token; refuse it like a round's non-finite logits
    check_finite(first_logits, "host logits at prefill (before round 0)", request_ids=request)
    first = _draw(first_logits, sampling, state.seeds, state.seq_len)  # (B,)
    state.seq.scatter_(1, state.seq_len.unsqueeze(1), first.unsqueeze(1))
    state.seq_len += 1
    drafter.begin(host=host, batch_size=B, max_len=max_len)
    verifier.begin(batch_size=B)
    drafter.observe(features=out.features, start=torch.zeros(B, dtype=torch.long, device=device),
                    n_valid=plen.to(device), state=state)
    drafter.prefill(state=state)
    batch = _Batch(cache=cache, state=state, request=request, remaining=torch.tensor(limits), cache_len=plen.clone(),
                   live=torch.ones(B, dtype=torch.bool), start=start)
    batch.live = _commit_cpu(first.cpu().unsqueeze(1), torch.ones(B, dtype=torch.long), batch, sink)
    _record_finished(batch, sink)
    return batch


def _retire(batch: _Batch, drafter, verifier, device) -> bool:
    """Drop the finished rows from every per-row state; False when none is left."""
    if bool(batch.live.all()):
        return True
    rows = batch.live.nonzero().flatten()
    if len(rows) == 0:
        return False
    on_device = rows.to(device)
    for part in (batch.cache, drafter, verifier):
        part.select(on_device)
    s = batch.state
    batch.state = DraftState(seq=s.seq[on_device], seq_len=s.seq_len[on_device], seeds=s.seeds[on_device],
                             rounds=s.rounds[on_device], sampling=s.sampling)
    batch.request, batch.remaining = batch.request[rows], batch.remaining[rows]
    batch.cache_len, batch.live = batch.cache_len[rows], batch.live[rows]
    return True


def _round(host, batch: _Batch, *, drafter, verifier, K, sampling, sink: _Sink) -> None:
    """One round over the live rows: 1 draft, 2 schedule, 3 verify, 4 accept, 5 commit."""
    state, device, B = batch.state, host.device, len(batch.request)
    anchor_pos = state.seq_len - 1  # (B,)
    # 1 draft, unless the verifier decided from finished rounds that this one is plain (Verifier.draft_next)
    drafting = K > 0 and verifier.draft_next()
    if drafting:
        proposal = drafter.propose(state, K)
    else:
        proposal = Proposal(tokens=state.seq.new_zeros(B, K), lengths=state.seq.new_zeros(B), width=0)
    # 2 schedule
    ell = verifier.lengths(proposal, K).clamp(0, K) if drafting else torch.zeros(B, dtype=torch.long, device=device)
    if proposal.lengths is not None:
        ell = torch.minimum(ell, proposal.lengths)
    ell = torch.minimum(ell, (batch.remaining - 1).clamp(min=0).to(device))  # never verify past max_new_tokens
    # 3 verify: [x0, x1..xL] with L = max ell over the batch (the forward is only as wide as the longest
    # verified prefix, so a scheduler that shortens verification saves host compute); only the first
    # ell+1 of each row are real. Every row is padded to L + 1: the forward runs B * (L + 1) tokens.
    L = _verify_width(verifier, proposal, ell, K, batch.remaining) if drafting else 0
    ell = ell.clamp(max=L)  # a no-op unless a drafter's `width` understated its lengths
    tokens, q = proposal.tokens[:, :L], None if proposal.q is None else proposal.q[:, :L]
    inputs = torch.cat([state.anchor.unsqueeze(1), tokens], dim=1)  # (B, L+1)
    out = host.step(batch.cache, inputs, ell + 1, taps=drafter.feature_layers,
                    attend=int(batch.cache_len.max()) + L + 1)
    logits = host.logits(out.hidden)  # (B, L+1, V)
    finite = _finite(logits, q, proposal.confidence)
    # 4 accept
    positions = anchor_pos.unsqueeze(1) + 1 + torch.arange(L + 1, device=device)  # (B, L+1)
    if sampling.greedy:
        acc = greedy_accept(argmax(logits), tokens, ell)
        nxt = acc.next_token
    else:
        u = uniform(state.seeds, positions[:, :L], STREAM_ACCEPT)  # (B, L)
        acc = rejection_sample(process(logits, sampling), q, tokens, ell, u)
        nxt = sample(acc.next_probs, state.seeds, anchor_pos + 1 + acc.n_accepted, STREAM_SAMPLE)
    n_acc = acc.n_accepted
    # 5 commit: accepted drafts then the next token, written after the anchor
    new = torch.cat([tokens, tokens.new_zeros(B, 1)], dim=1).scatter_(1, n_acc.unsqueeze(1), nxt.unsqueeze(1))
    state.seq.scatter_(1, positions.clamp(max=state.seq.shape[1] - 1), new)
    # the drafts the confidences expected to be accepted (a draft gate's price), read with the round's copy
    confident = drafting and proposal.confidence is not None
    expected = expected_accepted(proposal.confidence, ell).sum() if confident else None
    new_cpu, n_cpu, finite_cpu = new.cpu(), n_acc.cpu(), finite.cpu()  # the round's one device-to-host sync
    expected = None if expected is None else float(expected)  # computed before that sync: no wait of its own
    if not bool(finite_cpu.all()):
        bad = batch.request[~finite_cpu].tolist()
        raise FloatingPointError(f"non-finite (NaN/Inf) host or draft logits, or draft confidences outside [0, 1], "
                                 f"in round {batch.rounds} for request(s) {bad}; no token of that round was accepted")
    batch.cache.advance(n_acc + 1)  # the anchor and the accepted drafts are now in the host cache
    batch.cache_len += n_cpu + 1
    drafter.observe(features=out.features, start=anchor_pos, n_valid=n_acc + 1, state=state)
    state.seq_len += n_acc + 1
    state.rounds += 1
    committed_before = batch.remaining.clone()
    batch.live = _commit_cpu(new_cpu, n_cpu + 1, batch, sink)
    _log_round(sink.log, batch, proposal, K, ell, n_cpu, committed_before - batch.remaining, sink.t0, drafting)
    verifier.after_round(slots=B, rows=B, width=L, drafted=drafting, committed=int(n_cpu.sum()) + B,
                         expected=expected)
    _record_finished(batch, sink)
    batch.rounds += 1


def _finite(logits: torch.Tensor, q: torch.Tensor | None, confidence: torch.Tensor | None) -> torch.Tensor:
    """(B,) rows whose host logits, draft distributions and confidences are usable."""
    finite = torch.isfinite(logits).flatten(1).all(1)
    if q is not None:
        finite = finite & torch.isfinite(q).flatten(1).all(1)
    if confidence is not None:  # NaN (or outside [0, 1]) would silently steer the verifier
        finite = finite & ((confidence >= 0) & (confidence <= 1)).all(1)  # NaN fails both comparisons
    return finite


def _log_round(log: RoundLog, batch: _Batch, proposal: Proposal, K: int, ell: torch.Tensor, n_cpu: torch.Tensor,
               committed: torch.Tensor, t0: float, drafted: bool) -> None:
    B = len(batch.request)
    log.request.append(batch.request.clone())
    log.round.append(batch.state.rounds.cpu() - 1)
    log.proposed.append(torch.full((B,), K, dtype=torch.long) if proposal.lengths is None else proposal.lengths.cpu())
    log.verified.append(ell.cpu())
    log.accepted.append(n_cpu)
    log.committed.append(committed)
    if not drafted:  # a plain round (the verifier skipped drafting): no confidences, see RoundLog.confidences
        log.confidence.append(torch.zeros(B, 0))
    else:
        log.confidence.append(None if proposal.confidence is None else proposal.confidence.float().cpu())
    log.batch.append(B)
    log.time.append(time.perf_counter() - t0)


def _verify_width(verifier, proposal: Proposal, ell: torch.Tensor, K: int, remaining: torch.Tensor) -> int:
    """L, the drafts per row of the verify forward, read on the CPU: a static-length verifier (verify-all) knows it
    without a device sync, K or the drafter's own `width` (n-gram, MTP-1 propose fewer than K), never more than
    any row may still verify (remaining (B,) on the CPU); otherwise it is max ell, read from the device once."""
    if verifier.static_length and (proposal.lengths is None or proposal.width is not None):
        width = K if proposal.lengths is None else min(K, int(proposal.width))
        return max(0, min(width, int(remaining.max()) - 1))
    return int(ell.max())


def _record_finished(batch: _Batch, sink: _Sink) -> None:
    now = time.perf_counter()
    for r in batch.request[~batch.live].tolist():
        sink.latency[r] = now - batch.start


def _draw(logits: torch.Tensor, sampling: SamplingConfig, seeds: torch.Tensor, position: torch.Tensor):
    """One token per row from logits (B, V), keyed by its absolute position (B,)."""
    if sampling.greedy:
        return argmax(logits)
    return sample(process(logits, sampling), seeds, position, STREAM_SAMPLE)


def _commit_cpu(new: torch.Tensor, count: torch.Tensor, batch: _Batch, sink: _Sink) -> torch.Tensor:
    """Append the first count[b] tokens of new[b] (cut at a stop token or the length limit); (B,) still live."""
    request, remaining = batch.request, batch.remaining
    live = torch.ones(len(request), dtype=torch.bool)
    for b, (row, c) in enumerate(zip(new.tolist(), count.tolist())):
        take = row[: min(c, int(remaining[b]))]
        for j, t in enumerate(take):
            if t in sink.stops:
                take = take[: j + 1]
                sink.reasons[int(request[b])] = "stop"
                live[b] = False
                break
        sink.outputs[int(request[b])].extend(take)
        remaining[b] -= len(take)
        if remaining[b] <= 0:
            live[b] = False
        if sink.on_tokens is not None and take and sink.on_tokens(int(request[b]), take) and live[b]:
            sink.reasons[int(request[b])] = "stop"  # the callback's own stopping rule (e.g. StoppingCriteria)
            live[b] = False
        sink.bar.update(len(take))
    return live
