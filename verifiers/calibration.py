"""Sequential Temperature Scaling (STS, docs/DSPARK.md §4.2) of draft confidences, and the calibration metrics.

Shapes: N rounds of a held-out rollout log, K draft positions, G temperatures of the search grid.

Notation: c_k = raw confidence, P(x_k accepted | x_1..x_{k-1} accepted); a_k = Π_{i<=k} c_i, the predicted prefix
survival. STS rescales the logit of each position, c_k' = σ(logit(c_k) / t_k), which is strictly increasing in c_k
(order-preserving, so AUROC per position is unchanged). For k = 1..K in order it grid-searches t_k minimising the
ECE of a_k' = Π_{i<=k} c_i' against the empirical survival (x_1..x_k all accepted), t_1..t_{k-1} held fixed.

What a log tells (inputs `accepted`, `reached`, both (N, K) bool): position k was *reached* when x_1..x_{k-1}
were accepted and k was verified; `accepted[n, k]` is meaningful only where reached. The conditional label of
position k is known where reached; the survival label is known where k was reached or an earlier position was
rejected (then survival is 0). A verify-all log (scheduler off) reaches every position up to the first rejection,
which is the cleanest input for fitting.

A calibration fitted at K positions serves every draft length K' <= K (its first K' temperatures: the fit of
position k never looks at later positions); K' > K is an error that says to refit at K'.

STS JSON (`STSCalibrator.save`, format "dspark.sts", version 1):
    format, version   "dspark.sts", 1
    positions         K
    temperatures      [t_1..t_K], each > 0; c_k' = sigmoid(logit(c_k) / t_k)
    fit_size          [n_1..n_K], rounds with a known survival label at each position during the fit
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dspark.engine.jsonio import read_versioned_json, write_json_atomic
from dspark.engine.protocol import Proposal

FORMAT = "dspark.sts"
VERSION = 1
BINS = 20
#: log-spaced temperatures searched per position; t > 1 softens over-confident logits
TEMPERATURE_GRID = torch.logspace(math.log10(0.05), math.log10(20.0), 401, dtype=torch.float64)  # (G,)


# ---- labels -----------------------------------------------------------------------------------------------------
def outcomes_from_counts(verified: torch.Tensor, accepted: torch.Tensor, K: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position (accepted, reached), each (N, K) bool, from per-round counts ell (N,) and accepted drafts (N,).

    Position k (1-based) was reached when k <= ell and k - 1 drafts were accepted; accepted when k <= accepted.
    """
    k = torch.arange(1, K + 1)  # (K,)
    ell, n = verified.long().cpu().unsqueeze(1), accepted.long().cpu().unsqueeze(1)  # (N, 1)
    return k <= n, (k <= ell) & (k <= n + 1)


@dataclass
class Labels:
    """Known labels of a log, both views."""

    accepted: torch.Tensor  # (N, K) bool: conditional label, valid where `reached`
    reached: torch.Tensor  # (N, K) bool
    survived: torch.Tensor  # (N, K) bool: x_1..x_k all accepted, valid where `known`
    known: torch.Tensor  # (N, K) bool


def labels(accepted: torch.Tensor, reached: torch.Tensor) -> Labels:
    """Derive the survival labels and where they are known from per-position outcomes (N, K)."""
    if accepted.shape != reached.shape or accepted.dim() != 2:
        raise ValueError(f"accepted and reached must both be (N, K), got {tuple(accepted.shape)} and "
                         f"{tuple(reached.shape)}")
    acc, seen = accepted.bool().cpu() & reached.bool().cpu(), reached.bool().cpu()
    survived = acc.long().cumprod(1).bool()  # (N, K)
    rejected = seen & ~acc  # (N, K)
    rejected_before = torch.cat([torch.zeros_like(rejected[:, :1]), rejected[:, :-1]], 1).long().cummax(1).values
    return Labels(accepted=acc, reached=seen, survived=survived, known=seen | rejected_before.bool())


# ---- metrics ----------------------------------------------------------------------------------------------------
def _ece_rows(conf: torch.Tensor, label: torch.Tensor, bins: int = BINS) -> torch.Tensor:
    """ECE of every row of conf (G, n) against label (n,): Σ_bins |Σ conf − Σ label| / n. Returns (G,)."""
    G, n = conf.shape
    b = (conf * bins).long().clamp(0, bins - 1)  # (G, n): equal-width bins, 1.0 in the last
    diff = torch.zeros(G, bins, dtype=torch.float64).scatter_add_(1, b, conf - label.to(conf.dtype))  # (G, bins)
    return diff.abs().sum(1) / n


def ece(conf: torch.Tensor, label: torch.Tensor, bins: int = BINS) -> float:
    """Expected calibration error with `bins` equal-width bins; nan without samples."""
    if conf.numel() == 0:
        return float("nan")
    return float(_ece_rows(conf.double().reshape(1, -1), label.reshape(-1), bins)[0])


def brier(conf: torch.Tensor, label: torch.Tensor) -> float:
    """Mean squared error of the probability; nan without samples."""
    if conf.numel() == 0:
        return float("nan")
    return float(((conf.double() - label.double()) ** 2).mean())


