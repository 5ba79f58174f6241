"""SPS(M): host verify steps/s at M tokens per forward, profiled once per host and device (docs/DSPARK.md §4.3).

Shapes: R requests, T tokens per request in one forward, M = total tokens in the forward (docs/DSPARK.md's B; in this
code B is always requests), R * T both when
profiling and when scheduling: the decode loop verifies on a rectangular (R, L + 1) batch, L = max_r ell_r, so a
round costs `verify_tokens` = R·(L + 1) tokens however the drafts are split between requests.

What is timed is the loop's own verify call: each request holds `context` cached positions in a cache as long as
the slot engine allocates for that context, and the step attends the prefix the eager loop attends at that length
(`host.step(..., attend=context + T)`, bucketed by the host), or in graph mode the whole cache, as the slot engine's
captured rounds do.

The table is a list of profiled points (M_i, SPS_i) with M_i strictly increasing. Between points SPS is linearly
interpolated. Below the first point it is clamped to SPS(M_0) (a smaller forward is never assumed faster than the
smallest one measured). Above the last point the step time is extrapolated proportionally to M,
SPS(M) = SPS(M_last) * M_last / M (the compute-bound regime), so the scheduler never treats unmeasured large
batches as free.

Cost-table JSON (`CostModel.save`, format "dspark.cost_model", version 1):
    format, version            "dspark.cost_model", 1
    host                       host name (`host.name`); loading for another host is an error
    device                     device description, `device_description(host.device)`: "cpu" or
                               "cuda (NVIDIA H200)"; loading on another device is an error
    dtype                      host dtype, e.g. "torch.bfloat16"
    mode                       "eager" or "graph" (the verify step timed as called, or as a replayed CUDA graph as
                               the slot engine runs it on CUDA; `profile` picks graph there by default)
    date                       ISO-8601 UTC time of profiling
    torch_version              torch.__version__ at profiling time
    batch_sizes                profiled numbers of requests R
    tokens_per_request         profiled tokens per request T
    context                    cached positions per request while timing (0 in hand-made tables)
    cache_length               positions per request of the cache the steps ran over: the slot engine's for
                               `context` (`kv_cache.slot_cache_length`); 0 where not recorded (hand-made tables,
                               and tables of earlier versions, over context + T + 64 positions per point)
    tokens                     M grid (int, strictly increasing)
    sps                        verify steps per second at each M (float > 0)
    points                     raw measurements: [{batch_size, tokens_per_request, tokens, step_seconds}], the
                               median over repeats; [] for hand-made tables
    draft                      the drafter's own propose step (`profile_draft`), {} when not profiled:
                               {draft_key: {"batch_sizes": [R], "seconds": [s], "observe_seconds": [s],
                               "context": n, "cache_length": n, "mode": m, "dtype": the drafter's weights, or
                               null}} (observe_seconds, dtype, cache_length: absent in older tables),
                               draft_key = "<drafter name>/K<draft length>/<parameter count>"
When several (R, T) give the same M the slower one enters the table (conservative); the schedulers price a forward
by its shape instead, `step_seconds(R, T)` from `points`, where the grid covers it. `to_csv` writes the columns
tokens, sps, step_ms.

Engine JSON (`export_engine_json`, format "dspark.engine", version 1), for serving engines outside this package:
    format, version            "dspark.engine", 1
    host, device, dtype, mode, date, torch_version      as above
    cost                       {"tokens": [int], "steps_per_second": [float], "step_ms": [float],
                                "interpolation": "linear", "below_first": "clamp",
                                "above_last": "step time proportional to tokens"}
    sts                        null, or {"positions": K, "temperatures": [t_1..t_K],
                                "rule": "c_k' = sigmoid(logit(c_k) / t_k); a_k = prod_{i<=k} c_i'"}
"""
from __future__ import annotations

import bisect
import csv
import statistics
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import torch

from dspark.engine.compiled import drafter_fn
from dspark.engine.jsonio import dumps, read_versioned_json, write_json_atomic
from dspark.engine.kv_cache import slot_cache_length
from dspark.engine.protocol import DraftState, Drafter, graph_shapes
from dspark.engine.sampling import SamplingConfig

FORMAT = "dspark.cost_model"
ENGINE_FORMAT = "dspark.engine"
VERSION = 1
MODES = ("eager", "graph")


def device_description(device: torch.device | str) -> str:
    """'cpu', or the device type plus the accelerator model, e.g. 'cuda (NVIDIA H200)'."""
    device = torch.device(device)
    if device.type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(device)})"
    return device.type


