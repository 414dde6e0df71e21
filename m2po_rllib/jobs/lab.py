"""The staleness lab: a Ray Tune search over loss x staleness x tau x lr x seeds, read from a
search-space file (tune/spaces/*.yaml), with every trial validated before any starts.

    name: lab-cpu
    base: ../../configs/default.yaml        # relative to the space file
    overrides: {training.lr: 3.0e-5}        # every trial (section.key, as on the command line)
    grid:                                   # every combination; a list of grids = their union
      training.policy_loss: [m2po, grpo]
      training.staleness: [0, 64]
      debugging.seed: [0, 1]
    stop: {policy_version: 200}             # any result key (>=); policy_version = optimizer updates
    scheduler: {type: asha, metric: heldout_accuracy, mode: max, time_attr: policy_version, grace_period: 100}
    collapse: {accuracy_drop: 0.5, grace: 20, limits: {m2_before: {max: 1.0}}}   # CollapseStopper
    max_concurrent: null                    # null: floor(cluster CPUs / CPUs per trial) (and GPUs)
    max_failures: 2                         # a failed trial (e.g. its node lost) is retried from its last checkpoint
    checkpoint_every: 25                    # iterations between a trial's checkpoints (what a retry redoes at most)

Trials are `M2PO` trainables: `M2PO.default_resource_request` gives each trial a placement
group holding its main process, EnvRunners and Learners (`resources.num_cpus_for_main_process`,
`env_runners.num_cpus_per_env_runner`, `learners.num_gpus_per_learner`, ...).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from m2po_rllib.common import keys
from m2po_rllib.common.errors import ConfigError
from m2po_rllib.common.keys import HELDOUT_ACCURACY
from m2po_rllib.config.algorithm_config import M2POConfig
from m2po_rllib.config.from_yaml import JOB_SECTION, SECTIONS, apply_overrides, load_spec, parse_value

SPACE_KEYS = {"name", "base", "overrides", "grid", "stop", "scheduler", "collapse", "max_concurrent", "max_failures",
              "checkpoint_every"}
DEFAULT_MAX_FAILURES = 2  # retries of a failed trial, each from its last checkpoint (Tune's FailureConfig)
SCHEDULERS = ("fifo", "asha")
LAB_FILE = "lab.json"  # the expanded space, written into the experiment directory
TRIAL_CHECKPOINT_EVERY = 25  # default iterations between a trial's checkpoints (what a continued lab redoes at most)


@dataclass
class LabTrial:
    swept: dict[str, Any]  # the grid's section.key -> value of this trial
    config: Any  # the validated M2POConfig

    @property
    def label(self) -> str:
        return ",".join(f"{k.rsplit('.', 1)[-1]}={v}" for k, v in self.swept.items()) or "base"


@dataclass
class LabSpace:
    path: Path
    name: str
    trials: list[LabTrial]
    stop: dict[str, float]
    scheduler: dict[str, Any]
    collapse: dict[str, Any]
    max_concurrent: int | None
    base_spec: dict = field(repr=False, default_factory=dict)
    max_failures: int = DEFAULT_MAX_FAILURES
    checkpoint_every: int = TRIAL_CHECKPOINT_EVERY


def _fail(path, msg: str):
    raise ConfigError(f"{path}: {msg}")


def _blame(error: ConfigError, keys) -> list[str]:
    """The section.key settings among `keys` that the error holds at fault."""
    return [k for k in keys if k in error.settings or k.rsplit(".", 1)[-1] in error.settings]


def _grids(path, grid) -> list[dict[str, list]]:
    blocks = grid if isinstance(grid, list) else [grid or {}]
    for block in blocks:
        if not isinstance(block, dict):
            _fail(path, f"`grid` must map section.key to a list of values (or be a list of such maps), got {block!r}")
        for key, values in block.items():
            if not isinstance(key, str) or "." not in key or key.split(".", 1)[0] not in SECTIONS:
                _fail(path, f"grid key {key!r} must be section.key with a section of {', '.join(SECTIONS)}")
            if not isinstance(values, list) or not values:
                _fail(path, f"grid key `{key}` must list its values, e.g. {key}: [{values!r}]; a single setting goes in `overrides`")
    return blocks


def load_space(path: str | Path, overrides: list[str] | None = None, stop_override: list[str] | None = None) -> LabSpace:
    """Read a search space and validate every trial's config; ConfigError naming the file,
    the key and the fix on the first bad one. `stop_override` (`key=value` items, e.g. from `m2po lab
    --stop policy_version=40`) replaces the space's stop rule: a shorter trial for a try."""
    from m2po_rllib.config.from_yaml import parse_override

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"search space {path} does not exist (see tune/spaces/)")
    space = load_spec(str(path))
    unknown = set(space) - SPACE_KEYS
    if unknown:
        _fail(path, f"unknown key(s) {sorted(unknown)}; a search space has {sorted(SPACE_KEYS)}")
    if "base" not in space:
        _fail(path, "`base` is missing: the config every trial starts from, e.g. base: ../../configs/default.yaml")
    base = (path.parent / space["base"]).resolve()
    if not base.exists():
        _fail(path, f"`base` {space['base']!r} resolves to {base}, which does not exist (it is relative to the space file)")
    fixed = dict(space.get("overrides") or {})
    fixed.update({f"{s}.{k}": v for s, k, v in map(parse_override, overrides or [])})
    for key in fixed:
        if "." not in key or key.split(".", 1)[0] not in SECTIONS:
            _fail(path, f"override {key!r} must be section.key with a section of {', '.join(SECTIONS)}")
    base_spec = apply_overrides(load_spec(str(base)), fixed)
    base_spec.pop(JOB_SECTION, None)  # `m2po train`'s own settings; the space's `stop` rules here

    trials, seen = [], set()
    for block in _grids(path, space.get("grid")):
        keys = list(block)
        for values in itertools.product(*(block[k] for k in keys)):
            swept = dict(zip(keys, values))
            marker = json.dumps(swept, sort_keys=True, default=str)
            if marker in seen:
                continue
            seen.add(marker)
            trial = LabTrial(swept=swept, config=None)
            try:
                trial.config = M2POConfig.from_spec(apply_overrides(base_spec, swept))
                trial.config.validate()
            except ConfigError as e:
                blamed = _blame(e, [*swept, *fixed]) or [*swept]
                where = ", ".join(f"`{k}` ({'grid' if k in swept else 'overrides'})" for k in blamed)
                _fail(path, f"trial {len(trials)} ({trial.label}) is invalid; fix {where}:\n{e}")
            trials.append(trial)
    if not trials:
        _fail(path, "the grid has no trials")

    stop = dict(space.get("stop") or {})
    if stop_items := list(stop_override or []):
        stop = {}
        for item in stop_items:
            key, sep, value = item.partition("=")
            if not sep or not key:
                _fail(path, f"--stop {item!r} must look like key=value, e.g. --stop policy_version=40")
            stop[key] = parse_value(value, f"--stop {item!r}")
    if not stop:
        _fail(path, "`stop` is missing, e.g. stop: {policy_version: 200} (optimizer updates) or {training_iteration: 50}")
    for key, value in stop.items():
        if not isinstance(value, (int, float)) or value <= 0:
            _fail(path, f"stop `{key}` ({value!r}) must be a positive number")
    scheduler = {"type": "fifo", **(space.get("scheduler") or {})}
    if scheduler["type"] not in SCHEDULERS:
        _fail(path, f"scheduler type {scheduler['type']!r} must be one of {SCHEDULERS}")
    if scheduler["type"] != "fifo":
        no_eval = [t.label for t in trials if not t.config.evaluation_interval]
        if no_eval:
            _fail(path, f"the {scheduler['type']} scheduler ranks trials by held-out accuracy, but trial(s) {no_eval} "
                  "never evaluate: set evaluation.evaluation_interval (e.g. 10) in `overrides`")
    collapse = space.get("collapse") or {}
    from m2po_rllib.jobs.collapse import CollapseStopper

    try:
        CollapseStopper.from_spec(collapse)
    except ConfigError as e:
        _fail(path, str(e))
    max_concurrent = space.get("max_concurrent")
    if max_concurrent is not None and (not isinstance(max_concurrent, int) or max_concurrent < 1):
        _fail(path, f"`max_concurrent` ({max_concurrent!r}) must be a positive int or null (fit the cluster)")
    max_failures = space.get("max_failures", DEFAULT_MAX_FAILURES)
    if not isinstance(max_failures, int) or isinstance(max_failures, bool) or max_failures < 0:
        _fail(path, f"`max_failures` ({max_failures!r}) must be an int >= 0: how often a failed trial is retried "
                    "from its last checkpoint (0: never)")
    checkpoint_every = space.get("checkpoint_every", TRIAL_CHECKPOINT_EVERY)
    if not isinstance(checkpoint_every, int) or isinstance(checkpoint_every, bool) or checkpoint_every < 1:
        _fail(path, f"`checkpoint_every` ({checkpoint_every!r}) must be an int >= 1: iterations between a trial's "
                    "checkpoints")
    return LabSpace(path, space.get("name") or path.stem, trials, stop, scheduler, collapse, max_concurrent, base_spec,
                    max_failures, checkpoint_every)


