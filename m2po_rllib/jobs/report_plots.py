"""The figures of `m2po report` (matplotlib, Agg backend): one panel per staleness level,
one colour per variant, mean over seeds with a +-1 std band, optimizer updates on x.

- heldout_accuracy.png: held-out accuracy vs optimizer updates
- reward.png: training reward (the current weights' sampled completions) vs optimizer
  updates, at every training step (denser than the held-out evaluations)
- final_vs_staleness.png: final held-out accuracy (a run's mean of its last k evaluations)
  vs staleness, one line per loss (and tau, lr)
- token_fraction.png: M2PO's masked vs the clip losses' clipped token fraction
- entropy.png: entropy of masked / clipped tokens (dashed) vs all tokens (solid)
- m2.png: M2 (mean squared log-ratio) before (solid) and after (dashed) M2PO's mask
- mismatch.png: the engine's log-probs against the learner's (mean |delta|), where measured
  (the mismatch check, or every round with recomputed behaviour log-probs)
- phase_map.png (stale-k runs over >= 2 staleness levels and >= 2 learning rates): one
  heatmap per loss, staleness x learning rate, coloured by final held-out accuracy (mean
  over seeds), collapsed cells outlined in red with how many of their runs collapsed
- async_bound.png (async runs): the staleness bound in force vs updates, and final
  held-out accuracy vs optimizer updates per second
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from m2po_rllib.common.keys import HELDOUT_ACCURACY, POLICY_VERSION
from m2po_rllib.jobs.phase_map import phase_map
from m2po_rllib.jobs.runs import Variant, mean_std, order, updates_per_s
from m2po_rllib.rollout.staleness import AUTO


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _curve(variant: Variant, field: str, smooth: int = 1, when: str | None = None):
    """(updates, mean, std) of `field` over the variant's runs, aligned by iteration; with
    `when`, only the iterations that carry that field (e.g. m2_before: the ones that trained)."""
    by_iter: dict[int, list[tuple[float, float]]] = {}
    for run in variant.runs:
        history = [h for h in run.history if when is None or h.get(when) is not None]
        values = [(h["iteration"], h.get(POLICY_VERSION), h.get(field)) for h in history]
        values = [(i, x, y) for i, x, y in values if x is not None and y is not None]
        if smooth > 1 and values:
            ys = np.convolve([y for *_, y in values], np.ones(smooth) / smooth, mode="valid")
            values = [(i, x, y) for (i, x, _), y in zip(values[smooth - 1 :], ys)]
        for i, x, y in values:
            by_iter.setdefault(i, []).append((x, y))
    its = sorted(by_iter)
    xs = np.array([np.mean([x for x, _ in by_iter[i]]) for i in its])
    stats = [mean_std([y for _, y in by_iter[i]]) for i in its]
    return xs, np.array([m for m, _ in stats]), np.array([s or 0.0 for _, s in stats])


def _panels(variants: list[Variant]):
    levels = sorted({v.key[2] for v in variants}, key=order)
    return levels, {lvl: [v for v in variants if v.key[2] == lvl] for lvl in levels}


def _colors(variants: list[Variant]):
    plt = _plt()
    cmap = plt.get_cmap("tab10" if len(variants) <= 10 else "tab20")
    family = sorted({_family(v) for v in variants}, key=str)
    return {f: cmap(i % cmap.N) for i, f in enumerate(family)}


def _family(v: Variant):
    return v.key[0], v.key[3], v.key[4], v.key[5]


def _label(v: Variant, variants: list[Variant]) -> str:
    varying = [c for c, i in (("m2_threshold", 3), ("lr", 4), ("numerics", 5)) if len({u.key[i] for u in variants}) > 1]
    return v.label(("policy_loss", *varying))


# legend names of the plotted fields
NAMES = {
    "masked_frac": "masked", "clipped_frac": "clipped", "entropy_all": "all tokens",
    "entropy_masked": "masked tokens", "entropy_clipped": "clipped tokens", "m2_before": "before mask",
    "m2_after": "after mask",
}


def _per_staleness(variants, out: Path, name: str, fields, ylabel: str, title: str, *, smooth=1, logy=False, pct=False,
                   refs=(), when=None):
    """One panel per staleness level; `fields` = [(field, linestyle)] drawn per variant; one
    legend for the figure (a variant has one colour in every panel)."""
    plt = _plt()
    levels, panels = _panels(variants)
    colors = _colors(variants)
    fig, axes = plt.subplots(1, len(levels), figsize=(3.6 * len(levels) + 3.2, 3.6), sharey=True, squeeze=False,
                             layout="constrained")
    legend: dict[str, object] = {}
    for ax, lvl in zip(axes[0], levels):
        drawn = 0
        for v in panels[lvl]:
            for f, style in fields:
                xs, mean, std = _curve(v, f, smooth, when)
                if not len(xs):
                    continue
                scale = 100.0 if pct else 1.0
                label = _label(v, variants) + ("" if len(fields) == 1 else f": {NAMES.get(f, f)}")
                kw = {"drawstyle": "steps-post"} if f == HELDOUT_ACCURACY else {}
                (line,) = ax.plot(xs, mean * scale, style, color=colors[_family(v)], lw=1.5, **kw)
                ax.fill_between(xs, (mean - std) * scale, (mean + std) * scale, color=colors[_family(v)],
                                alpha=0.15, lw=0, **({"step": "post"} if kw else {}))
                legend.setdefault(label, line)
                drawn += 1
        if not drawn and not any(r.trained for v in panels[lvl] for r in v.runs):
            # the training diagnostics of a run that has not trained yet: say why they are empty
            ax.text(0.5, 0.5, "not trained yet:\nthe stale queue\nis still filling", transform=ax.transAxes,
                    ha="center", va="center", fontsize=9, color="gray")
            legend.setdefault("(no optimizer update yet)", ax.plot([], [], alpha=0)[0])
        mode = "<=" if panels[lvl][0].key[1] == "async" and lvl != AUTO else ""
        for y in refs:  # e.g. tau on the M2 plot
            legend.setdefault(f"tau = {y:g}", ax.axhline(y, color="gray", ls=":", lw=1))
        ax.set_title(f"staleness {mode}{lvl}", fontsize=10)
        ax.set_xlabel("optimizer updates")
        ax.grid(alpha=0.3)
        if logy:
            ax.set_yscale("log")
    axes[0][0].set_ylabel(ylabel)
    fig.suptitle(title, fontsize=10)
    path = out / f"{name}.png"
    if legend:
        fig.legend(legend.values(), legend.keys(), loc="outside right center", fontsize=7)
        fig.savefig(path, dpi=110)
    plt.close(fig)
    return path if legend else None


def _final_vs_staleness(variants: list[Variant], out: Path):
    plt = _plt()
    colors = _colors(variants)
    fig, ax = plt.subplots(figsize=(6.8, 3.8), layout="constrained")
    for family in colors:
        # the fixed levels ("auto" has no place on the axis: async_bound.png shows it)
        members = sorted((v for v in variants if _family(v) == family and v.key[2] != AUTO), key=lambda v: v.key[2])
        points = [(v.key[2], mean_std([r.final for r in v.runs if r.final is not None])) for v in members]
        points = [(x, m, s or 0.0) for x, (m, s) in points if m is not None]
        if points:
            x, m, s = zip(*points)
            ax.errorbar(x, m, yerr=s, marker="o", capsize=3, color=colors[family], label=_label(members[0], variants))
    ax.set_xlabel("staleness (optimizer updates)")
    ax.set_ylabel(f"final held-out accuracy (last {_last_k(variants)})")
    ax.set_title(f"final held-out accuracy vs staleness\n(mean of each run's last {_last_k(variants)} evaluations; "
                 "mean ± std over seeds)", fontsize=10)
    ax.grid(alpha=0.3)
    fig.legend(loc="outside right center", fontsize=7)
    path = out / "final_vs_staleness.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _last_k(variants: list[Variant]) -> int:
    """The evaluations a run's final value averages (one k per report)."""
    return next((r.last_k for v in variants for r in v.runs), 1)


