"""The run directory of `m2po train`: starting one, and resuming one with the overrides
that are safe to change mid-run.

A run directory holds `run.json` (the config spec, the job's `run` settings, and every
override applied, at the start and on each resume), `checkpoint/`, `tensorboard/`,
`history.json` and `summary.json`.
"""

from __future__ import annotations

import difflib
import json
import os
import shlex
import time
from pathlib import Path
from typing import Any

from m2po_rllib.config.from_yaml import (
    JOB_SECTION,
    apply_overrides,
    load_spec,
    parse_override,
)
from m2po_rllib.common import durable
from m2po_rllib.common.errors import ConfigError
from m2po_rllib.driver import checkpoints

# tensorboard: "default" writes the history record's fields, the timers and the pace
# metrics (~40 scalars); "all" every number of the result (~200).
RUN_DEFAULTS = {
    "stop_iters": 100, "stop_minutes": None, "checkpoint_every": 10, "eval_at_start": True, "tensorboard": "default",
}

# What `m2po train --resume DIR section.key=value` may change, and why that is safe
# mid-run. Anything else is refused: the checkpoint's stale queue, optimizer state or
# sampler were made for the old value. Not safe, for instance: `env_runners.temperature`
# (the queued rollouts' behaviour log-probs were taken at the old temperature, the
# learner would score them at the new one), `training.staleness` / `group_size` /
# `prompts_per_step` / `minibatch_prompts` / `policy_loss` (the queue's shape and version
# tags), `training.weight_decay` / `adam_betas` (restored from the optimizer state, so
# they would silently not change).
RESUME_SAFE = {
    f"{JOB_SECTION}.*": "the job's own loop settings, not the algorithm",
    "training.lr": "the optimizer's step size; its moment estimates stay valid",
    "training.grad_clip": "read afresh at every update",
    "training.logp_mismatch_interval": "a diagnostic; training does not read it",
    "evaluation.evaluation_interval": "when held-out accuracy is measured; training does not read it",
    "evaluation.evaluation_duration": "how many held-out problems are measured",
    "evaluation.eval_samples": "k of the held-out mean@k",
    "training.micro_batch_size": "how a minibatch is split for memory; the gradient is the same",
    "training.logp_chunk_size": "memory of the log-prob computation; the values are the same",
}

CHECKPOINT = "checkpoint"
DEFAULT_CONFIG = "configs/default.yaml"  # the main job's, relative to the checkout


def default_config_path() -> str:
    """configs/default.yaml in the checkout, else the copy shipped inside the package."""
    if os.path.exists(DEFAULT_CONFIG):
        return DEFAULT_CONFIG
    from importlib import resources

    return str(resources.files("m2po_rllib") / "configs" / "default.yaml")

def _config(spec: dict):
    from m2po_rllib.config.algorithm_config import M2POConfig  # here, so that `m2po --help` does not import Ray

    return M2POConfig.from_spec(spec)


def has_checkpoint(run_dir: Path) -> bool:
    """A complete checkpoint to resume from: the run's, or the one a killed save left beside it."""
    return checkpoints.newest(run_dir / CHECKPOINT) is not None


def _check_run_settings(run: dict) -> None:
    for key in run:
        if key not in RUN_DEFAULTS:
            close = difflib.get_close_matches(key, list(RUN_DEFAULTS), n=1, cutoff=0.6)
            hint = f"did you mean `{close[0]}`?" if close else f"valid: {', '.join(RUN_DEFAULTS)}"
            raise ConfigError(f"unknown setting `{JOB_SECTION}.{key}`; {hint}")
    if run.get("tensorboard", "default") not in ("default", "all"):
        raise ConfigError(f"`{JOB_SECTION}.tensorboard` ({run['tensorboard']!r}) must be 'default' or 'all'")


def new_run(config_path: str, overrides: list[str], output: str | None):
    """(run_dir, meta, run settings, validated config) of a new run; nothing is written."""
    spec = apply_overrides(load_spec(config_path), overrides)
    run = {**RUN_DEFAULTS, **(spec.pop(JOB_SECTION, None) or {})}
    _check_run_settings(run)
    config = _config(spec)
    config.validate()
    check_model_loads(config)
    check_tasks(config)
    name = Path(config_path).stem
    # Absolute: RLlib's save_to_path reads a relative path as a URI without a scheme.
    run_dir = Path(output or Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    if has_checkpoint(run_dir):
        raise ConfigError(
            f"--output {run_dir} already holds a run with a checkpoint; continue it with "
            f"`m2po train --resume {run_dir}` or choose another --output"
        )
    meta = {"config_path": str(config_path), "overrides": list(overrides), "spec": spec, "run": run}
    return run_dir, meta, run, config


def check_model_loads(config) -> None:
    """The model can be loaded here (a hub name: cached, or the hub reachable), before a
    run directory is made or Ray started."""
    from m2po_rllib.models.builtin import resolve_model_path

    resolve_model_path(config.model_config["model"])


def check_tasks(config) -> None:
    """The env's training split has problems, and so has its held-out split when the run
    evaluates: refused here, before a run directory or Ray exists, not minutes into a run."""
    from transformers import AutoTokenizer

    from m2po_rllib.models.builtin import resolve_model_path
    from m2po_rllib.rollout.env_runner import make_text_env

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(config.model_config["model"]))
    splits = ("train", "heldout") if config.evaluation_interval else ("train",)
    for split in splits:
        try:
            n = make_text_env(config.env, config.env_config, tokenizer=tokenizer, split=split).unwrapped.num_problems
        except ValueError as e:  # the env's own check of its env_config (as the runner reports it)
            raise ConfigError(str(e), ("env_config",)) from e
        if n == 0:
            fix = (
                "add rows, or give the held-out problems their own file (env_config heldout_path) or a larger "
                "heldout_fraction, or turn evaluation off (evaluation.evaluation_interval: null)"
                if split == "heldout" else "add rows, or lower env_config heldout_fraction"
            )
            raise ConfigError(f"the {split} split of {config.env!r} holds no problems; {fix}", ("env_config",))