def trial_resources(config) -> dict[str, float]:
    """CPUs and GPUs of a trial's placement group (main process, EnvRunners, Learners)."""
    from m2po_rllib.driver.m2po import M2PO

    bundles = M2PO.default_resource_request(config).bundles
    return {r: float(sum(b.get(r, 0) for b in bundles)) for r in ("CPU", "GPU")}


def fit_concurrency(trials: list[LabTrial], cluster: dict[str, float]) -> int:
    """Trials that fit at once: floor(cluster CPUs / CPUs per trial), and the same for GPUs."""
    need = [trial_resources(t.config) for t in trials]
    fits = []
    for r in ("CPU", "GPU"):
        per_trial = max(n[r] for n in need)
        if per_trial > 0:
            have = cluster.get(r, 0.0)
            if have < per_trial:
                raise ConfigError(
                    f"a trial needs {per_trial:g} {r}s and this Ray cluster has {have:g}: lower the trial's "
                    f"resources (resources.num_cpus_for_main_process, env_runners.num_env_runners, "
                    f"learners.num_learners, ...) or add nodes; pass --max-concurrent on an autoscaling cluster"
                )
            fits.append(math.floor(have / per_trial))
    return max(1, min(fits))


class _TrialNames:
    """Tune trial (and directory) names from the grid values: `policy_loss=grpo,staleness=64`."""

    def __init__(self, points: list[dict], labels: list[str]):
        self.points, self.labels = points, labels

    def _index(self, trial) -> int:
        # the largest point the trial matches is its own (a point holds what differs from the base)
        matches = [i for i, p in enumerate(self.points) if all(trial.config.get(k) == v for k, v in p.items())]
        return max(matches, key=lambda i: len(self.points[i]), default=-1)

    def __call__(self, trial) -> str:
        i = self._index(trial)
        label = self.labels[i] if i >= 0 else trial.trial_id
        return f"{max(i, 0):03d}_{re.sub(r'[^A-Za-z0-9_.=,-]', '_', label)}"[:120]


