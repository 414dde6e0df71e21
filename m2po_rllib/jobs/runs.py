"""The runs `m2po report` reads: `m2po train` run directories and Tune trials (`m2po lab`),
found up to three levels below each directory given, as the same history records
(`m2po_rllib.jobs.history.history_record`), grouped into variants (loss, staleness, tau,
lr, numerics) with seeds pooled."""

from __future__ import annotations

import csv
import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from m2po_rllib.errors import ConfigError
from m2po_rllib.jobs.history import history_record
from m2po_rllib.keys import HELDOUT_ACCURACY, POLICY_VERSION
from m2po_rllib.rollout.staleness import AUTO

SETTINGS = ("policy_loss", "async_rollouts", "staleness", "max_staleness", "m2_threshold", "lr", "seed",
            "engine_kwargs", "recompute_behavior_logp", "rollout_correction")
_SHORT_DTYPES = {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}


def numerics_label(settings: dict[str, Any]) -> str | None:
    """How a run's ratios were computed, when not the default (engine log-probs in the
    learner's own dtype): the engine's dtype, recomputed behaviour log-probs, a correction."""
    dtype = (settings.get("engine_kwargs") or {}).get("dtype")
    parts = [f"engine {_SHORT_DTYPES.get(dtype, dtype)}" if dtype else None,
             "recomputed" if settings.get("recompute_behavior_logp") else None,
             settings.get("rollout_correction")]
    return ", ".join(p for p in parts if p) or None


@dataclass
class Run:
    path: Path
    settings: dict[str, Any]
    history: list[dict[str, Any]]
    note: str = ""  # why it ended early (collapse, scheduler, interrupt)

    def values(self, name: str) -> list[float]:
        return [h[name] for h in self.history if h.get(name) is not None]

    @property
    def trained(self) -> bool:
        """Whether any optimizer update was applied (a stale-k run trains nothing while its
        queue fills)."""
        return any(v > 0 for v in self.values(POLICY_VERSION))

    def untrained_note(self) -> str | None:
        """Why this run has no updates to show, or None if it has some."""
        if self.trained:
            return None
        return (f"{self.path.name}: not trained yet: its {len(self.history)} iteration(s) only filled the stale "
                f"queue (staleness {self.settings.get('staleness')} updates); train it for more iterations")

    @property
    def final(self) -> float | None:
        acc = self.values(HELDOUT_ACCURACY)
        return acc[-1] if acc else None

    @property
    def best(self) -> float | None:
        acc = self.values(HELDOUT_ACCURACY)
        return max(acc) if acc else None


@dataclass
class Variant:
    key: tuple
    runs: list[Run] = field(default_factory=list)

    @property
    def settings(self) -> dict[str, Any]:
        return dict(zip(("policy_loss", "mode", "staleness", "m2_threshold", "lr", "numerics"), self.key))

    def label(self, columns=("policy_loss", "staleness", "m2_threshold", "lr", "numerics")) -> str:
        s = self.settings
        parts = {
            "policy_loss": s["policy_loss"],
            "staleness": f"stale {'<=' if s['mode'] == 'async' and s['staleness'] != AUTO else ''}{s['staleness']}",
            "m2_threshold": f"tau {s['m2_threshold']:g}" if s["m2_threshold"] is not None else None,
            "lr": f"lr {s['lr']:g}",
            "numerics": s["numerics"],
        }
        return ", ".join(parts[c] for c in columns if parts.get(c))


def updates_per_s(run: Run) -> float | None:
    """Optimizer updates per second of wall-clock training time over the whole run."""
    updates = run.values(POLICY_VERSION)
    if not updates or not run.history or not run.history[-1].get("time_s"):
        return None
    return updates[-1] / run.history[-1]["time_s"]


def mean_std(values: list[float]) -> tuple[float | None, float | None]:
    """Mean and sample standard deviation (n - 1; None for one run)."""
    if not values:
        return None, None
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else None)


# -- reading runs --------------------------------------------------------------------------
def _train_run(path: Path) -> Run:
    from m2po_rllib.config import M2POConfig

    meta = json.loads((path / "run.json").read_text())
    cfg = M2POConfig.from_spec({k: v for k, v in meta["spec"].items() if k != "run"})
    settings = {k: getattr(cfg, k, None) for k in SETTINGS}
    history = json.loads((path / "history.json").read_text())
    summary = json.loads((path / "summary.json").read_text()) if (path / "summary.json").exists() else {}
    return Run(path, settings, history, "interrupted" if summary.get("interrupted") else "")