def _async_bound(variants: list[Variant], out: Path):
    """Async runs: the staleness bound in force vs updates (fixed bounds are flat, "auto"
    moves), and final held-out accuracy vs updates per second (mean ± std over seeds)."""
    variants = [v for v in variants if v.key[1] == "async"]
    if not variants:
        return None
    plt = _plt()
    cmap = plt.get_cmap("tab10")
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 3.8), layout="constrained")
    for i, v in enumerate(variants):
        color, label = cmap(i % 10), v.label()
        xs, m, sd = _curve(v, "staleness_bound")
        if len(xs):
            ax.plot(xs, m, color=color, label=label)
            ax.fill_between(xs, m - sd, m + sd, color=color, alpha=0.15, linewidth=0)
        speed = mean_std([u for r in v.runs if (u := updates_per_s(r)) is not None])
        final = mean_std([r.final for r in v.runs if r.final is not None])
        if speed[0] is not None and final[0] is not None:
            bx.errorbar(speed[0], final[0], xerr=speed[1] or 0.0, yerr=final[1] or 0.0, marker="o", capsize=3,
                        color=color, label=label)
    ax.set_xlabel("optimizer updates")
    ax.set_ylabel("max_staleness in force")
    ax.set_yscale("log", base=2)
    ax.set_title("the staleness bound (mean ± std over seeds)", fontsize=10)
    bx.set_xlabel("optimizer updates per second (whole run)")
    bx.set_ylabel("final held-out accuracy")
    bx.set_title("accuracy vs throughput (mean ± std over seeds)", fontsize=10)
    for a in (ax, bx):
        a.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if not handles:  # no bound recorded (runs from before it was): the scatter's
        handles, labels = bx.get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside right center", fontsize=7)
    path = out / "async_bound.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _phase_map(variants: list[Variant], out: Path):
    pm = phase_map(variants)
    if pm is None:
        return None
    plt = _plt()
    values = [c.final[0] for p in pm.panels.values() for c in p.values() if c.final[0] is not None]
    lo, hi = min(values), max(values)
    n = len(pm.panels)
    fig, axes = plt.subplots(1, n, figsize=(3.2 * n + 1.2, 0.9 * len(pm.staleness) + 1.6), squeeze=False,
                             layout="constrained")
    image = None
    for ax, (name, cells) in zip(axes[0], pm.panels.items()):
        grid = np.full((len(pm.staleness), len(pm.lrs)), np.nan)
        for (s, lr), cell in cells.items():
            if cell.final[0] is not None:
                grid[pm.staleness.index(s), pm.lrs.index(lr)] = cell.final[0]
        image = ax.imshow(grid, cmap="viridis", vmin=lo, vmax=hi if hi > lo else lo + 1e-6, aspect="auto")
        for (s, lr), cell in cells.items():
            (fm, fs), (bm, _) = cell.final, cell.best
            if fm is None:
                continue
            i, j = pm.staleness.index(s), pm.lrs.index(lr)
            text = f"{fm:.2f}" + (f"±{fs:.2f}" if fs is not None else "") + f"\nbest {bm:.2f}"
            if cell.collapsed:
                text += f"\ncollapsed {cell.collapsed}/{len(cell.runs)}"
                ax.add_patch(plt.Rectangle((j - 0.47, i - 0.47), 0.94, 0.94, fill=False, ec="red", lw=2.5))
            if cell.shared_from:
                text += "\n(on-policy runs)"
            dark = (fm - lo) / (hi - lo or 1) < 0.55
            ax.text(j, i, text, ha="center", va="center", fontsize=7, color="white" if dark else "black")
        ax.set_xticks(range(len(pm.lrs)), [f"{lr:g}" for lr in pm.lrs])
        ax.set_yticks(range(len(pm.staleness)), [str(s) for s in pm.staleness])
        ax.set_xlabel("learning rate")
        ax.set_title(name, fontsize=10)
    axes[0][0].set_ylabel("staleness (optimizer updates)")
    fig.colorbar(image, ax=list(axes[0]), label=f"final held-out accuracy (last {_last_k(variants)})", shrink=0.9)
    fig.suptitle("final held-out accuracy by staleness x learning rate (mean over seeds; red: runs that collapsed)",
                 fontsize=10)
    path = out / "phase_map.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_all(variants: list[Variant], out: Path) -> list[Path]:
    """Write every figure that has data; return their paths."""
    n = max((len(r.history) for v in variants for r in v.runs), default=1)
    smooth = max(1, n // 25)  # moving average over ~4% of the run for the per-step diagnostics
    avg = f" (moving average over {smooth} iterations)" if smooth > 1 else ""
    paths = [
        _per_staleness(variants, out, HELDOUT_ACCURACY, [(HELDOUT_ACCURACY, "-")], "held-out accuracy",
                       "held-out greedy accuracy (mean ± std over seeds)"),
        # the steps that trained: while the stale queue fills, every round is the base model's
        _per_staleness(variants, out, "reward", [("reward", "-")], "training reward",
                       "training reward of the current weights' samples" + avg, smooth=smooth, when="m2_before"),
        _final_vs_staleness(variants, out),
        _per_staleness(variants, out, "token_fraction", [("masked_frac", "-"), ("clipped_frac", "--")],
                       "tokens (%)", "masked (M2PO) vs clipped tokens" + avg,
                       smooth=smooth, pct=True),
        _per_staleness(variants, out, "entropy", [("entropy_all", "-"), ("entropy_masked", "--"),
                                                  ("entropy_clipped", ":")],
                       "entropy (nats)", "entropy of all vs masked / clipped tokens" + avg,
                       smooth=smooth),
        _per_staleness(variants, out, "m2", [("m2_before", "-"), ("m2_after", "--")], "M2",
                       "M2 (mean squared log-ratio) before and after the mask" + avg,
                       smooth=smooth, logy=True, refs=sorted({v.key[3] for v in variants if v.key[3] is not None})),
        _per_staleness(variants, out, "mismatch", [("logp_mismatch_mean", "-")], "mean |delta log-prob|",
                       "engine vs learner log-probs on the generating weights", logy=True,
                       when="logp_mismatch_mean"),
        _async_bound(variants, out),
        _phase_map(variants, out),
    ]
    return [p for p in paths if p is not None]
