"""Which regime a config trains in: the two conditions the paper's results hold under
(../shared/M2PO.md, "The regime the paper's results hold in"), measured on a report's runs.

1. **M2 of the stale data at or below tau**, the tail as well as the median: the second
   moment of the log-ratios of the trained tokens before masking, over the records trained
   on data as old as the staleness (`m2po_rllib.jobs.steady`), pooled over seeds. It holds
   when the 90th percentile is at or below tau, holds "at the median only" when the median
   is and the tail is not, and does not hold when the median is above. The paper's GRPO
   clips 1.22% of tokens at lr 1e-6, which implies M2 around 0.01; M2 at a fixed age grows
   about as lr^2 (the policy moves lr per update), so a 3x larger lr sits ~9x higher.
2. **A small change of the policy within one staleness window**, where the comparison is
   made: the on-policy arm's held-out accuracy change per `staleness` updates at the end of
   its runs (a run's least-squares slope over its evaluations in the last two windows or the
   last quarter of the run, whichever is longer, times the window; one value per seed). A stale arm trains on data one window behind, so where
   the on-policy arm still gains 2 points a window, "the stale arm matches on-policy within
   2 points" is not what is tested. It holds when the change is equivalent to 0 within
   ±`WINDOW_SHARE` x the claims' margin (TOST on the seeds' values, 90% interval,
   `m2po_rllib.jobs.stats`: 1 point at the default margin of 2), does not hold when the
   interval lies outside, else is not resolved (with the seeds that would resolve it). This
   limit is this project's rule: the paper publishes curves, not changes per window.

`make calibrate` measures both at a few learning rates. No Ray import.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any, Sequence

from m2po_rllib.jobs import steady
from m2po_rllib.jobs.stats import DOES_NOT_HOLD, HOLDS, NOT_EQUIVALENT, NOT_RESOLVED, Comparison, compare, per_seed

PAPER_TAU = 0.04  # the paper's tau, for variants that have none (the clip losses)
TAIL = 0.9  # condition 1's tail: this percentile of M2 at steady state
WINDOW_SHARE = 0.5  # condition 2: |change per window| within this share of the claims' margin
MEDIAN_ONLY = "holds at the median only"


# -- condition 1: M2 of the stale data against tau ---------------------------------------------
@dataclass
class Regime:
    label: str
    lr: float | None
    staleness: int | str | None
    tau: float
    m2_median: float | None  # M2 of the trained tokens before masking, over steady-state records
    m2_q90: float | None  # its `TAIL` percentile
    token: steady.SteadyFraction | None  # the masked (M2PO) or clipped fraction at steady state
    records: int

    @property
    def ratio(self) -> float | None:
        return None if self.m2_median is None else self.m2_median / self.tau

    @property
    def tail_ratio(self) -> float | None:
        return None if self.m2_q90 is None else self.m2_q90 / self.tau

    @property
    def condition(self) -> str:
        """Condition 1's verdict: holds, holds at the median only, does not hold."""
        if self.ratio is None:
            return "no M2 recorded"
        return HOLDS if self.tail_ratio <= 1 else MEDIAN_ONLY if self.ratio <= 1 else DOES_NOT_HOLD


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank percentile of sorted `values`."""
    return values[min(len(values) - 1, int(q * len(values)))]


def regime(label: str, settings: dict, runs) -> Regime:
    """Condition 1 of one variant from its runs (objects with `.history` and `.settings`)."""
    runs = list(runs)
    staleness = settings.get("staleness")
    tau = settings.get("m2_threshold") if settings.get("policy_loss", "").startswith("m2po") else None
    mode = settings.get("mode", "stale-k")
    records = [h for r in runs for h in steady.steady_state(r.history, staleness, mode)]
    m2 = sorted(h["m2_before"] for h in records if h.get("m2_before") is not None)
    return Regime(
        label=label, lr=settings.get("lr"), staleness=staleness, tau=float(tau or PAPER_TAU),
        m2_median=statistics.median(m2) if m2 else None, m2_q90=percentile(m2, TAIL) if m2 else None,
        token=steady.fraction(runs, staleness, mode), records=len(records),
    )


def markdown(rows: list[Regime]) -> str:
    head = ("| variant | lr | staleness | M2 at steady state (median, 90th pct) | M2 / tau (median, 90th pct) | "
            "masked / clipped tokens at steady state | condition 1 |")
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for r in rows:
        m2 = "-" if r.m2_median is None else f"{r.m2_median:.4f}, {r.m2_q90:.4f}"
        ratio = "-" if r.ratio is None else f"{r.ratio:.2f}, {r.tail_ratio:.2f}"
        frac = "-" if r.token is None else f"{r.token.kind} {100 * r.token.mean:.3f}%"
        lr = "-" if r.lr is None else f"{r.lr:g}"
        lines.append(f"| {r.label} | {lr} | {r.staleness} | {m2} | {ratio} | {frac} | {r.condition} |")
    return "\n".join(lines)


# -- condition 2: the policy's change within one staleness window -------------------------------
def window_change(evaluations: Sequence, window: int) -> float | None:
    """A run's held-out accuracy change per `window` updates at its end: the least-squares
    slope over its evaluations (`.update`, `.accuracy`) in its last `span` updates, times the
    window; None with fewer than two evaluations there (`span`: module docstring)."""
    points = [(e.update, e.accuracy) for e in evaluations if e.update is not None]
    if not points:
        return None
    end = points[-1][0]
    points = [(u, a) for u, a in points if u >= end - span(window, end)]
    if len(points) < 2:
        return None
    mu, ma = statistics.fmean(u for u, _ in points), statistics.fmean(a for _, a in points)
    spread = sum((u - mu) ** 2 for u, _ in points)
    if spread == 0:
        return None
    return window * sum((u - mu) * (a - ma) for u, a in points) / spread


def span(window: int, end: int) -> float:
    """The updates before a run's last evaluation that its slope is fitted over: two windows,
    or the last quarter of the run when that is longer (a short window's two would hold one or
    two evaluations)."""
    return max(2 * window, end / 4)


@dataclass
class Drift:
    reference: str  # the on-policy variant measured
    window: int  # updates: the staleness of the arms compared with it
    limit: float  # |change| allowed (accuracy)
    changes: dict  # {seed: change per window}
    horizon: tuple[int, int]  # the runs' last evaluated updates (min, max): where the change is taken
    comparison: Comparison | None = None  # TOST of the changes against 0 within ±limit
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def condition(self) -> str:
        verdict = self.comparison.verdict if self.comparison else NOT_RESOLVED
        return HOLDS if verdict.startswith("equivalent") else DOES_NOT_HOLD if verdict == NOT_EQUIVALENT else NOT_RESOLVED

    def to_json(self) -> dict[str, Any]:
        c = self.comparison
        return {"reference": self.reference, "window": self.window, "limit": self.limit,
                "changes": {str(k): v for k, v in self.changes.items()}, "horizon": list(self.horizon),
                "mean": statistics.fmean(self.changes.values()), "ci90": list(c.ci90) if c and c.ci90 else None,
                "test": c.test if c else None, "seeds_needed": c.seeds_needed if c else None,
                "condition": self.condition}


def drift(reference: str, runs, window: int, margin: float) -> Drift | None:
    """Condition 2 for arms `window` updates stale, from the on-policy `runs` they are
    compared with (objects with `.evaluations`, `.settings["seed"]`, `.path`)."""
    runs = list(runs)
    changes = per_seed(runs, lambda r: window_change(r.evaluations, window))
    ends = [r.evaluations[-1].update for r in runs if r.evaluations and r.evaluations[-1].update is not None]
    if not changes or not ends:
        return None
    limit = WINDOW_SHARE * margin
    comparison = compare(changes, {s: 0.0 for s in changes}, "equivalent", margin=limit) if len(changes) >= 2 else None
    return Drift(reference, window, limit, changes, (min(ends), max(ends)), comparison)


def drift_markdown(rows: list[Drift]) -> str:
    head = ("| on-policy arm | window (updates) | where (last evaluated update) | change per window (per seed) | "
            "mean, 90% CI | within | condition 2 |")
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for d in rows:
        c = d.comparison
        lo, hi = d.horizon
        seeds = ", ".join(f"{100 * v:+.1f}" for v in d.changes.values())
        mean = statistics.fmean(d.changes.values())
        ci = f"[{100 * c.ci90[0]:+.1f}, {100 * c.ci90[1]:+.1f}]" if c and c.ci90 else "no interval (one seed)"
        verdict = d.condition
        if c and d.condition == NOT_RESOLVED and c.seeds_needed:
            verdict += f" (about {c.seeds_needed} seeds would resolve it)"
        lines.append(f"| {d.reference} | {d.window} | {lo if lo == hi else f'{lo}-{hi}'} | {seeds} points | "
                     f"{100 * mean:+.1f} points, {ci} | ±{100 * d.limit:.1f} points | {verdict} |")
    return "\n".join(lines)


def both(m2: Regime, window: Drift | None) -> str:
    """The two conditions' verdicts for one stale variant, in words."""
    second = window.condition if window else "not measured (no on-policy arm with evaluations)"
    if m2.condition == HOLDS and second == HOLDS:
        return "both hold: the paper's regime"
    failing = [f"M2 {m2.condition}" if m2.condition != HOLDS else None,
               f"the window change {second}" if second != HOLDS else None]
    return "; ".join(p for p in failing if p)


def plot(rows: list[Regime], path) -> str | None:
    """M2 / tau against the learning rate, one line per staleness (log-log: M2 ~ lr^2 is a
    slope of 2), with the paper's regime (<= 1) shaded."""
    points = [r for r in rows if r.ratio is not None and r.lr]
    if not points:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 4))
    for staleness in sorted({r.staleness for r in points}, key=str):
        line = sorted((r for r in points if r.staleness == staleness), key=lambda r: r.lr)
        ax.plot([r.lr for r in line], [r.ratio for r in line], "o-", label=f"staleness {staleness}")
        for r in line:
            ax.annotate(r.label.split(",")[0], (r.lr, r.ratio), fontsize=7, alpha=0.7)
    ax.axhspan(1e-4, 1.0, color="tab:green", alpha=0.1, label="the paper's regime (M2 <= tau)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("learning rate")
    ax.set_ylabel("M2 of the trained tokens / tau (median, steady state)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)