@dataclass
class CostModel:
    """A profiled SPS(M) table with the metadata that says where it is valid."""

    tokens: list[int]  # M grid, strictly increasing, >= 1
    sps: list[float]  # steps per second at each M, > 0
    host: str = "hand-made"
    device: str = "any"
    dtype: str = ""
    mode: str = "eager"
    date: str = ""
    torch_version: str = ""
    batch_sizes: list[int] = field(default_factory=list)
    tokens_per_request: list[int] = field(default_factory=list)
    context: int = 0
    cache_length: int = 0  # 0: not recorded (see the module docstring)
    points: list[dict] = field(default_factory=list)
    # the drafter's own propose step, per drafter and draft length (`draft_key`): {key: {"batch_sizes": [R],
    # "seconds": [s]}}, from `profile_draft`; the scheduler adds it to the price of a speculative round
    draft: dict = field(default_factory=dict)
    # why: a per-device copy of the grid, so calling the model on a CUDA tensor in the hot path does not copy
    # (and synchronise) every round
    _grids: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.tokens = [int(b) for b in self.tokens]
        self.sps = [float(s) for s in self.sps]
        if not self.tokens or len(self.tokens) != len(self.sps):
            raise ValueError(f"a cost table needs as many SPS values as token counts, at least one; got "
                             f"{len(self.tokens)} token counts and {len(self.sps)} SPS values")
        if self.tokens[0] < 1 or any(b1 <= b0 for b0, b1 in zip(self.tokens, self.tokens[1:])):
            raise ValueError(f"cost table token counts must be >= 1 and strictly increasing, got {self.tokens}")
        bad = [s for s in self.sps if not (s > 0 and s != float("inf"))]
        if bad:
            raise ValueError(f"steps per second must be finite and > 0, got {bad}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        for key, entry in self.draft.items():
            sizes, seconds = entry.get("batch_sizes", []), entry.get("seconds", [])
            if (not sizes or len(sizes) != len(seconds) or sizes[0] < 1
                    or any(b1 <= b0 for b0, b1 in zip(sizes, sizes[1:]))
                    or not all(0 < s < float("inf") for s in seconds)):
                raise ValueError(f"draft cost {key!r} needs strictly increasing batch_sizes >= 1 and as many finite "
                                 f"seconds > 0, got batch_sizes={sizes}, seconds={seconds}")

    # ---- the drafter's step --------------------------------------------------------------------------------
    def draft_seconds(self, key: str, requests: int, *, step: str = "propose") -> float | None:
        """Seconds of the drafter's propose (or, step="observe", observe) step over `requests` rows, None when
        `key` (or its observe timing) was not profiled: linear between profiled batch sizes, the first one's below
        them, proportional to rows past the last."""
        entry = self.draft.get(key)
        column = {"propose": "seconds", "observe": "observe_seconds"}[step]
        if entry is None or column not in entry:
            return None
        sizes, seconds = entry["batch_sizes"], entry[column]
        if requests <= sizes[0]:
            return float(seconds[0])
        if requests >= sizes[-1]:
            return float(seconds[-1]) * requests / sizes[-1]
        i = next(i for i, b in enumerate(sizes) if b >= requests)
        frac = (requests - sizes[i - 1]) / (sizes[i] - sizes[i - 1])
        return float(seconds[i - 1] + frac * (seconds[i] - seconds[i - 1]))

    # ---- SPS(M) ----------------------------------------------------------------------------------------------
    def __call__(self, M: torch.Tensor | int) -> torch.Tensor | float:
        """SPS at M tokens: a float for an int, a float64 tensor of M's shape (on M's device) for a tensor."""
        if isinstance(M, torch.Tensor):
            return self._interpolate(M)
        return float(self._interpolate(torch.tensor([M]))[0])

    def _interpolate(self, M: torch.Tensor) -> torch.Tensor:
        if M.device not in self._grids:
            self._grids[M.device] = (torch.tensor(self.tokens, dtype=torch.float64, device=M.device),
                                     torch.tensor(self.sps, dtype=torch.float64, device=M.device))
        x, y = self._grids[M.device]  # (P,), (P,)
        b = M.to(torch.float64)
        above = y[-1] * x[-1] / b.clamp(min=1.0)  # proportional step time past the last point
        return torch.where(b > x[-1], above, _piecewise_linear(x, y, b))

    # ---- t(R, T): a forward's seconds by its shape ------------------------------------------------------------
    def step_seconds(self, requests: int, width: torch.Tensor) -> torch.Tensor:
        """Seconds of one verify forward over `requests` rows of `width` tokens each (`width` a long tensor of any
        shape; float64 of its shape, on its device). Tensor-only once the grid is on that device (see _interpolate).

        Read from the profiled (R, T) grid (`points`) where `requests` is at most its largest R and `width` at most
        its largest T: linear in R between profiled batch sizes, then linear in T, clamped below the first of
        either. Elsewhere, and for a table without a full grid (hand-made ones), 1 / SPS(R·T). why not SPS(R·T)
        throughout: of the shapes that share a token count the table keeps the slowest, and at small counts that is
        the one-request shape, so R plain rows were priced as one request verifying R tokens, a third above what
        they take (compiled SmolLM2 on a GPU, 4 rows; benchmarks/RESULTS.md), which made a drafted round look as if
        it paid when it did not."""
        fallback = 1.0 / self._interpolate(requests * width)
        grid = self._shape_grid(width.device)
        if grid is None or requests > grid[0][-1]:
            return fallback
        sizes, ts, seconds = grid  # [R], (T,), (R, T)
        i = bisect.bisect_left(sizes, requests)
        if i == 0:
            row = seconds[0]
        else:  # sizes[i - 1] < requests <= sizes[i]
            frac = (requests - sizes[i - 1]) / (sizes[i] - sizes[i - 1])
            row = seconds[i - 1] + frac * (seconds[i] - seconds[i - 1])  # (T,)
        b = width.to(torch.float64)
        return torch.where(b > ts[-1], fallback, _piecewise_linear(ts, row, b))

    def _shape_grid(self, device: torch.device) -> tuple[list[int], torch.Tensor, torch.Tensor] | None:
        """(batch sizes, T grid (T,), seconds (R, T)) of `points` on `device`, None unless every (R, T) of the
        profiled batch sizes x tokens per request was measured; built once per device."""
        key = ("shape", device)
        if key not in self._grids:
            measured = {(int(p["batch_size"]), int(p["tokens_per_request"])): float(p["step_seconds"])
                        for p in self.points}
            sizes = sorted({r for r, _ in measured})
            widths = sorted({t for _, t in measured})
            if not measured or len(measured) != len(sizes) * len(widths):
                self._grids[key] = None
            else:
                self._grids[key] = (sizes, torch.tensor(widths, dtype=torch.float64, device=device),
                                    torch.tensor([[measured[r, t] for t in widths] for r in sizes],
                                                 dtype=torch.float64, device=device))
        return self._grids[key]

    # ---- constructors ----------------------------------------------------------------------------------------
    @classmethod
    def flat(cls, sps: float = 100.0, *, up_to: int = 1 << 20) -> "CostModel":
        """A cost curve that does not depend on M up to `up_to` tokens (the memory-bound ideal)."""
        return cls(tokens=[1, up_to], sps=[sps, sps])

    @classmethod
    def from_points(cls, table: dict[int, float] | list[tuple[int, float]], /, **metadata) -> "CostModel":
        """A table from {M: SPS} or [(M, SPS)]; metadata fields (host, device, ..., points) by keyword."""
        pairs = sorted(table.items() if isinstance(table, dict) else table)
        return cls(tokens=[b for b, _ in pairs], sps=[s for _, s in pairs], **metadata)

    # ---- persistence -----------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("_grids")
        return {"format": FORMAT, "version": VERSION, **d}

    def save(self, path: str | Path) -> None:
        """Write the table and its metadata as JSON (schema in the module docstring)."""
        write_json_atomic(path, self.to_dict())

    def to_csv(self, path: str | Path) -> None:
        """Write columns tokens, sps, step_ms (one row per table point)."""
        with open(path, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["tokens", "sps", "step_ms"])
            for b, s in zip(self.tokens, self.sps):
                w.writerow([b, repr(s), repr(1000.0 / s)])  # full precision: this is data

    @classmethod
    def load(cls, path: str | Path, *, expect_host: str | None = None,
             expect_device: torch.device | str | None = None) -> "CostModel":
        """Read a table saved by `save`; a table profiled on another host or device is an error.

        expect_device: a torch.device is compared through `device_description` (so cuda:0 and cuda:1 of the same
        GPU model match); a string is compared with the stored description as is.
        """
        d = read_versioned_json(path, FORMAT, VERSION, what="cost table")
        body = {k: v for k, v in d.items() if k not in ("format", "version")}
        known = {f for f in cls.__dataclass_fields__ if not f.startswith("_")}
        unknown = sorted(set(body) - known)
        if unknown:
            raise ValueError(f"{path}: unknown cost-table keys {unknown}; known: {sorted(known)}")
        cost = cls(**body)
        if expect_host is not None and cost.host != expect_host:
            raise ValueError(f"cost table {path} was profiled for host {cost.host!r}, but the host in use is "
                             f"{expect_host!r}; profile this host (verifiers.cost_model.profile)")
        if expect_device is not None:
            want = expect_device if isinstance(expect_device, str) else device_description(expect_device)
            if cost.device != want:
                raise ValueError(f"cost table {path} was profiled on device {cost.device!r}, but the device in use "
                                 f"is {want!r}; SPS curves do not transfer between devices, profile again")
        return cost


def _piecewise_linear(x: torch.Tensor, y: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """y at b, linear between the points (x (P,) strictly increasing, y (P,)), y[0] below x[0], the last segment
    continued past x[-1] (callers replace that part); b of any shape, tensor-only."""
    if len(x) == 1:
        return y[0].expand_as(b)
    i = torch.searchsorted(x, b.contiguous(), right=True).clamp(1, len(x) - 1)  # segment [x[i-1], x[i]]
    inside = y[i - 1] + (b - x[i - 1]) / (x[i] - x[i - 1]) * (y[i] - y[i - 1])
    return torch.where(b < x[0], y[0], inside)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def resolve_mode(mode: str, device: torch.device) -> str:
    """"auto" is "graph" on CUDA (the slot engine replays its rounds as CUDA graphs there) and "eager" elsewhere."""
    if mode == "auto":
        return "graph" if device.type == "cuda" else "eager"
    if mode not in MODES:
        raise ValueError(f"profile mode must be auto, {' or '.join(MODES)}; got {mode!r}")
    if mode == "graph" and device.type != "cuda":
        raise ValueError(f"profile mode 'graph' times CUDA-graph replays and needs a CUDA host, not {device}")
    return mode


def _timed(run, device: torch.device, warmup: int, repeats: int) -> list[float]:
    """Seconds of each of `repeats` calls of run() after `warmup` untimed ones, the device synchronised around each."""
    seconds = []
    for i in range(warmup + repeats):
        _sync(device)
        t0 = time.perf_counter()
        run()
        _sync(device)
        if i >= warmup:
            seconds.append(time.perf_counter() - t0)
    return seconds


def _runner(fn, device: torch.device, mode: str, warmup: int):
    """What a timed call runs: fn itself (eager), or the replay of fn captured once as a CUDA graph (graph).
    why graph mode: on a GPU the slot engine replays every round, so an eagerly timed step measures Python and
    kernel-launch overhead the engine does not pay (a flat SPS curve, and drafting priced several times its cost)."""
    if mode == "eager":
        return fn
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    # kernels' lazy initialisation (and any compilation) stays out of the capture; graph_shapes: the warm-ups run
    # the path and shapes the capture runs (a drafter's capturable one, dspark.engine.protocol.fixed_shapes), or
    # torch.compile would recompile inside the capture
    with torch.cuda.stream(side), graph_shapes():
        for _ in range(max(1, warmup)):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), graph_shapes():
        fn()
    return graph.replay


def verify_tokens(width: torch.Tensor, requests: int) -> torch.Tensor:
    """Tokens in the verify forward of `requests` rows at verify width(s) `width` (long tensor, any shape): every
    row carries the anchor plus `width` drafts, padded to the longest row as `dspark.engine.decode` runs it."""
    return requests * (width + 1)


def profile(host, *, batch_sizes: list[int], tokens_per_request: list[int], context: int = 256, repeats: int = 10,
            warmup: int = 3, mode: str = "auto", seed: int = 0) -> CostModel:
    """Time the decode loop's verify step at every (R, T) of the grid and return the SPS(M = R*T) table.

    Each point: a fresh cache of R requests holding `context` positions, as long as the slot engine's for requests
    of `context` positions (prompt plus budget) verifying up to max(tokens_per_request) tokens a row
    (dspark.engine.kv_cache.slot_cache_length: a captured round attends over all of it, and the engine aligns its
    length for SDPA's kernels, kv_cache.aligned_length; a profile over context + T + 64 positions, as earlier
    versions timed, priced T >= 2 well above the engine's rounds, benchmarks/RESULTS.md), random tokens (R, T),
    `warmup` untimed steps, then the median of `repeats` timed steps. Each step is the call `dspark.engine.decode`
    makes for a round at that length, `host.step(cache, tokens, n_valid, attend=context + T)`, so it attends the
    same (bucketed) cache prefix as decoding does; the cache is not advanced (steps overwrite the same positions),
    so every repeat sees the same context. A timed step includes the LM head over every position and the argmax over the
    logits (what the round's greedy acceptance reads). CUDA is synchronised around each timed step. `mode` "graph" (the
    default on CUDA, see resolve_mode) times the step as the slot engine runs it there: captured once per point as a
    CUDA graph over the whole cache (attend=None) and replayed.
    """
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0, got repeats={repeats}, warmup={warmup}")
    if isinstance(context, bool) or not isinstance(context, int) or context < 0:
        raise ValueError(f"context must be an integer >= 0 (cached positions per request), got {context!r}")
    max_context = getattr(host, "max_context", None)
    if max_context is not None and context + max(tokens_per_request) > max_context:
        raise ValueError(f"context {context} + tokens_per_request up to {max(tokens_per_request)} do not fit the "
                         f"host's context of {max_context}")
    device = torch.device(host.device)
    mode = resolve_mode(mode, device)
    g = torch.Generator().manual_seed(seed)
    points = []
    # the eager path's window, context + T rounded up to 64 positions (dspark.engine.host._bucket), fits it too
    cache_length = slot_cache_length(context, max(tokens_per_request) - 1)
    for R in batch_sizes:
        for T in tokens_per_request:
            cache = host.new_cache(R, cache_length)
            cache.advance(torch.full((R,), context, dtype=torch.long, device=device))
            tokens = torch.randint(host.vocab_size, (R, T), generator=g).to(device)  # (R, T)
            n_valid = torch.full((R,), T, dtype=torch.long, device=device)  # (R,)
            attend = context + T if mode == "eager" else None  # graphs attend over the whole cache
            with torch.inference_mode():
                # the logits too, and a pass over them: the engine's round runs the LM head over every verified
                # position (a large share of a small host's step, SmolLM2: 28 M of its 135 M weights) and its
                # acceptance reads them (the argmax of greedy decoding), both growing with the width
                def step(cache=cache, tokens=tokens, n_valid=n_valid, attend=attend):
                    return host.logits(host.step(cache, tokens, n_valid, attend=attend).hidden).argmax(-1)

                run = _runner(step, device, mode, warmup)
                seconds = _timed(run, device, warmup, repeats)
                del run
            points.append({"batch_size": R, "tokens_per_request": T, "tokens": R * T,
                           "step_seconds": statistics.median(seconds)})
            del cache
    slowest: dict[int, float] = {}
    for p in points:
        slowest[p["tokens"]] = max(slowest.get(p["tokens"], 0.0), p["step_seconds"])
    return CostModel.from_points({b: 1.0 / max(s, 1e-9) for b, s in slowest.items()},
                                 host=host.name, device=device_description(device), dtype=str(host.dtype),
                                 mode=mode, date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                                 torch_version=torch.__version__, batch_sizes=list(batch_sizes),
                                 tokens_per_request=list(tokens_per_request), context=context,
                                 cache_length=cache_length, points=points)


def draft_key(drafter, K: int) -> str:
    """The cost table's name for `drafter` proposing K drafts: its name, K and its parameter count (so a table
    profiled for a 2-layer DSpark is not read for a 5-layer one)."""
    modules = [drafter] if isinstance(drafter, torch.nn.Module) else []
    for value in vars(drafter).values():  # drafters that hold their networks (the small LM sits in a Host)
        inner = value if isinstance(value, torch.nn.Module) else getattr(value, "model", None)
        if isinstance(inner, torch.nn.Module) and not isinstance(drafter, torch.nn.Module):
            modules.append(inner)
    parameters = sum(p.numel() for m in modules for p in m.parameters())
    return f"{drafter.name}/K{K}/{parameters}"


def profile_draft(host, drafter, *, batch_sizes: list[int], draft_length: int, context: int = 256,
                  repeats: int = 10, warmup: int = 3, seed: int = 0, mode: str = "auto") -> dict:
    """Time the drafter's propose step (greedy, K = draft_length) over R rows holding `context` positions, for
    every R of batch_sizes: the median of `repeats` timed calls after `warmup` untimed ones. Returns the entry
    `CostModel.draft[draft_key(drafter, draft_length)]` holds. The rows' state is what the decode loop leaves
    after a prefill of `context` random tokens (begin, observe of the host's features, prefill). `seconds` is the
    propose step (what a plain round saves, Verifier.draft_next); `observe_seconds` the drafter's observe of a
    round's committed positions, which runs in every round of a speculative decode, plain ones too. In mode
    "graph" (the default on CUDA) a `capturable` drafter's steps are captured and replayed, as the slot engine
    runs them; any other runs eagerly there too."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0, got repeats={repeats}, warmup={warmup}")
    device = torch.device(host.device)
    mode = resolve_mode(mode, device) if drafter.capturable else "eager"
    g = torch.Generator().manual_seed(seed)
    seconds, observe_seconds = [], []
    max_len = slot_cache_length(context, draft_length)  # the engine's, which the drafter's caches follow
    for R in sorted(set(batch_sizes)):
        seq = torch.randint(host.vocab_size, (R, max_len), generator=g).to(device)  # (R, max_len)
        filled = torch.full((R,), context, dtype=torch.long, device=device)
        cache = host.new_cache(R, max_len)
        state = DraftState(seq=seq, seq_len=filled + 1, seeds=torch.arange(R, device=device),
                           rounds=torch.zeros(R, dtype=torch.long, device=device), sampling=SamplingConfig())
        times, observe = [], []
        with torch.inference_mode():
            out = host.step(cache, seq[:, :context], filled, taps=drafter.feature_layers, attend=context)
            drafter.begin(host=host, batch_size=R, max_len=max_len)
            drafter.observe(features=out.features, start=torch.zeros_like(filled), n_valid=filled, state=state)
            drafter.prefill(state=state)
            # a round's observe: the host features of an accepted draft and the next token (two positions), at a
            # fixed place past the context, so every repeat does the same work
            ahead = torch.randn(R, draft_length + 1, out.features.shape[-1], device=device, dtype=out.features.dtype) \
                if out.features is not None else None
            two = torch.full((R,), 2, dtype=torch.long, device=device)
            # as the engine runs them: compiled on a compiled host (greedy, as `state`: dspark.engine.compiled)
            propose, observe_fn = drafter_fn(drafter, "propose", host), drafter_fn(drafter, "observe", host)
            runs = [_runner(lambda: propose(state, draft_length), device, mode, warmup)]
            if type(drafter).observe is not Drafter.observe:  # (the base one does nothing: nothing to time)
                runs.append(_runner(lambda: observe_fn(features=ahead, start=filled, n_valid=two, state=state),
                                    device, mode, warmup))
            for run, into in zip(runs, (times, observe)):
                into.extend(_timed(run, device, warmup, repeats))
            del runs
        seconds.append(max(statistics.median(times), 1e-9))
        observe_seconds.append(max(statistics.median(observe), 1e-9) if observe else 0.0)
        del cache
    dtype = next((str(t.dtype) for t in getattr(drafter, "parameters", lambda: ())() if t.is_floating_point()), None)
    return {"batch_sizes": sorted(set(batch_sizes)), "seconds": seconds, "observe_seconds": observe_seconds,
            "context": context, "cache_length": max_len, "mode": mode,
            "dtype": dtype}


def export_engine_json(path: str | Path, *, cost: CostModel, sts_temperatures: list[float] | None) -> None:
    """Write the engine-neutral scheduling file (cost curve + optional STS temperatures; schema above)."""
    if sts_temperatures is not None and not all(t > 0 for t in sts_temperatures):
        raise ValueError(f"STS temperatures must be > 0, got {sts_temperatures}")
    doc = {
        "format": ENGINE_FORMAT, "version": VERSION,
        "host": cost.host, "device": cost.device, "dtype": cost.dtype, "mode": cost.mode, "date": cost.date,
        "torch_version": cost.torch_version,
        "cost": {"tokens": cost.tokens, "steps_per_second": cost.sps, "step_ms": [1000.0 / s for s in cost.sps],
                 "interpolation": "linear", "below_first": "clamp",
                 "above_last": "step time proportional to tokens"},
        "sts": None if sts_temperatures is None else {
            "positions": len(sts_temperatures), "temperatures": [float(t) for t in sts_temperatures],
            "rule": "c_k' = sigmoid(logit(c_k) / t_k); a_k = prod_{i<=k} c_i'"},
    }
    Path(path).write_text(dumps(doc, indent=1) + "\n")