def _trial_results(path: Path) -> list[dict]:
    if (path / "result.json").exists():
        lines = (path / "result.json").read_text().splitlines()
        return [json.loads(line) for line in lines if line.strip()]
    with open(path / "progress.csv", newline="") as f:
        return list(csv.DictReader(f))


def _tune_trial(path: Path) -> Run:
    from m2po_rllib.jobs.collapse import COLLAPSE_FILE, COLLAPSE_REASON

    params = json.loads((path / "params.json").read_text())
    settings = {k: params.get(k) for k in SETTINGS}
    results = _trial_results(path)
    history = [
        history_record(r, int(float(r["training_iteration"])), float(r.get("time_total_s") or 0.0))
        for r in results
        if r.get("training_iteration") not in (None, "")
    ]
    note = next((r[COLLAPSE_REASON] for r in results if r.get(COLLAPSE_REASON)), "")
    if not note and (path / COLLAPSE_FILE).exists():
        note = json.loads((path / COLLAPSE_FILE).read_text()).get("reason", "")
    if (path / "error.txt").exists():
        note = (note + "; " if note else "") + "failed (error.txt)"
    return Run(path, settings, history, f"collapsed: {note}" if note and "failed" not in note else note)


def _is_train_run(d: Path) -> bool:
    return (d / "history.json").exists() and (d / "run.json").exists()


def _is_trial(d: Path) -> bool:
    return (d / "params.json").exists() and ((d / "result.json").exists() or (d / "progress.csv").exists())


def find_runs(dirs: list[str], depth: int = 3) -> list[Run]:
    """Every run directory at or below `dirs`; ValueError when there is none."""
    found: list[Run] = []

    def walk(d: Path, level: int):
        if _is_train_run(d):
            found.append(_train_run(d))
        elif _is_trial(d):
            found.append(_tune_trial(d))
        elif level < depth:
            for child in sorted(p for p in d.iterdir() if p.is_dir() and p.name != "checkpoint"):
                walk(child, level + 1)

    for name in dirs:
        d = Path(name)
        if not d.is_dir():
            raise FileNotFoundError(f"{d} is not a directory")
        walk(d, 0)
    runs = [r for r in found if r.history]
    if not runs:
        raise ConfigError(
            f"no runs found in {', '.join(dirs)}: `m2po report` reads `m2po train` run directories "
            "(history.json + run.json) and Tune experiments of `m2po lab` (trial dirs with params.json + result.json)"
        )
    return runs


def group_variants(runs: list[Run]) -> list[Variant]:
    """Runs that differ only in their seed form a variant. tau belongs to the key only for
    the losses that take it (m2po, m2po_official)."""
    from m2po_rllib.losses import policy_loss_params

    variants: dict[tuple, Variant] = {}
    for run in runs:
        s = run.settings
        loss = s.get("policy_loss") or "?"
        takes_tau = loss != "?" and "m2_threshold" in policy_loss_params(loss)
        mode = "async" if s.get("async_rollouts") else "stale-k"
        staleness = s.get("max_staleness") if mode == "async" else s.get("staleness")
        key = (loss, mode, staleness_level(staleness), s.get("m2_threshold") if takes_tau else None, s.get("lr"),
               numerics_label(s))
        variants.setdefault(key, Variant(key)).runs.append(run)
    return sorted(variants.values(), key=lambda v: tuple(order(x) for x in v.key))


def staleness_level(value) -> int | str:
    """A variant's staleness: the updates (stale-k) or the bound (async), or "auto"."""
    return AUTO if value == AUTO else int(value or 0)


def order(value) -> tuple:
    """A sort key for key entries that mix None, numbers and names ("auto" after the numbers)."""
    return value is None, isinstance(value, str), value


# -- the table -----------------------------------------------------------------------------


# -- the phase map: final accuracy per (staleness, lr), one panel per loss ------------------
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
        return sum(r.note.startswith("collapsed") for r in self.runs)


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