def _points(space: LabSpace) -> list[dict]:
    """Each trial as the config attributes in which it differs from the first (Tune's
    `points_to_evaluate` over the first trial's config): the config object maps section.key
    to attributes, so a grid may set any settings, and a list of grids couples them."""
    first = space.trials[0].config.to_dict()
    return [{k: v for k, v in t.config.to_dict().items() if first.get(k) != v} for t in space.trials]


def build_scheduler(spec: dict, stop: dict):
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler

    spec = dict(spec)
    kind = spec.pop("type", "fifo")
    if kind == "fifo":
        return FIFOScheduler()
    spec.setdefault("metric", HELDOUT_ACCURACY)
    spec.setdefault("mode", "max")
    spec.setdefault("time_attr", next(iter(stop)))
    spec.setdefault("max_t", int(stop.get(spec["time_attr"], 100)))
    try:
        return ASHAScheduler(**spec)
    except TypeError as e:
        raise ConfigError(f"scheduler (asha): {e}; see ray.tune.schedulers.ASHAScheduler") from None


def run_lab(
    space_path: str,
    *,
    out: str | None = None,
    max_concurrent: int | None = None,
    overrides: list[str] | None = None,
    stop: list[str] | None = None,
    report: bool = True,
    verbose: int = 1,
) -> int:
    """Validate every trial, run the search with Tune, then `m2po report` on it."""
    space = load_space(space_path, overrides, stop)
    need = [trial_resources(t.config) for t in space.trials]

    import ray
    from ray import tune
    from ray.tune.search.basic_variant import BasicVariantGenerator
    from ray.tune.stopper import CombinedStopper, FunctionStopper

    from m2po_rllib.jobs.collapse import CollapseStopper
    from m2po_rllib.jobs.local_ray import init_ray, quiet_job_logs

    quiet_job_logs()
    init_ray()
    cluster = ray.cluster_resources()
    concurrent = max_concurrent or space.max_concurrent or fit_concurrency(space.trials, cluster)
    out_dir = Path(out or Path("runs") / "lab" / f"{space.name}-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    per_trial = max(need, key=lambda n: (n["GPU"], n["CPU"]))
    gpus = f", {per_trial['GPU']:g} GPU" if per_trial["GPU"] else ""
    print(
        f"lab {space.name}: {len(space.trials)} trials from {space.path}; each {per_trial['CPU']:g} CPU{gpus}; "
        f"{concurrent} at a time on {cluster.get('CPU', 0):g} CPUs, {cluster.get('GPU', 0):g} GPUs\n"
        f"  experiment: {out_dir}"
    )
    if tune.Tuner.can_restore(str(out_dir)):
        return _continue_lab(out_dir, space, report=report)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / LAB_FILE).write_text(json.dumps({
        "space": str(space.path.resolve()),
        "overrides": list(overrides or []),
        "stop": space.stop,
        "collapse": space.collapse,
        "trials": [{"swept": t.swept, "label": t.label, "resources": n} for t, n in zip(space.trials, need)],
    }, indent=1, default=str))

    points = _points(space)
    names = _TrialNames(points, [t.label for t in space.trials])
    collapse = CollapseStopper.from_spec({"time_attr": next(iter(space.stop)), **space.collapse})
    limits = dict(space.stop)
    reached = FunctionStopper(lambda trial_id, result: any((result.get(k) or 0) >= v for k, v in limits.items()))
    # Tune's legacy reporter: one compact status table (the default prints every trial's config)
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
    reporter = tune.CLIReporter(
        metric_columns={HELDOUT_ACCURACY: "held-out", keys.POLICY_VERSION: "updates", keys.STALENESS_MEAN: "stale (mean)"},
        parameter_columns=sorted({k for p in points for k in p}), max_report_frequency=30,
    )
    tuner = tune.Tuner(
        "M2PO",
        param_space=space.trials[0].config,
        tune_config=tune.TuneConfig(
            num_samples=len(points),
            search_alg=BasicVariantGenerator(points_to_evaluate=points),
            scheduler=build_scheduler(space.scheduler, space.stop),
            max_concurrent_trials=concurrent,
            trial_name_creator=names,
            trial_dirname_creator=names,
        ),
        run_config=tune.RunConfig(
            name=out_dir.name,
            storage_path=str(out_dir.parent),
            stop=CombinedStopper(reached, collapse),
            callbacks=[collapse.recorder()],
            progress_reporter=reporter,
            verbose=verbose,
            # a trial's checkpoint (weights, optimizer, the stale queue) every `checkpoint_every`
            # iterations: an interrupted lab continues each unfinished trial from its last one
            checkpoint_config=tune.CheckpointConfig(
                checkpoint_frequency=space.checkpoint_every, num_to_keep=1, checkpoint_at_end=False
            ),
            # a trial that fails (its node lost, a runner's engine dead past restore) starts
            # again from that checkpoint, at most max_failures times
            failure_config=tune.FailureConfig(max_failures=space.max_failures),
        ),
    )
    return _finish(tuner.fit(), out_dir, report=report)


