"""`m2po report DIR [DIR ...] [--out OUT]`: a markdown table and PNG plots over `m2po train`
run directories and Tune experiments (`m2po lab`), with runs grouped into variants (loss,
staleness, tau, lr) and seeds pooled.

Run directories are found up to three levels below each DIR: a `m2po train` run holds
history.json + run.json (+ summary.json); a Tune trial holds params.json + result.json (or
progress.csv). Both become the same history records (`m2po_rllib.jobs.history.history_record`).
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path
from typing import Any

from m2po_rllib.jobs.runs import (
    Run, Variant, find_runs, group_variants, mean_std, phase_map, phase_markdown, updates_per_s,
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
    updates = [r.values(POLICY_VERSION)[-1] for r in runs if r.values(POLICY_VERSION)]
    times = [r.history[-1]["time_s"] for r in runs]
    speeds = [u for r in runs if (u := updates_per_s(r)) is not None]
    return {
        "variant": variant.label(),
        **variant.settings,
        "seeds": sorted({r.settings.get("seed") for r in runs}, key=lambda s: (s is None, s)),
        "runs": [str(r.path) for r in runs],
        "final_mean": mean_std(final)[0], "final_std": mean_std(final)[1],
        "best_mean": mean_std(best)[0], "best_std": mean_std(best)[1],
        "token_kind": fractions[0][0] if fractions else None,
        "token_frac_mean": statistics.fmean(f for _, f in fractions) if fractions else None,
        "updates": [min(updates), max(updates)] if updates else None,
        "time_s_mean": statistics.fmean(times),
        "updates_per_s_mean": mean_std(speeds)[0], "updates_per_s_std": mean_std(speeds)[1],
        "notes": sorted({f"{r.path.name}: {r.note}" for r in runs if r.note}),
    }


def _pm(mean, std, digits: int = 3) -> str:
    if mean is None:
        return "-"
    return f"{mean:.{digits}f} ± {std:.{digits}f}" if std is not None else f"{mean:.{digits}f}"


def markdown_table(rows: list[dict]) -> str:
    head = "| variant | seeds | final held-out | best held-out | masked / clipped tokens | updates | time | updates/s |"
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


def write_report(dirs: list[str], out: str | None = None) -> Path:
    """report.md, report.json and the PNGs into `out` (default: the first DIR/report)."""
    from m2po_rllib.jobs.report_plots import plot_all

    runs = find_runs(dirs)
    variants = group_variants(runs)
    rows = [summarize(v) for v in variants]
    out_dir = Path(out or Path(dirs[0]) / "report")
    out_dir.mkdir(parents=True, exist_ok=True)
    figures = plot_all(variants, out_dir)
    notes = [n for r in rows for n in r["notes"]]
    md = [
        "# M2PO staleness lab report",
        "",
        f"{len(runs)} runs in {len(variants)} variants from "
        f"{', '.join(os.path.relpath(Path(d).resolve(), out_dir.resolve()) for d in dirs)} (relative to this report).",
        "Held-out accuracy is greedy accuracy on the held-out problems, the last evaluation of each run "
        "(final) and its best evaluation (best), as mean ± sample std over seeds; masked / clipped tokens "
        "is the mean over training of M2PO's masked fraction or the clip losses' clipped fraction; "
        "updates are optimizer updates; time is wall-clock training time; updates/s is a run's updates over its "
        "time (mean ± std over seeds).",
        "",
        markdown_table(rows),
        "",
    ]
    pm = phase_map(variants)
    if pm is not None:
        md += ["## The map: final held-out accuracy by staleness x learning rate", "",
               "Per loss, the last evaluation's held-out accuracy (mean ± std over seeds; best evaluation in "
               "parentheses); a run stopped at its collapse (the space's collapse settings, `stop: true` by default) ends at the evaluation that found it.", "",
               phase_markdown(pm), ""]
    if notes:
        md += ["Runs that ended early:", "", *[f"- {n}" for n in notes], ""]
    untrained = [note for r in runs if (note := r.untrained_note())]
    if untrained:
        md += ["Runs with no optimizer update (their curves are empty):", "", *[f"- {n}" for n in untrained], ""]
    md += [f"![{p.stem}]({p.name})" for p in figures]
    path = out_dir / "report.md"
    path.write_text("\n".join(md) + "\n")
    (out_dir / "report.json").write_text(json.dumps(rows, indent=1, default=str))
    return path


def run_report(dirs: list[str], out: str | None = None) -> int:
    path = write_report(dirs, out)
    print(path.read_text().split("\n\n![", 1)[0])
    print(f"\nreport written to {path}")
    return 0
