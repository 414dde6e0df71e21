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
import json
import os
import statistics
from pathlib import Path
from typing import Any

from m2po_rllib.errors import ConfigError
from m2po_rllib.jobs.claims import MARGIN, claims_markdown, evaluate_claims, steady_fraction
from m2po_rllib.jobs import regime
from m2po_rllib.jobs.runs import (
    LAST_K, Run, Variant, find_runs, group_variants, mean_std, phase_map, phase_markdown, updates_per_s,
)
from m2po_rllib.keys import POLICY_VERSION


def token_fraction(run: Run) -> tuple[str, float] | None:
    """("masked", mean masked fraction) for M2PO, ("clipped", ...) for the clip losses."""
    for kind in ("masked", "clipped"):
        values = run.values(f"{kind}_frac")
        if values:
            return kind, statistics.fmean(values)
    return None


def summarize(variant: Variant) -> dict[str, Any]:
    runs = variant.runs
    final = [r.final for r in runs if r.final is not None]
    best = [r.best for r in runs if r.best is not None]
    fractions = [f for r in runs if (f := token_fraction(r))]
    level = variant.key[2]
    steady = [f for r in runs if fractions and isinstance(level, int)
              and (f := steady_fraction(r, f"{fractions[0][0]}_frac", level)) is not None]
    updates = [r.values(POLICY_VERSION)[-1] for r in runs if r.values(POLICY_VERSION)]
    times = [r.history[-1]["time_s"] for r in runs]
    speeds = [u for r in runs if (u := updates_per_s(r)) is not None]
    return {
        "variant": variant.label(),
        **variant.settings,
        "seeds": sorted({r.settings.get("seed") for r in runs}, key=lambda s: (s is None, s)),
        "runs": [str(r.path) for r in runs],
        "final_mean": mean_std(final)[0], "final_std": mean_std(final)[1],
        "final_evaluations": [len(r.evaluations[-r.last_k:]) for r in runs],
        "best_mean": mean_std(best)[0], "best_std": mean_std(best)[1],
        "collapsed": sum(r.collapsed for r in runs),
        "token_kind": fractions[0][0] if fractions else None,
        "token_frac_mean": statistics.fmean(f for _, f in fractions) if fractions else None,
        "token_frac_steady_mean": statistics.fmean(steady) if steady else None,
        "updates": [min(updates), max(updates)] if updates else None,
        "time_s_mean": statistics.fmean(times),
        "updates_per_s_mean": mean_std(speeds)[0], "updates_per_s_std": mean_std(speeds)[1],
        "notes": sorted({note for r in runs if (note := r.describe())}),
    }


def run_record(run: Run, variant: Variant) -> dict[str, Any]:
    """One run in report.json: every held-out evaluation, its final value and its collapse."""
    return {
        "path": str(run.path), "variant": variant.label(), "seed": run.settings.get("seed"),
        "evaluations": [e._asdict() for e in run.evaluations],
        "final": run.final, "final_evaluations": len(run.evaluations[-run.last_k:]), "best": run.best,
        "collapse": run.collapse, "collapse_rule": run.collapse_rule, "note": run.note or None,
    }


def _pm(mean, std, digits: int = 3) -> str:
    if mean is None:
        return "-"
    return f"{mean:.{digits}f} ± {std:.{digits}f}" if std is not None else f"{mean:.{digits}f}"


def markdown_table(rows: list[dict], last_k: int = LAST_K) -> str:
    head = (f"| variant | seeds | final held-out (last {last_k}) | best held-out | masked / clipped tokens | updates "
            "| time | updates/s |")
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for r in rows:
        frac = f"{r['token_kind']} {100 * r['token_frac_mean']:.2f}%" if r["token_kind"] else "-"
        lo, hi = r["updates"] or (None, None)
        updates = "-" if lo is None else (f"{lo}" if lo == hi else f"{lo}-{hi}")
        seeds = f"{len(r['seeds'])} ({', '.join(str(s) for s in r['seeds'])})"
        if len(r["runs"]) > len(r["seeds"]):  # two runs of one seed are one seed, said so
            seeds += f", {len(r['runs'])} runs"
        t = r["time_s_mean"]
        time_s = f"{t / 60:.1f} min" if t >= 60 else f"{t:.0f} s"
        lines.append(
            f"| {r['variant']} | {seeds} | {_pm(r['final_mean'], r['final_std'])} | "
            f"{_pm(r['best_mean'], r['best_std'])} | {frac} | {updates} | {time_s} | "
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
        "Masked / clipped tokens is the mean over training of M2PO's masked fraction or the clip losses' clipped "
        "fraction; updates are optimizer updates; time is wall-clock training time; updates/s is a run's updates "
        "over its time (mean ± std over seeds).",
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
    rows = [summarize(v) for v in variants]
    claims = evaluate_claims(variants, margin)
    out_dir = Path(out or Path(dirs[0]) / "report")
    out_dir.mkdir(parents=True, exist_ok=True)
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
    regimes = [regime.regime(v.label(), {**v.settings, "policy_loss": v.settings["policy_loss"] or ""},
                             [r.history for r in v.runs]) for v in variants]
    regimes = [r for r in regimes if r.staleness not in (0, None) and r.records]
    if regimes:
        figure = regime.plot(regimes, out_dir / "regime.png")
        md += ["## Regime: M2 of the stale data against tau", "",
               "M2 of the trained tokens before masking, over the records trained on data as old as the "
               "staleness (policy version >= staleness, past the stale-k ramp), pooled over seeds; tau is the "
               f"variant's own (M2PO) or the paper's {regime.PAPER_TAU} (clip losses). The paper's results hold "
               "where M2 <= tau (`m2po_rllib/jobs/regime.py`).", "",
               regime.markdown(regimes), ""]
        if figure:
            md += [f"![regime]({Path(figure).name})", ""]
    if notes:
        md += ["Runs that collapsed or ended early:", "", *[f"- {n}" for n in notes], ""]
    untrained = [note for r in runs if (note := r.untrained_note())]
    if untrained:
        md += ["Runs with no optimizer update (their curves are empty):", "", *[f"- {n}" for n in untrained], ""]
    md += [f"![{p.stem}]({p.name})" for p in figures]
    path = out_dir / "report.md"
    path.write_text("\n".join(md) + "\n")
    report = {
        "definitions": {"last_k": last_k, "margin": margin, "header": definitions(last_k)},
        "variants": rows,
        "runs": [run_record(r, v) for v in variants for r in v.runs],
        "claims": [c.to_json() for c in claims],
        "regime": [{**dataclasses.asdict(r), "ratio": r.ratio, "verdict": r.verdict} for r in regimes],
    }
    (out_dir / "report.json").write_text(json.dumps(report, indent=1, default=str))
    return path


def run_report(dirs: list[str], out: str | None = None, last_k: int = LAST_K, margin: float = MARGIN) -> int:
    path = write_report(dirs, out, last_k, margin)
    print(path.read_text().split("\n\n![", 1)[0])
    print(f"\nreport written to {path}")
    return 0
