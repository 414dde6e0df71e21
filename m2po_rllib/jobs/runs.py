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

from m2po_rllib.common.errors import ConfigError
from m2po_rllib.common.keys import HELDOUT_ACCURACY, POLICY_VERSION
from m2po_rllib.jobs.falls import Fall, falls
from m2po_rllib.jobs.history import history_record
from m2po_rllib.jobs.stats import headline
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
    from m2po_rllib.config.algorithm_config import M2POConfig

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


def latest_attempt(results: list[dict]) -> list[dict]:
    """A trial's results as its last attempt left them: a trial retried from a checkpoint
    (Tune's `max_failures`, e.g. its node lost) writes the iterations after that checkpoint
    again, and the earlier attempt's copies of them are dropped."""
    kept: list[dict] = []
    for r in results:
        if r.get("training_iteration") in (None, ""):
            continue
        it = float(r["training_iteration"])
        while kept and float(kept[-1]["training_iteration"]) >= it:
            kept.pop()
        kept.append(r)
    return kept


def tune_trial_states(experiment: Path) -> dict[str, tuple[str, int]]:
    """Each trial directory's last status and failures as Tune's newest experiment state
    records them ({"000_seed=0": ("TERMINATED", 1)}); {} where there is none (trial
    directories copied elsewhere)."""
    states = sorted(experiment.glob("experiment_state-*.json"))
    if not states:
        return {}
    try:
        data = json.loads(states[-1].read_text())
        out = {}
        for trial, runtime in data["trial_data"]:
            trial = json.loads(trial) if isinstance(trial, str) else trial
            runtime = json.loads(runtime) if isinstance(runtime, str) else runtime
            out[trial["relative_logdir"]] = (trial["status"], int(runtime.get("num_failures", 0)))
        return out
    except (OSError, ValueError, KeyError, TypeError):  # another Tune's format: fall back to error.txt
        return {}


def _failed(path: Path) -> bool:
    """The trial's last attempt failed. A trial retried from its checkpoint and finished keeps
    the error.txt of its failed attempt: Tune's experiment state says which it was."""
    state = tune_trial_states(path.parent).get(path.name)
    if state is not None:
        return state[0] == "ERROR"
    return (path / "error.txt").exists()


def _tune_trial(path: Path, last_k: int) -> Run:
    from m2po_rllib.jobs.collapse import COLLAPSE_FILE, COLLAPSE_REASON

    params = json.loads((path / "params.json").read_text())
    settings = {k: params.get(k) for k in SETTINGS}
    results = latest_attempt(_trial_results(path))
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
    note = "failed (error.txt)" if _failed(path) else ""
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
