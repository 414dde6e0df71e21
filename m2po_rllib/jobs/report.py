"""`m2po report DIR [DIR ...] [--out OUT]`: a markdown table and PNG plots over `m2po train`
run directories and Tune experiments (`m2po lab`), with runs grouped into variants (loss,
staleness, tau, lr) and seeds pooled.

Run directories are found up to three levels below each DIR: a `m2po train` run holds
history.json + run.json (+ summary.json); a Tune trial holds params.json + result.json (or
progress.csv). Both become the same history records (`m2po_rllib.jobs.history.history_record`).

A run's final value is the mean of its last k held-out evaluations (`--last-k`, default 3),
the one value the table, the map, the plots and the claims (`m2po_rllib.jobs.claims`) use.
report.json holds the variants' rows, every run's evaluations and collapse, and the claims.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
from pathlib import Path
from typing import Any

from m2po_rllib.common import durable
from m2po_rllib.common.errors import ConfigError
from m2po_rllib.common.keys import POLICY_VERSION
from m2po_rllib.jobs import regime, steady
from m2po_rllib.jobs.claims import MARGIN, claims_markdown, evaluate_claims, reference
from m2po_rllib.jobs.falls import FALL_DROP, MIN_BEST, Z_FALL
from m2po_rllib.jobs.phase_map import phase_map, phase_markdown
from m2po_rllib.jobs.runs import LAST_K, Run, Variant, find_runs, group_variants, mean_std, updates_per_s


def summarize(variant: Variant, out_dir: Path) -> dict[str, Any]:
    runs = variant.runs
    final = [r.final for r in runs if r.final is not None]
    best = [r.best for r in runs if r.best is not None]
    fraction = steady.fraction(runs, variant.key[2], variant.key[1])
    updates = [r.values(POLICY_VERSION)[-1] for r in runs if r.values(POLICY_VERSION)]
    times = [r.history[-1]["time_s"] for r in runs]
    speeds = [u for r in runs if (u := updates_per_s(r)) is not None]
    return {
        "variant": variant.label(),
        **variant.settings,
        "seeds": sorted({r.settings.get("seed") for r in runs}, key=lambda s: (s is None, s)),
        "runs": [_relative(r.path, out_dir) for r in runs],
        "final_mean": mean_std(final)[0], "final_std": mean_std(final)[1],
        "final_evaluations": [len(r.evaluations[-r.last_k:]) for r in runs],
        "best_mean": mean_std(best)[0], "best_std": mean_std(best)[1],
        "collapsed": sum(r.collapsed for r in runs),
        "fell_and_recovered": sum(any(f.recovered is not None for f in r.falls) for r in runs),
        "token_kind": fraction.kind if fraction else None,
        "token_frac_steady_mean": fraction.mean if fraction else None,
        "updates": [min(updates), max(updates)] if updates else None,
        "time_s_mean": statistics.fmean(times),
        "updates_per_s_mean": mean_std(speeds)[0], "updates_per_s_std": mean_std(speeds)[1],
        "notes": sorted({note for r in runs if (note := r.describe())}),
    }


def _relative(path: Path, out_dir: Path) -> str:
    """A run's path as report.json keeps it: relative to the report's directory."""
    return os.path.relpath(Path(path).resolve(), out_dir.resolve())


def run_record(run: Run, variant: Variant, out_dir: Path) -> dict[str, Any]:
    """One run in report.json: every held-out evaluation, its final value, its collapse and falls."""
    return {
        "path": _relative(run.path, out_dir), "variant": variant.label(), "seed": run.settings.get("seed"),
        "evaluations": [e._asdict() for e in run.evaluations],
        "final": run.final, "final_evaluations": len(run.evaluations[-run.last_k:]), "best": run.best,
        "collapse": run.collapse, "collapse_rule": run.collapse_rule, "falls": [f.to_json() for f in run.falls],
        "note": run.note or None,
    }


def _pm(mean, std, digits: int = 3) -> str:
    if mean is None:
        return "-"
    return f"{mean:.{digits}f} ± {std:.{digits}f}" if std is not None else f"{mean:.{digits}f}"


def markdown_table(rows: list[dict], last_k: int = LAST_K) -> str:
    head = (f"| variant | seeds | final held-out (last {last_k}) | best held-out | masked / clipped tokens at steady "
            "state | collapsed, fell and recovered | updates | time | updates/s |")
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for r in rows:
        frac = f"{r['token_kind']} {100 * r['token_frac_steady_mean']:.3f}%" if r["token_kind"] else "-"
        n = len(r["runs"])
        unstable = f"{r['collapsed']}/{n}, {r['fell_and_recovered']}/{n}"
        lo, hi = r["updates"] or (None, None)
        updates = "-" if lo is None else (f"{lo}" if lo == hi else f"{lo}-{hi}")
        seeds = f"{len(r['seeds'])} ({', '.join(str(s) for s in r['seeds'])})"
        if len(r["runs"]) > len(r["seeds"]):  # two runs of one seed are one seed, said so
            seeds += f", {len(r['runs'])} runs"
        t = r["time_s_mean"]
        time_s = f"{t / 60:.1f} min" if t >= 60 else f"{t:.0f} s"
        lines.append(
            f"| {r['variant']} | {seeds} | {_pm(r['final_mean'], r['final_std'])} | "
            f"{_pm(r['best_mean'], r['best_std'])} | {frac} | {unstable} | {updates} | {time_s} | "
            f"{_pm(r['updates_per_s_mean'], r['updates_per_s_std'], digits=2)} |"
        )
    return "\n".join(lines)


def definitions(last_k: int) -> list[str]:
    """The report's header: what each number is."""
    return [
        f"**Final held-out accuracy** of a run is the mean of its last {last_k} held-out evaluations (greedy accuracy "
        "on the held-out problems; an evaluation is an iteration at a multiple of `evaluation_interval`, the one "
        "before training, and `m2po train`'s evaluation after its last iteration when that is at later weights; a "
        f"run with fewer has the mean of those it has). It is the one final value of this report: the table's "
        f"(mean ± sample std over seeds), the map's, the plots' and the claims'. best is the run's best single "
        "evaluation (secondary: a max favours noisy runs). report.json keeps every evaluation of every run.",
        "A run **collapsed** when the collapse rule of `m2po lab` (`CollapseStopper`: held-out accuracy below "
        "(1 - accuracy_drop) x its best so far after `grace` results, or a watched metric past its limit) fires on "
        "a result, the last one included; the report applies it to every run's history (a lab's trials with the "
        "space's `collapse:` settings, `m2po train` runs with the defaults), besides what the lab recorded.",
        f"A run **fell and recovered** when its held-out accuracy dropped below {1 - FALL_DROP:g} x its best so far "
        f"(once the best reached {MIN_BEST:g}, and by more than {Z_FALL:g} binomial standard errors of a difference "
        f"when the number of held-out problems is known) and came back to {1 - FALL_DROP / 2:g} x that best later "
        "(`m2po_rllib/jobs/falls.py`): an instability the collapse rule does not count. The table gives both per "
        "variant as runs out of its runs; report.json keeps every fall.",
        "Masked / clipped tokens at steady state is M2PO's masked fraction or the clip losses' clipped fraction over "
        "the iterations that trained on data as old as the staleness (past the stale-k ramp; every iteration "
        "on-policy): a run's mean over those iterations, a variant's the mean over its seeds, one number in the "
        "table, the Regime section and claim (d) (`m2po_rllib/jobs/steady.py`). Updates are optimizer updates; time "
        "is wall-clock training time; updates/s is a run's updates over its time (mean ± std over seeds).",
    ]


