"""The phase map of a report: final held-out accuracy per (staleness, learning rate), one
panel per loss (and tau), over the stale-k variants of `runs.py`; `report.py` writes its
tables, `report_plots.py` its figure."""

from __future__ import annotations

from dataclasses import dataclass

from m2po_rllib.jobs.runs import Run, Variant, mean_std


@dataclass
class PhaseCell:
    runs: list[Run]
    shared_from: str | None = None  # the panel whose on-policy runs stand in for this one's

    @property
    def final(self) -> tuple[float | None, float | None]:
        return mean_std([r.final for r in self.runs if r.final is not None])

    @property
    def best(self) -> tuple[float | None, float | None]:
        return mean_std([r.best for r in self.runs if r.best is not None])

    @property
    def collapsed(self) -> int:
        return sum(r.collapsed for r in self.runs)


@dataclass
class PhaseMap:
    staleness: list[int]  # rows
    lrs: list[float]  # columns
    panels: dict[str, dict[tuple[int, float], PhaseCell]]  # loss label -> (staleness, lr) -> cell


def phase_map(variants: list[Variant]) -> PhaseMap | None:
    """The stale-k variants as a staleness x learning-rate map per loss (and tau), or None when
    they do not span at least two staleness levels and two learning rates (runs without a
    held-out evaluation or a learning rate do not count). A panel with no
    run at staleness 0 for a learning rate borrows the on-policy runs of the one panel that
    has them (a space may run on-policy once when the losses coincide there, e.g. with one
    optimizer update per step every ratio is 1); the cell says whose they are."""
    cells = [v for v in variants if v.key[1] == "stale-k" and v.key[5] is None and isinstance(v.key[2], int)
             and v.key[4] is not None and any(r.final is not None for r in v.runs)]
    staleness = sorted({v.key[2] for v in cells})
    lrs = sorted({v.key[4] for v in cells})
    if len(staleness) < 2 or len(lrs) < 2:
        return None
    panels: dict[str, dict[tuple[int, float], PhaseCell]] = {}
    for v in cells:
        name = v.label(("policy_loss", "m2_threshold"))
        panels.setdefault(name, {})[(v.key[2], v.key[4])] = PhaseCell(list(v.runs))
    for lr in lrs:
        owners = [name for name, p in panels.items() if (0, lr) in p and not p[(0, lr)].shared_from]
        if len(owners) == 1:
            for name, p in panels.items():
                p.setdefault((0, lr), PhaseCell(panels[owners[0]][(0, lr)].runs, shared_from=owners[0]))
    return PhaseMap(staleness, lrs, dict(sorted(panels.items())))


def phase_markdown(pm: PhaseMap) -> str:
    """One table per panel: final held-out accuracy (mean ± std over seeds), best in
    parentheses, and how many of the cell's runs collapsed."""
    out = []
    for name, cells in pm.panels.items():
        head = "| staleness | " + " | ".join(f"lr {lr:g}" for lr in pm.lrs) + " |"
        lines = [f"**{name}**", "", head, "|" + "---|" * (len(pm.lrs) + 1)]
        for s in pm.staleness:
            row = []
            for lr in pm.lrs:
                cell = cells.get((s, lr))
                if cell is None or cell.final[0] is None:
                    row.append("-")
                    continue
                (fm, fs), (bm, bs) = cell.final, cell.best
                text = f"{fm:.3f}" + (f" ± {fs:.3f}" if fs is not None else "") + f" (best {bm:.3f})"
                if cell.collapsed:
                    text += f", **collapsed {cell.collapsed}/{len(cell.runs)}**"
                if cell.shared_from:
                    text += f" [on-policy runs of {cell.shared_from}]"
                row.append(text)
            lines.append(f"| {s} | " + " | ".join(row) + " |")
        out.append("\n".join(lines))
    return "\n\n".join(out)
