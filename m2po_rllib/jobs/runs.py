"""The runs `m2po report` reads: `m2po train` run directories and Tune trials (`m2po lab`),
found up to three levels below each directory given, as the same history records
(`m2po_rllib.jobs.history.history_record`), grouped into variants (loss, staleness, tau,
lr, numerics) with seeds pooled.

A run's held-out evaluations are the iterations that evaluated (multiples of
`evaluation_interval`: the history carries the last value into the iterations between),
plus the evaluation before training and `m2po train`'s evaluation after its last iteration
where there is one. Its final value, the one every part of the report uses, is the mean
of its last `last_k` evaluations (`m2po_rllib.jobs.stats.headline`)."""

from __future__ import annotations

import csv
import json
import statistics
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, NamedTuple

from m2po_rllib.errors import ConfigError
from m2po_rllib.jobs.falls import Fall, falls
from m2po_rllib.jobs.history import history_record
from m2po_rllib.jobs.stats import headline
from m2po_rllib.keys import HELDOUT_ACCURACY, POLICY_VERSION
from m2po_rllib.rollout.staleness import AUTO

SETTINGS = ("policy_loss", "async_rollouts", "staleness", "max_staleness", "m2_threshold", "lr", "seed",
            "engine_kwargs", "recompute_behavior_logp", "rollout_correction", "evaluation_interval",
            "evaluation_duration")
LAST_K = 3  # the last held-out evaluations averaged into a run's final value (`m2po report --last-k`)
_SHORT_DTYPES = {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}


def numerics_label(settings: dict[str, Any]) -> str | None:
    """How a run's ratios were computed, when not the default (engine log-probs in the
    learner's own dtype): the engine's dtype, recomputed behaviour log-probs, a correction."""
    dtype = (settings.get("engine_kwargs") or {}).get("dtype")
    parts = [f"engine {_SHORT_DTYPES.get(dtype, dtype)}" if dtype else None,
             "recomputed" if settings.get("recompute_behavior_logp") else None,
             settings.get("rollout_correction")]
    return ", ".join(p for p in parts if p) or None


class Evaluation(NamedTuple):
    iteration: int  # the training iteration it followed (0: before training)
    update: int | None  # optimizer updates of the evaluated weights
    accuracy: float


@dataclass
class Run:
    path: Path
    settings: dict[str, Any]
    history: list[dict[str, Any]]
    note: str = ""  # why it ended early, other than a collapse (interrupted, failed)
    collapse: dict[str, Any] | None = None  # its first collapse: reason, training_iteration, source
    start: Evaluation | None = None  # summary.json's evaluation before training (`m2po train`)
    end: Evaluation | None = None  # summary.json's evaluation after the last iteration
    last_k: int = LAST_K
    collapse_rule: dict[str, Any] | None = None  # the CollapseStopper settings the report applied

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
    def evaluations(self) -> list[Evaluation]:
        """Every held-out evaluation, in order (module docstring). Without a known
        `evaluation_interval` (runs built by hand), every record with a value is one."""
        interval = self.settings.get("evaluation_interval")
        out = [self.start] if self.start else []
        first = self.history[0] if self.history else {}
        carried = first.get(HELDOUT_ACCURACY) if first.get("iteration") == 1 else None
        if not out and interval and interval > 1 and carried is not None:
            # M2PO evaluates before its first step; iterations before the first multiple carry it
            out.append(Evaluation(0, 0, carried))
        out += [Evaluation(h["iteration"], h.get(POLICY_VERSION), h[HELDOUT_ACCURACY]) for h in self.history
                if h.get(HELDOUT_ACCURACY) is not None and not (interval and h["iteration"] % interval)]
        if self.end and (not out or (self.end.update or 0) > (out[-1].update or 0)):
            out.append(self.end)  # not at the weights of the last evaluated iteration: one more evaluation
        return out

    @property
    def final(self) -> float | None:
        """The mean of the last `last_k` held-out evaluations."""
        return headline([e.accuracy for e in self.evaluations], self.last_k)

    @property
    def best(self) -> float | None:
        """The best single evaluation (secondary: the max favours noisy runs)."""
        return max((e.accuracy for e in self.evaluations), default=None)

    @property
    def collapsed(self) -> bool:
        return self.collapse is not None

    @cached_property
    def falls(self) -> list[Fall]:
        """Its falls (`m2po_rllib.jobs.falls`), computed once."""
        n = self.settings.get("evaluation_duration")
        return falls(self.evaluations, heldout_size=int(n) if isinstance(n, (int, float)) else None)

    def describe(self) -> str | None:
        """Its collapse and why it ended early, for the report's notes, or None."""
        parts = []
        if self.collapse:
            c = self.collapse
            found = " (found by the report in its history)" if c.get("source") == "report" else ""
            parts.append(f"collapsed: {c['reason']} at iteration {c.get('training_iteration')}{found}")
        parts += [f"fell and recovered: {f.describe()}" for f in self.falls if f.recovered is not None]
        if self.note:
            parts.append(self.note)
        return f"{self.path.name}: {'; '.join(parts)}" if parts else None


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
def _train_run(path: Path, last_k: int) -> Run:
    from m2po_rllib.config import M2POConfig

    meta = json.loads((path / "run.json").read_text())
    cfg = M2POConfig.from_spec({k: v for k, v in meta["spec"].items() if k != "run"})
    settings = {k: getattr(cfg, k, None) for k in SETTINGS}
    history = json.loads((path / "history.json").read_text())
    summary = json.loads((path / "summary.json").read_text()) if (path / "summary.json").exists() else {}
    return _with_collapse_rule(train_run(path, settings, history, summary, last_k), {})


