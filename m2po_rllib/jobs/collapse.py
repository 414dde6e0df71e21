"""Collapse detection for Tune trials: `CollapseStopper` (a `ray.tune.Stopper`) stops a trial
whose held-out accuracy fell far below its best, or whose diagnostics exploded (M2, masked
or clipped fraction, entropy, log-prob mismatch, a non-finite loss); `CollapseRecorder` (a
`ray.tune.Callback`) writes the reason into that trial's result and `collapse.json`.

With `stop=False` a collapse is recorded the same way and the trial trains on (its whole
curve, the collapse and after, stays in the experiment). A Stopper only answers yes or no; Tune hands the same result to the callbacks right after
it (before its loggers write result.json), and "user callbacks may modify the trial result
in place", so the recorder adds `collapse_reason` there.

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

from m2po_rllib import keys
from m2po_rllib.errors import ConfigError
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
        if trial_id in self.reasons:
            return self.stop
        n = self._seen[trial_id] = self._seen.get(trial_id, 0) + 1
        acc = heldout_accuracy(result)
        if acc is not None:
            self._best[trial_id] = max(acc, self._best.get(trial_id, acc))
        reason = self._check(trial_id, result, acc) if n > self.grace else None
        if reason is None:
            return False
        reason.update(trial_id=trial_id, training_iteration=result.get("training_iteration"))
        reason[self.time_attr] = result.get(self.time_attr)
        self.reasons[trial_id] = reason
        return self.stop

    def _check(self, trial_id: str, result: dict, acc: float | None) -> dict | None:
        section, module = keys.LEARNER
        loss = ((result.get(section) or {}).get(module) or {}).get(keys.LOSS)  # NaN kept: lookup drops it
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
            value = _read(result, name)
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
        reason = self.stopper.reasons.get(trial.trial_id)
        if reason is None or trial.trial_id in self._written:
            return
        result[COLLAPSE_REASON] = reason["reason"]
        if trial.local_path:
            path = Path(trial.local_path) / COLLAPSE_FILE
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(reason, indent=2, default=float))
        self._written.add(trial.trial_id)
