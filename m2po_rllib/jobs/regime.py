"""Which regime a config trains in: the second moment M2 of the log-ratios of the data it
trains on once the data is as old as its staleness, against tau.

The paper's results hold where M2 of 256-stale data sits at or below tau (0.04): GRPO clips
1.22% of tokens at lr 1e-6, which implies M2 around 0.01, and M2PO masks a rare outlier
(0.006%). M2 at a fixed age grows about as lr^2 (the policy moves lr per update), so a
config at a 3x larger lr sits ~9x higher. `make calibrate` runs short stale trials at a few
learning rates and the report's "Regime" section states, per variant, M2 / tau and what
the clip or the mask removed there; run it before choosing tau or a staleness level.
No Ray import.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from m2po_rllib.keys import POLICY_VERSION

PAPER_TAU = 0.04  # the paper's tau, for variants that have none (the clip losses)


def steady_state(history: list[dict], staleness) -> list[dict]:
    """The records trained on data as old as the staleness: after the stale-k ramp of
    base-model rounds (policy version >= staleness), i.e. past its first `staleness` updates."""
    if not isinstance(staleness, (int, float)) or staleness <= 0:
        return [h for h in history if (h.get(POLICY_VERSION) or 0) > 0]
    return [h for h in history if (h.get(POLICY_VERSION) or 0) >= staleness]


@dataclass
class Regime:
    label: str
    lr: float | None
    staleness: int | str | None
    tau: float
    m2_median: float | None  # M2 of the trained tokens before masking, median over steady-state records
    m2_q90: float | None
    token_kind: str | None  # "masked" (M2PO) or "clipped" (clip losses)
    token_frac: float | None  # mean over steady-state records
    records: int

    @property
    def ratio(self) -> float | None:
        return None if self.m2_median is None else self.m2_median / self.tau

    @property
    def verdict(self) -> str:
        if self.ratio is None:
            return "no M2 recorded"
        if self.ratio <= 1:
            return f"the paper's regime (M2 {self.ratio:.2f}x tau)"
        return f"outside the paper's regime (M2 {self.ratio:.1f}x tau)"


def regime(label: str, settings: dict, histories: list[list[dict]]) -> Regime:
    """The regime of one variant from its runs' histories (seeds pooled)."""
    staleness = settings.get("staleness")
    tau = settings.get("m2_threshold") if settings.get("policy_loss", "").startswith("m2po") else None
    records = [h for history in histories for h in steady_state(history, staleness)]
    m2 = sorted(h["m2_before"] for h in records if h.get("m2_before") is not None)
    kind = next((k for k in ("masked", "clipped") if any(h.get(f"{k}_frac") is not None for h in records)), None)
    fracs = [h[f"{kind}_frac"] for h in records if kind and h.get(f"{kind}_frac") is not None]
    return Regime(
        label=label, lr=settings.get("lr"), staleness=staleness, tau=float(tau or PAPER_TAU),
        m2_median=statistics.median(m2) if m2 else None,
        m2_q90=m2[min(len(m2) - 1, int(0.9 * len(m2)))] if m2 else None,
        token_kind=kind, token_frac=statistics.fmean(fracs) if fracs else None, records=len(records),
    )


def markdown(rows: list[Regime]) -> str:
    head = ("| variant | lr | staleness | M2 at steady state (median, 90th pct) | M2 / tau | "
            "masked / clipped tokens | regime |")
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for r in rows:
        m2 = "-" if r.m2_median is None else f"{r.m2_median:.4f}, {r.m2_q90:.4f}"
        ratio = "-" if r.ratio is None else f"{r.ratio:.2f}"
        frac = "-" if r.token_frac is None else f"{r.token_kind} {100 * r.token_frac:.3f}%"
        lines.append(f"| {r.label} | {r.lr:g} | {r.staleness} | {m2} | {ratio} | {frac} | {r.verdict} |"
                     if r.lr is not None else f"| {r.label} | - | {r.staleness} | {m2} | {ratio} | {frac} | {r.verdict} |")
    return "\n".join(lines)


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