def train_run(path: Path, settings: dict, history: list[dict], summary: dict, last_k: int = LAST_K) -> Run:
    """A `m2po train` run from its record: the history plus summary.json's evaluations before
    and after training (`m2po train` computes its summary's final value with this too)."""
    start = end = None
    if summary.get("start_heldout_accuracy") is not None:
        start = Evaluation(0, 0, summary["start_heldout_accuracy"])
    if summary.get("end_heldout_accuracy") is not None:
        end = Evaluation(summary.get("iterations") or 0, summary.get(POLICY_VERSION), summary["end_heldout_accuracy"])
    return Run(path, settings, history, "interrupted" if summary.get("interrupted") else "", start=start, end=end,
               last_k=last_k)


def _trial_results(path: Path) -> list[dict]:
    if (path / "result.json").exists():
        lines = (path / "result.json").read_text().splitlines()
        return [json.loads(line) for line in lines if line.strip()]
    with open(path / "progress.csv", newline="") as f:
        return list(csv.DictReader(f))


def _tune_trial(path: Path, last_k: int) -> Run:
    from m2po_rllib.jobs.collapse import COLLAPSE_FILE, COLLAPSE_REASON

    params = json.loads((path / "params.json").read_text())
    settings = {k: params.get(k) for k in SETTINGS}
    results = _trial_results(path)
    history = [
        history_record(r, int(float(r["training_iteration"])), float(r.get("time_total_s") or 0.0))
        for r in results
        if r.get("training_iteration") not in (None, "")
    ]
    collapse = None
    if (path / COLLAPSE_FILE).exists():
        collapse = {**json.loads((path / COLLAPSE_FILE).read_text()), "source": "recorded"}
    elif recorded := next((r for r in results if r.get(COLLAPSE_REASON)), None):
        collapse = {"reason": recorded[COLLAPSE_REASON], "training_iteration": recorded.get("training_iteration"),
                    "source": "recorded"}
    note = "failed (error.txt)" if (path / "error.txt").exists() else ""
    run = Run(path, settings, history, note, collapse=collapse, last_k=last_k)
    return _with_collapse_rule(run, lab_collapse_rule(path.parent))


def lab_collapse_rule(experiment: Path) -> dict[str, Any]:
    """The `collapse:` settings (`CollapseStopper.from_spec`) of the lab that ran the trials
    in `experiment`: lab.json's, else those of the space file it names, else {} (the
    stopper's defaults)."""
    lab = experiment / "lab.json"
    if not lab.exists():
        return {}
    meta = json.loads(lab.read_text())
    if "collapse" in meta:
        return dict(meta["collapse"] or {})
    space = Path(meta.get("space") or "")
    if space.is_file():
        import yaml

        return dict((yaml.safe_load(space.read_text()) or {}).get("collapse") or {})
    return {}


def _with_collapse_rule(run: Run, rule: dict[str, Any]) -> Run:
    """The collapse rule applied to the run's history too (`collapse.history_collapse`): a
    fall at a trial's last result, which the stopper may never have been asked about, or a
    `m2po train` run (no stopper), counts as a collapse. A recorded collapse is kept."""
    from m2po_rllib.jobs.collapse import history_collapse

    records = run.history
    evaluations = run.evaluations
    if run.end is not None and evaluations and evaluations[-1] is run.end:  # m2po train's evaluation after the loop
        records = [*records, {"iteration": run.end.iteration, POLICY_VERSION: run.end.update,
                              HELDOUT_ACCURACY: run.end.accuracy}]
    try:
        found = history_collapse(records, rule)
    except ConfigError:  # a space file edited since the lab ran: the stopper's defaults
        rule = {}
        found = history_collapse(records, rule)
    run.collapse_rule = rule
    if run.collapse is None and found is not None:
        run.collapse = {**found, "source": "report"}
    return run


def _is_train_run(d: Path) -> bool:
    return (d / "history.json").exists() and (d / "run.json").exists()


def _is_trial(d: Path) -> bool:
    return (d / "params.json").exists() and ((d / "result.json").exists() or (d / "progress.csv").exists())


def find_runs(dirs: list[str], depth: int = 3, last_k: int = LAST_K) -> list[Run]:
    """Every run directory at or below `dirs`, each run's final value the mean of its last
    `last_k` evaluations; ValueError when there is none."""
    found: list[Run] = []

    def walk(d: Path, level: int):
        if _is_train_run(d):
            found.append(_train_run(d, last_k))
        elif _is_trial(d):
            found.append(_tune_trial(d, last_k))
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
