"""Collapse detection for Tune trials: `CollapseStopper` (a `ray.tune.Stopper`) stops a trial
whose held-out accuracy fell far below its best, or whose diagnostics exploded (M2, masked
or clipped fraction, entropy, log-prob mismatch, a non-finite loss); `CollapseRecorder` (a
`ray.tune.Callback`) writes the reason into that trial's result and `collapse.json`.

With `stop=False` a collapse is recorded the same way and the trial trains on (its whole
curve, the collapse and after, stays in the experiment). A Stopper only answers yes or no; Tune hands the same result to the callbacks right after
it (before its loggers write result.json), and "user callbacks may modify the trial result
in place", so the recorder adds `collapse_reason` there.

A fall at a trial's last result is a collapse too. Under `CombinedStopper(reached, stopper)`
Tune asks `reached` first, and `any()` stops asking at its yes: the stopper never sees the
result that ends the trial. The recorder, which sees every result, hands it such a result.
`history_collapse` applies the same rule to a run's history records (`m2po report` does, to
every run, so its count does not depend on the stopper having seen the result).

    stopper = CollapseStopper(accuracy_drop=0.5, grace=20, limits={"m2_before": {"max": 1.0}})
    tune.RunConfig(stop=stopper, callbacks=[stopper.recorder()])
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from ray.tune import Callback, Stopper
from ray.rllib.utils.annotations import override

from m2po_rllib.common import keys
from m2po_rllib.common.errors import ConfigError
from m2po_rllib.common.keys import HELDOUT_ACCURACY, POLICY_VERSION
from m2po_rllib.jobs.history import CLIPPED_FRAC, ENTROPY_CLIPPED, FIELDS, first, heldout_accuracy, lookup

COLLAPSE_REASON = "collapse_reason"
COLLAPSE_FILE = "collapse.json"

# What a limit may watch: the history fields of m2po_rllib.jobs.history.
WATCHABLE = {**{k: FIELDS[k] for k in (
    "m2_before", "m2_after", "masked_frac", "entropy_all", "entropy_masked",
    "logp_mismatch_max", "log_ratio_abs_max", "trained_staleness_max",
)}, "clipped_frac": CLIPPED_FRAC, "entropy_clipped": ENTROPY_CLIPPED}


def _read(result: dict, name: str) -> float | None:
    path = WATCHABLE[name]
    return first(result, path) if isinstance(path[0], tuple) else lookup(result, path)


class CollapseStopper(Stopper):
    """Stops a trial that collapsed; `reasons[trial_id]` says why.

    Args:
        accuracy_drop: stop when held-out accuracy < (1 - accuracy_drop) x the trial's best
            so far (0.5: it lost half its best); None disables.
        min_best: the accuracy rule applies once the best reached this (noise near 0).
        grace: results (training iterations) before any rule applies.
        limits: {watched metric: {"max": x} and/or {"min": y}}, metrics from `WATCHABLE`
            (e.g. m2_before, masked_frac, clipped_frac, entropy_all, logp_mismatch_max).
        patience: consecutive results a limit must be broken before the trial stops (one
            minibatch's M2 spikes and settles).
        time_attr: the result key reported with the reason (the trial's clock).
        stop: stop a trial that collapsed (True) or only record the first collapse and let it
            train on to its stop condition (False).
    """

    def __init__(
        self,
        *,
        accuracy_drop: float | None = 0.5,
        min_best: float = 0.05,
        grace: int = 10,
        limits: dict[str, dict[str, float]] | None = None,
        patience: int = 1,
        time_attr: str = "training_iteration",
        stop: bool = True,
    ):
        limits = dict(limits or {})
        for name, bounds in limits.items():
            if name not in WATCHABLE:
                raise ConfigError(f"collapse limit {name!r} is not a watched metric; use one of {sorted(WATCHABLE)}")
            if not isinstance(bounds, dict) or not bounds or set(bounds) - {"min", "max"}:
                raise ConfigError(f"collapse limit {name!r} must be a mapping with 'max' and/or 'min', got {bounds!r}")
        if accuracy_drop is not None and not 0 < accuracy_drop < 1:
            raise ConfigError(f"accuracy_drop ({accuracy_drop}) must be in (0, 1): the fraction of the best accuracy lost")
        if not isinstance(stop, bool):
            raise ConfigError(f"collapse stop ({stop!r}) must be true (stop a collapsed trial) or false (record only)")
        if not isinstance(patience, int) or patience < 1:
            raise ConfigError(f"patience ({patience}) must be an int >= 1")
        self.accuracy_drop, self.min_best, self.grace = accuracy_drop, min_best, grace
        self.limits, self.patience, self.time_attr, self.stop = limits, patience, time_attr, stop
        self.reasons: dict[str, dict[str, Any]] = {}
        self._best: dict[str, float] = {}
        self._seen: dict[str, int] = {}
        self._strikes: dict[tuple[str, str], int] = {}
        self._asked: dict[str, Any] = {}  # trial -> training_iteration of the last result it was asked about

    @classmethod
    def from_spec(cls, spec: dict | None) -> "CollapseStopper":
        """From a search space's `collapse:` mapping (the constructor's keyword arguments)."""
        try:
            return cls(**(spec or {}))
        except TypeError as e:
            raise ConfigError(f"collapse: {e}; valid keys: accuracy_drop, min_best, grace, limits, patience, stop") from None

    def recorder(self) -> "CollapseRecorder":
        return CollapseRecorder(self)

    @override(Stopper)
    def __call__(self, trial_id: str, result: dict) -> bool:
        self._asked[trial_id] = result.get("training_iteration")
        if trial_id in self.reasons:
            return self.stop
        section, module = keys.LEARNER
        loss = ((result.get(section) or {}).get(module) or {}).get(keys.LOSS)  # NaN kept: lookup drops it
        reason = self.observe(trial_id, heldout_accuracy(result), lambda name: _read(result, name), loss)
        if reason is None:
            return False
        reason.update(trial_id=trial_id, training_iteration=result.get("training_iteration"))
        reason[self.time_attr] = result.get(self.time_attr)
        self.reasons[trial_id] = reason
        return self.stop

    def asked(self, trial_id: str, result: dict) -> bool:
        """Whether this result (its training_iteration) was put to the stopper."""
        return trial_id in self._asked and self._asked[trial_id] == result.get("training_iteration")

    def observe(self, trial_id: str, acc: float | None, read, loss=None) -> dict | None:
        """One result of the trial: its held-out accuracy, `read(name)` for the watched
        metrics, the policy loss; the reason when the rule finds a collapse, else None."""
        n = self._seen[trial_id] = self._seen.get(trial_id, 0) + 1
        if acc is not None:
            self._best[trial_id] = max(acc, self._best.get(trial_id, acc))
        return self._check(trial_id, read, acc, loss) if n > self.grace else None

    def _check(self, trial_id: str, read, acc: float | None, loss) -> dict | None:
        if isinstance(loss, float) and not math.isfinite(loss):
            return {"criterion": "loss", "value": str(loss), "reason": f"the policy loss is {loss}"}
        best = self._best.get(trial_id)
        if self.accuracy_drop is not None and acc is not None and best is not None and best >= self.min_best:
            floor = (1 - self.accuracy_drop) * best
            if acc < floor:
                return {
                    "criterion": keys.HELDOUT_ACCURACY, "value": acc, "threshold": floor, "best": best,
                    "reason": f"held-out accuracy {acc:.3f} fell below {1 - self.accuracy_drop:g} x its best {best:.3f}",
                }
        for name, bounds in self.limits.items():
            value = read(name)
            broken = value is not None and (
                ("max" in bounds and value > bounds["max"]) or ("min" in bounds and value < bounds["min"])
            )
            key = (trial_id, name)
            self._strikes[key] = self._strikes.get(key, 0) + 1 if broken else 0
            if broken and self._strikes[key] >= self.patience:
                side, bound = ("max", bounds["max"]) if "max" in bounds and value > bounds["max"] else ("min", bounds["min"])
                word = "above" if side == "max" else "below"
                return {
                    "criterion": name, "value": value, "threshold": bound,
                    "reason": f"{name} {value:.4g} {word} its limit {bound:g}"
                    + (f" for {self.patience} results in a row" if self.patience > 1 else ""),
                }
        return None

    @override(Stopper)
    def stop_all(self) -> bool:
        return False


class CollapseRecorder(Callback):
    """Adds `collapse_reason` to the result of the iteration a trial was stopped at (so it
    is in result.json and `Result.metrics`) and writes it to `<trial dir>/collapse.json`."""

    def __init__(self, stopper: CollapseStopper):
        self.stopper = stopper
        self._written: set[str] = set()

    @override(Callback)
    def on_trial_result(self, iteration, trials, trial, result, **info) -> None:
        if not self.stopper.asked(trial.trial_id, result):
            self.stopper(trial.trial_id, result)  # another stopper ended the trial on this result first
        reason = self.stopper.reasons.get(trial.trial_id)
        if reason is None or trial.trial_id in self._written:
            return
        result[COLLAPSE_REASON] = reason["reason"]
        if trial.local_path:
            path = Path(trial.local_path) / COLLAPSE_FILE
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(reason, indent=2, default=float))
        self._written.add(trial.trial_id)


def history_collapse(history: list[dict], spec: dict | None = None) -> dict | None:
    """The first collapse that `CollapseStopper.from_spec(spec)` finds in a run's history
    records (`m2po_rllib.jobs.history.history_record`), put to it one by one as the trial's
    results were: the reason with its training_iteration and policy_version, or None. The
    history has no NaN loss (the record keeps None), so only that criterion is not replayed."""
    stopper = CollapseStopper.from_spec({**(spec or {}), "stop": True})
    for record in history:
        reason = stopper.observe("run", record.get(HELDOUT_ACCURACY), record.get)
        if reason is not None:
            return {**reason, "training_iteration": record.get("iteration"), POLICY_VERSION: record.get(POLICY_VERSION)}
    return None