def auroc(score: torch.Tensor, label: torch.Tensor) -> float:
    """Area under the ROC curve by the rank-sum (Mann–Whitney) statistic, ties averaged; nan with one class."""
    s, y = score.double().reshape(-1), label.bool().reshape(-1)
    n_pos, n_neg = int(y.sum()), int((~y).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    values, inverse, counts = torch.unique(s, sorted=True, return_inverse=True, return_counts=True)
    last = counts.cumsum(0).double()  # 1-based rank of the last element of each tie group
    rank = (last - (counts.double() - 1) / 2)[inverse]  # (n,) average rank
    return float((rank[y].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def _metrics(conf: torch.Tensor, label: torch.Tensor, mask: torch.Tensor) -> dict[str, list]:
    """Per-position ece / auroc / brier / n of conf (N, K) against label where mask."""
    out: dict[str, list] = {"ece": [], "auroc": [], "brier": [], "n": []}
    for k in range(conf.shape[1]):
        m = mask[:, k]
        ck, yk = conf[m, k], label[m, k]
        out["ece"].append(ece(ck, yk))
        out["auroc"].append(auroc(ck, yk))
        out["brier"].append(brier(ck, yk))
        out["n"].append(int(m.sum()))
    return out


# ---- STS --------------------------------------------------------------------------------------------------------
def _scale(c: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    # why: float64 logit maps 0 and 1 to ∓inf and back exactly, so no clamp is needed and the map stays strictly
    # increasing
    return torch.sigmoid(torch.logit(c.double()) / t)


@dataclass
class STSCalibrator:
    """One temperature per draft position; `apply` maps raw confidences (..., K) to calibrated ones."""

    temperatures: list[float]
    fit_size: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.temperatures = [float(t) for t in self.temperatures]
        if not self.temperatures or not all(t > 0 and math.isfinite(t) for t in self.temperatures):
            raise ValueError(f"STS needs at least one finite temperature > 0, got {self.temperatures}")

    @property
    def positions(self) -> int:
        return len(self.temperatures)

    @classmethod
    def fit(cls, c: torch.Tensor, accepted: torch.Tensor, reached: torch.Tensor, *,
            grid: torch.Tensor = TEMPERATURE_GRID) -> "STSCalibrator":
        """Fit t_1..t_K in order on a held-out log: c (N, K) raw, accepted / reached (N, K) bool."""
        if c.shape != accepted.shape:
            raise ValueError(f"confidences {tuple(c.shape)} and outcomes {tuple(accepted.shape)} differ in shape")
        lab = labels(accepted, reached)
        c = c.detach().double().cpu()
        N, K = c.shape
        a_prev = torch.ones(N, dtype=torch.float64)  # (N,) calibrated a_{k-1}'
        temperatures, sizes = [], []
        for k in range(K):
            m = lab.known[:, k]
            if not bool(m.any()):
                t_best = 1.0  # no evidence at this position: leave it as is
            else:
                y = lab.survived[m, k]
                ck, ap = c[m, k], a_prev[m]
                errors = torch.cat([_ece_rows(ap * _scale(ck, g.unsqueeze(1)), y)
                                    for g in grid.split(32)])  # (G,); chunks bound memory at 32 * n
                t_best = float(grid[int(errors.argmin())])
            a_prev = a_prev * _scale(c[:, k], torch.tensor(t_best, dtype=torch.float64))
            temperatures.append(t_best)
            sizes.append(int(m.sum()))
        return cls(temperatures=temperatures, fit_size=sizes)

    def apply(self, c: torch.Tensor) -> torch.Tensor:
        """Calibrated confidences c' (..., K), same shape, dtype and device as c, for any K <= `positions`.

        The fit is per position (t_k is chosen with t_1..t_{k-1} fixed, never looking at later positions), so
        the first K temperatures are the calibration of a K-position drafter: a fit at draft length γ serves every
        draft length up to γ. Longer drafts have no temperatures and are an error (`check_positions`).
        """
        K = c.shape[-1]
        self.check_positions(K)
        t = torch.tensor(self.temperatures[:K], dtype=torch.float64, device=c.device)  # (K,)
        return _scale(c, t).to(c.dtype)

    def check_positions(self, K: int, *, source: str = "") -> None:
        """Refuse draft length K > `positions`: positions past the fit have no temperatures."""
        if K > self.positions:
            name = f" {source}" if source else ""
            raise ValueError(
                f"STS calibrator{name} was fitted for {self.positions} draft positions, but {K} are in use: it has "
                f"no temperatures for positions {self.positions + 1}..{K}. Refit at the longest draft length you "
                f"use (`dspark calibrate --draft-length {K}`; a fit at one draft length serves every shorter "
                f"one), or pass another --calibration")

    def save(self, path: str | Path) -> None:
        """Write the temperatures as JSON (schema in the module docstring)."""
        doc = {"format": FORMAT, "version": VERSION, "positions": self.positions,
               "temperatures": self.temperatures, "fit_size": self.fit_size}
        write_json_atomic(path, doc)

    @classmethod
    def load(cls, path: str | Path, *, expect_positions: int | None = None) -> "STSCalibrator":
        """Read a calibrator; `expect_positions` (the draft length in use) beyond its positions is an error."""
        d = read_versioned_json(path, FORMAT, VERSION, what="STS calibration")
        unknown = sorted(set(d) - {"format", "version", "positions", "temperatures", "fit_size"})
        if unknown:
            raise ValueError(f"{path}: unknown STS keys {unknown}")
        cal = cls(temperatures=d["temperatures"], fit_size=d.get("fit_size", []))
        if d["positions"] != cal.positions:
            raise ValueError(f"{path} says {d['positions']} positions but holds {cal.positions} temperatures")
        if expect_positions is not None:
            cal.check_positions(expect_positions, source=str(path))
        return cal


def calibrated_confidence(proposal: Proposal, K: int, calibrator: STSCalibrator | None = None) -> torch.Tensor:
    """The confidences (B, K) a verifier should trust: calibrated if a calibrator is given, ones if none exist.

    why ones: a drafter without a confidence head implicitly claims every draft survives (fixed-length
    speculation); with c = 1 thresholds verify all and the scheduler trims by cost alone.
    """
    if proposal.confidence is None:
        return torch.ones(proposal.tokens.shape[0], K, device=proposal.tokens.device)
    c = proposal.confidence[:, :K].float()  # (B, K)
    return c if calibrator is None else calibrator.apply(c)


# ---- reports ----------------------------------------------------------------------------------------------------
def _views(c: torch.Tensor, lab: Labels) -> dict[str, dict[str, list]]:
    return {"conditional": _metrics(c, lab.accepted, lab.reached),
            "survival": _metrics(c.cumprod(1), lab.survived, lab.known)}


def calibration_report(c: torch.Tensor, accepted: torch.Tensor, reached: torch.Tensor, *,
                       calibrator: STSCalibrator | None = None) -> dict:
    """Per-position ECE / AUROC / Brier / n for conditional c_k and survival a_k, before and (if given) after STS.

    Returns {"positions", "bins", "before": {"conditional": {...}, "survival": {...}}, "after": same or None};
    each metric is a list over positions (nan where undefined).
    """
    lab = labels(accepted, reached)
    c = c.detach().double().cpu()
    return {"positions": c.shape[1], "bins": BINS, "before": _views(c, lab),
            "after": None if calibrator is None else _views(calibrator.apply(c), lab)}


def _curve(conf: torch.Tensor, label: torch.Tensor, bins: int = BINS) -> tuple[list[float], list[float]]:
    """Mean confidence and empirical rate of the non-empty bins."""
    b = (conf * bins).long().clamp(0, bins - 1)
    n = torch.bincount(b, minlength=bins).double()
    sc = torch.bincount(b, weights=conf.double(), minlength=bins)
    sy = torch.bincount(b, weights=label.double(), minlength=bins)
    keep = n > 0
    return (sc[keep] / n[keep]).tolist(), (sy[keep] / n[keep]).tolist()


def reliability_diagram(path_png: str | Path, c: torch.Tensor, accepted: torch.Tensor, reached: torch.Tensor, *,
                        calibrator: STSCalibrator | None = None) -> None:
    """PNG of reliability curves per position: row 1 conditional c_k, row 2 survival a_k; raw and after STS."""
    # why: Figure without pyplot renders with Agg and leaves the process-wide backend alone
    from matplotlib.figure import Figure

    lab = labels(accepted, reached)
    raw = c.detach().double().cpu()
    series = [("raw", raw)] + ([] if calibrator is None else [("STS", calibrator.apply(raw))])
    K = raw.shape[1]
    fig = Figure(figsize=(2.6 * K, 5.4), layout="constrained")
    axes = fig.subplots(2, K, squeeze=False)
    for k in range(K):
        for row, (view, mask, label) in enumerate([("conditional c", lab.reached, lab.accepted),
                                                    ("survival a", lab.known, lab.survived)]):
            ax = axes[row, k]
            ax.plot([0, 1], [0, 1], color="0.7", lw=1)
            m = mask[:, k]
            for name, cc in series if bool(m.any()) else ():
                conf = cc[:, k] if row == 0 else cc.cumprod(1)[:, k]
                x, y = _curve(conf[m], label[m, k])
                ax.plot(x, y, marker="o", ms=3, label=f"{name} ECE {100 * ece(conf[m], label[m, k]):.1f}%")
            ax.set(xlim=(0, 1), ylim=(0, 1), title=f"{view}_{k + 1}")
            if bool(m.any()):
                ax.legend(fontsize=6, loc="upper left")
            else:  # no round verified this far: nothing to compare (and an empty legend would only warn)
                ax.text(0.5, 0.5, f"no row reached\nposition {k + 1}", ha="center", va="center", fontsize=7)
    fig.supxlabel("predicted")
    fig.supylabel("empirical")
    fig.savefig(path_png, dpi=110)