def _continue_lab(out_dir: Path, space: LabSpace, *, report: bool) -> int:
    """`m2po lab --out DIR` on an experiment that stopped (Ctrl-C, a lost machine): Tune's
    restore keeps the finished trials, continues the unfinished ones from their last
    checkpoint and starts those that never ran. The space must be the one it began with."""
    from ray import tune

    recorded = json.loads((out_dir / LAB_FILE).read_text()) if (out_dir / LAB_FILE).is_file() else {}
    labels = [t["label"] for t in recorded.get("trials", [])]
    if labels and labels != [t.label for t in space.trials]:
        raise ConfigError(
            f"--out {out_dir} holds an experiment of other trials ({len(labels)}: {', '.join(labels[:3])}, ...) "
            f"than {space.path} gives ({len(space.trials)}); continue it with the space it began with "
            f"({recorded.get('space')}), or choose another --out"
        )
    print(f"continuing the experiment in {out_dir} (finished trials are kept)")
    tuner = tune.Tuner.restore(str(out_dir), "M2PO", resume_unfinished=True, resume_errored=True)
    return _finish(tuner.fit(), out_dir, report=report)


def _finish(grid, out_dir: Path, *, report: bool) -> int:
    for r in grid:
        reason = (r.metrics or {}).get("collapse_reason")
        if reason:
            print(f"  collapsed: {Path(r.path).name}: {reason}")
    if grid.num_errors:
        print(f"  {grid.num_errors} trial(s) failed; see error.txt in their directories")
    if report:
        from m2po_rllib.jobs.report import write_report

        md = write_report([str(out_dir)], out=str(out_dir / "report"))
        print(f"report: {md}")
    return 1 if grid.num_errors else 0


def dry_run(space_path: str, overrides: list[str] | None = None, stop: list[str] | None = None) -> int:
    """Validate every trial and print the plan (no Ray, no GPU needed)."""
    space = load_space(space_path, overrides, stop)
    for i, trial in enumerate(space.trials):
        need = trial_resources(trial.config)
        gpus = f" {need['GPU']:g} GPU" if need["GPU"] else ""
        print(f"  {i:03d} {trial.label}  [{need['CPU']:g} CPU{gpus}]")
    print(f"{space.path}: {len(space.trials)} valid trials; stop at {space.stop}; scheduler {space.scheduler['type']}")
    return 0