def write_report(dirs: list[str], out: str | None = None, last_k: int = LAST_K, margin: float = MARGIN) -> Path:
    """report.md, report.json and the PNGs into `out` (default: the first DIR/report)."""
    from m2po_rllib.jobs.report_plots import plot_all

    if last_k < 1:
        raise ConfigError(f"--last-k ({last_k}) must be >= 1: the number of last evaluations a run's final value averages")
    if margin <= 0:
        raise ConfigError(f"--margin ({margin}) must be > 0: the accuracy difference the claims call a match, e.g. 0.02")
    runs = find_runs(dirs, last_k=last_k)
    variants = group_variants(runs)
    out_dir = Path(out or Path(dirs[0]) / "report")
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = [summarize(v, out_dir) for v in variants]
    claims = evaluate_claims(variants, margin)
    figures = plot_all(variants, out_dir)
    notes = [n for r in rows for n in r["notes"]]
    md = [
        "# M2PO staleness lab report",
        "",
        f"{len(runs)} runs in {len(variants)} variants from "
        f"{', '.join(os.path.relpath(Path(d).resolve(), out_dir.resolve()) for d in dirs)} (relative to this report).",
        "",
        *[line for d in definitions(last_k) for line in (d, "")],
        markdown_table(rows, last_k),
        "",
    ]
    pm = phase_map(variants)
    if pm is not None:
        md += ["## The map: final held-out accuracy by staleness x learning rate", "",
               f"Per loss, the final held-out accuracy (mean of the last {last_k} evaluations; mean ± std over seeds; "
               "best evaluation in parentheses); a run stopped at its collapse (the space's collapse settings, "
               "`stop: true` by default) ends at the evaluation that found it.", "",
               phase_markdown(pm), ""]
    md += claims_markdown(claims, last_k, margin)
    regimes, _, section = regime_section(variants, out_dir, margin)
    md += section
    if notes:
        md += ["Runs that collapsed, fell and recovered, or ended early:", "", *[f"- {n}" for n in notes], ""]
    untrained = [note for r in runs if (note := r.untrained_note())]
    if untrained:
        md += ["Runs with no optimizer update (their curves are empty):", "", *[f"- {n}" for n in untrained], ""]
    md += [f"![{p.stem}]({p.name})" for p in figures]
    path = out_dir / "report.md"
    durable.write_text(path, "\n".join(md) + "\n")
    report = {
        "definitions": {"last_k": last_k, "margin": margin, "header": definitions(last_k)},
        "variants": rows,
        "runs": [run_record(r, v, out_dir) for v in variants for r in v.runs],
        "claims": [c.to_json() for c in claims],
        "regime": [{**dataclasses.asdict(r), "ratio": r.ratio, "tail_ratio": r.tail_ratio, "condition": r.condition,
                    "window": d.to_json() if d else None, "both": regime.both(r, d)}
                   for r, d in regimes],
    }
    durable.write_json(out_dir / "report.json", report, indent=1, default=str)
    return path