def write_meta(run_dir: Path, meta: dict) -> None:
    durable.write_json(run_dir / "run.json", meta, indent=2, default=str)


def resume_run(resume: str, overrides: list[str]):
    """(run_dir, meta, run settings, validated config, changes) to continue the run in
    `resume`, with `overrides` applied if each is in RESUME_SAFE. `changes` maps each
    changed setting to (old, new). Raises ValueError / FileNotFoundError with the fix."""
    run_dir = Path(resume).resolve()
    if not run_dir.is_dir():
        raise FileNotFoundError(f"--resume {run_dir}: no such directory; pass the directory a run was written to "
                                f"(its --output, by default runs/<config>-<time>; `ls runs/` lists them)")
    meta_path = run_dir / "run.json"
    if not meta_path.is_file():
        raise FileNotFoundError(f"--resume {run_dir}: not a run directory of `m2po train` (no run.json)")
    meta = json.loads(meta_path.read_text())
    if not has_checkpoint(run_dir):
        # The job's loop settings as flags (the command line may have set them), and quoted
        # for a POSIX shell: an override such as `environment.env_config={digits: 3}` must
        # come back as one argument when the line is pasted.
        flags = [
            arg for key in ("stop_iters", "stop_minutes", "checkpoint_every")
            if meta.get("run", {}).get(key) is not None
            for arg in (f"--{key.replace('_', '-')}", str(meta["run"][key]))
        ]
        again = shlex.join(
            ["m2po", "train", "--config", str(meta.get("config_path")), "--output", str(run_dir), *flags,
             *meta.get("overrides", [])]
        )
        raise FileNotFoundError(
            f"--resume {run_dir}: the run has no checkpoint yet (it stopped before saving one), "
            f"so there is nothing to resume; start it again with `{again}`"
        )
    items = [parse_override(o) for o in overrides]
    run = dict(meta["run"])
    _check_run_settings({k: v for s, k, v in items if s == JOB_SECTION})
    algo_overrides = [o for o, (s, _, _) in zip(overrides, items) if s != JOB_SECTION]
    spec = apply_overrides(meta["spec"], algo_overrides)
    old, config = _config(meta["spec"]), _config(spec)  # unknown keys raise here
    refused = sorted({f"{s}.{k}" for s, k, _ in items if s != JOB_SECTION and f"{s}.{k}" not in RESUME_SAFE})
    if refused:
        raise ConfigError(
            f"cannot change {', '.join(f'`{r}`' for r in refused)} when resuming: the checkpoint "
            f"was made for the old value. Settings that can change on --resume: "
            f"{', '.join(RESUME_SAFE)}; start a new run (--output) to change the others"
        )
    if "training.lr" in {f"{s}.{k}" for s, k, _ in items} and not isinstance(config.lr, (int, float)):
        raise ConfigError(f"`training.lr` ({config.lr!r}) must be a number when changed on --resume")
    config.validate()
    check_model_loads(config)
    changes: dict[str, tuple[Any, Any]] = {}
    for section, key, value in items:
        if section == JOB_SECTION:
            changes[f"{section}.{key}"] = (run.get(key), value)
            run[key] = value
        else:
            changes[f"{section}.{key}"] = (getattr(old, key), getattr(config, key))
    meta["spec"], meta["run"] = spec, run
    return run_dir, meta, run, config, changes


def restore(run_dir: Path, config, changes: dict):
    """The algorithm of `config` with the run's checkpoint loaded (see `resume_run`)."""
    algo = config.build_algo()
    algo.restore_from_path(str(run_dir / CHECKPOINT))  # the newest complete one (checkpoints.py)
    if "training.lr" in changes:
        _restart_lr(algo)
    return algo


def _restart_lr(algo) -> None:
    """Give every optimizer the config's `lr`: restoring the checkpoint loaded the old one,
    which RLlib would replace only after the first update."""
    from ray.rllib.core import DEFAULT_MODULE_ID

    def apply(learner):
        for _, optimizer in learner.get_optimizers_for_module(DEFAULT_MODULE_ID):
            for group in optimizer.param_groups:
                group["lr"] = float(learner.config.lr)

    algo.learner_group.foreach_learner(apply)