def regime_section(variants: list[Variant], out_dir: Path, margin: float):
    """The Regime section: per stale variant, condition 1 (M2 against tau) and condition 2 (the
    on-policy arm's change within one window of its staleness), and both
    (`m2po_rllib/jobs/regime.py`). Returns [(Regime, Drift or None)], the Drifts measured, the lines."""
    rows, drifts = [], {}
    for v in variants:
        level = v.key[2]
        if level in (0, None):
            continue
        r = regime.regime(v.label(), {**v.settings, "policy_loss": v.settings["policy_loss"] or ""}, v.runs)
        if not r.records:
            continue
        ref = reference(variants, v) if isinstance(level, int) else None
        if ref is not None and (ref.key, level) not in drifts:
            drifts[(ref.key, level)] = regime.drift(ref.label(), ref.runs, level, margin)
        rows.append((r, drifts.get((ref.key, level)) if ref is not None else None))
    if not rows:
        return rows, [], []
    measured = [d for d in drifts.values() if d is not None]
    figure = regime.plot([r for r, _ in rows], out_dir / "regime.png")
    md = ["## Regime: the two conditions the paper's results hold under", "",
          "The paper's results hold where (1) M2 of the stale data sits at or below tau, the tail as well as the "
          "median, and (2) the policy changes little within one staleness window (../shared/M2PO.md; "
          "`m2po_rllib/jobs/regime.py`).", "",
          "**Condition 1.** M2 of the trained tokens before masking over the iterations trained on data as old as "
          "the staleness (past the stale-k ramp), pooled over seeds; tau is the variant's own (M2PO) or the paper's "
          f"{regime.PAPER_TAU} (clip losses). It holds when the {100 * regime.TAIL:.0f}th percentile is at or below "
          "tau.", "", regime.markdown([r for r, _ in rows]), ""]
    if figure:
        md += [f"![regime]({Path(figure).name})", ""]
    md += ["**Condition 2.** The on-policy arm's held-out accuracy change per window of the stale arms' staleness, "
           "at the end of its runs (each seed's least-squares slope over its evaluations in the last two windows or "
           f"the last quarter of the run, whichever is longer, times the window). It holds when the change is equivalent to 0 within ±{regime.WINDOW_SHARE:g} x the "
           f"claims' margin (TOST, 90% interval over seeds), does not hold when the interval lies outside.", ""]
    md += [regime.drift_markdown(measured), ""] if measured else ["No on-policy arm with evaluations to measure it.", ""]
    md += ["| variant | condition 1 (M2) | condition 2 (window) | both |", "|---|---|---|---|",
           *[f"| {r.label} | {r.condition} | {d.condition if d else 'not measured'} | {regime.both(r, d)} |"
             for r, d in rows], ""]
    return rows, measured, md


def run_report(dirs: list[str], out: str | None = None, last_k: int = LAST_K, margin: float = MARGIN) -> int:
    path = write_report(dirs, out, last_k, margin)
    print(path.read_text().split("\n\n![", 1)[0])
    print(f"\nreport written to {path}")
    return 0
