"""The main job behind `m2po train` / `m2po eval`: RLlib's algorithm in a plain loop with a
progress bar, TensorBoard scalars, checkpoints, a resumable run directory and a summary."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from m2po_rllib.common import durable, keys
from m2po_rllib.common.errors import ConfigError
from m2po_rllib.driver.resources import check_local_learner_gpus, describe_placement, node_names, placement
from m2po_rllib.jobs import run_dir as runs
from m2po_rllib.jobs.ctrl_c import CtrlC
from m2po_rllib.jobs.history import history_record, tensorboard_scalars
from m2po_rllib.jobs.local_ray import init_ray, quiet_job_logs

EVAL_ACC = keys.EVAL_ACCURACY_PATH
logger = logging.getLogger(__name__)


def _get(result: dict, path: tuple, default=None):
    """result[path[0]][path[1]]...; `default` when missing or NaN (RLlib reports NaN for
    metrics not logged this iteration, e.g. evaluation between intervals)."""
    node = result
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return default
        node = node[key]
    if isinstance(node, float) and math.isnan(node):
        return default
    return node


def _progress_line(result: dict, last_eval: float | None) -> dict[str, str]:
    fields = {
        "reward": _get(result, keys.runner(keys.REWARD_MEAN)),
        "heldout": last_eval,
        "masked": _get(result, keys.learner(keys.MASKED_FRAC)),
        "clipped": next((v for p in keys.CLIPPED_FRAC_PATHS if (v := _get(result, p)) is not None), None),
        "stale": result.get(keys.STALENESS_MEAN),
        "tok/s": _get(result, keys.runner(keys.TOKENS_PER_S)),
    }
    out = {}
    for k, v in fields.items():
        if v is None:
            continue
        out[k] = f"{v:.0f}" if k in ("tok/s", "stale") else (f"{v:.2%}" if k in ("masked", "clipped") else f"{v:.3f}")
    if result.get(keys.FILLING):
        out["queue"] = f"filling {int(result.get(keys.QUEUE_LEN, 0))}"
    return out


def run_training(
    *,
    config_path: str | None,
    overrides: list[str] | None = None,
    stop_iters: int | None = None,
    stop_minutes: float | None = None,
    output: str | None = None,
    resume: str | None = None,
    checkpoint_every: int | None = None,
    progress: bool = True,
) -> int:
    quiet_job_logs()
    overrides = list(overrides or [])
    changes: dict = {}
    if resume:
        if config_path:
            raise ConfigError("--config and --resume exclude each other: a resumed run keeps its config (change settings with overrides)")
        run_dir, meta, run, config, changes = runs.resume_run(resume, overrides)
    else:
        run_dir, meta, run, config = runs.new_run(config_path, overrides, output)
    for key, value in (("stop_iters", stop_iters), ("stop_minutes", stop_minutes), ("checkpoint_every", checkpoint_every)):
        if value is not None:
            run[key] = value
    check_local_learner_gpus(config)  # before Ray starts or a run directory is made (build checks it too)
    created = not run_dir.exists()
    if not resume:
        run_dir.mkdir(parents=True, exist_ok=True)
        runs.write_meta(run_dir, meta)
    try:
        init_ray(worker_logs=max(config.num_env_runners, config.num_learners, config.evaluation_num_env_runners) > 0)
        algo = runs.restore(run_dir, config, changes) if resume else config.build_algo()
    except BaseException as e:
        # Nothing was trained: a new run leaves no directory behind.
        if created:
            shutil.rmtree(run_dir, ignore_errors=True)
        if isinstance(e, KeyboardInterrupt):
            print("\ninterrupted before training started; nothing to save", file=sys.stderr)
            return 130
        raise
    try:
        with CtrlC() as ctrl_c:
            return _train(algo, run_dir, run, ctrl_c, progress=progress, resumed=(meta, changes, overrides) if resume else None)
    except BaseException:
        trained = algo.iteration > 0
        with contextlib.suppress(Exception):
            algo.stop()
        # A new run that failed before it trained an iteration leaves nothing behind.
        if created and not trained and not runs.has_checkpoint(run_dir):
            shutil.rmtree(run_dir, ignore_errors=True)
        raise


def _print_header(algo, run_dir: Path, run: dict) -> None:
    cfg = algo.config
    print(f"run directory: {run_dir}")
    print(f"  TensorBoard: tensorboard --logdir {run_dir / 'tensorboard'}")
    print(f"  checkpoint:  {run_dir / 'checkpoint'} (every {run['checkpoint_every']} iterations and at the end)")
    print(
        f"  {cfg.policy_loss} | staleness {cfg.staleness} updates | {cfg.prompts_per_step} prompts x "
        f"{cfg.group_size} samples | {cfg.updates_per_step} updates/step | engine "
        f"{cfg.resolved_rollout_engine()} | model {cfg.model_config.get('model')}",
        flush=True,
    )
    nodes = node_names()
    if len(nodes) > 1:  # a cluster: where the actors landed
        print(f"  nodes: {describe_placement(placement(algo), nodes)}", flush=True)


def _train(algo, run_dir: Path, run: dict, ctrl_c: CtrlC, *, progress: bool, resumed) -> int:
    """The loop; `resumed` is (run.json contents, changed settings, overrides) or None."""
    ckpt_dir = run_dir / "checkpoint"
    history_path = run_dir / "history.json"
    summary_path = run_dir / "summary.json"
    history: list[dict] = json.loads(history_path.read_text()) if resumed and history_path.exists() else []
    # The record is written with every checkpoint, so after a crash it matches the
    # checkpoint; iterations after it (redone now) are dropped.
    history = [h for h in history if h["iteration"] <= algo.iteration]
    summary = json.loads(summary_path.read_text()) if resumed and summary_path.exists() else {}
    cfg = algo.config
    t_start = time.perf_counter()
    elapsed_before = float(summary.get("train_seconds", 0.0))
    tb = bar = None

    def seconds() -> float:
        return elapsed_before + time.perf_counter() - t_start

    def save() -> None:
        """The record so far (history and summary), then the checkpoint. In this order a kill
        between the two leaves a record ahead of the checkpoint, which a resume cuts back to
        it; the other order would lose the rows after the previous save."""
        summary.update(_summary_fields(algo, history, seconds(), run_dir, interrupted=ctrl_c.requested))
        _write_json(history_path, history, indent=1)
        _write_json(summary_path, summary, indent=2)
        algo.save_to_path(str(ckpt_dir))

    try:
        if resumed:
            meta, changes, overrides = resumed
            print(f"resumed {run_dir} at iteration {algo.iteration}")
            for key, (old, new) in changes.items():
                print(f"  {key}: {old} -> {new}")
            if changes:
                meta.setdefault("resumes", []).append({"iteration": algo.iteration, "overrides": overrides})
            runs.write_meta(run_dir, meta)
        from torch.utils.tensorboard import SummaryWriter

        tb = SummaryWriter(str(run_dir / "tensorboard"))
        _print_header(algo, run_dir, run)
        if (
            "start_heldout_accuracy" not in summary
            and algo.iteration == 0
            and run.get("eval_at_start")
            and cfg.evaluation_interval
        ):
            print("evaluating held-out accuracy before training (Ctrl-C saves a checkpoint)...", flush=True)
            summary["start_heldout_accuracy"] = _get({"evaluation": algo.evaluate()}, EVAL_ACC)
            print(f"held-out accuracy before training: {summary['start_heldout_accuracy']:.3f}", flush=True)
        last_eval = summary.get("end_heldout_accuracy", summary.get("start_heldout_accuracy"))
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=run["stop_iters"], initial=algo.iteration, unit="it", dynamic_ncols=True)
        while algo.iteration < run["stop_iters"] and not ctrl_c.requested:
            with ctrl_c.step():
                result = algo.train()
            last_eval = _log_iteration(
                result, algo.iteration, history, tb, bar, last_eval, seconds(),
                tb_all=run["tensorboard"] == "all",
            )
            if run["checkpoint_every"] and algo.iteration % run["checkpoint_every"] == 0:
                with ctrl_c.step():
                    save()
            minutes = seconds() / 60
            if run.get("stop_minutes") and minutes >= run["stop_minutes"]:
                print(f"\nstopping: {minutes:.1f} min >= stop_minutes={run['stop_minutes']}")
                break
        if bar is not None:
            bar.close()
            bar = None
        with ctrl_c.step():
            save()
        if not ctrl_c.requested and cfg.evaluation_interval:
            summary["end_heldout_accuracy"] = _get({"evaluation": algo.evaluate()}, EVAL_ACC)
    except KeyboardInterrupt:
        if bar is not None:
            bar.close()
        if ctrl_c.abandoned:
            print("\nquit without saving the interrupted iteration", file=sys.stderr)
        else:
            with ctrl_c.step():
                save()
    _write_json(history_path, history, indent=1)
    interrupted = ctrl_c.requested
    if interrupted and runs.has_checkpoint(run_dir):
        saved = "the last checkpoint is" if ctrl_c.abandoned else "checkpoint saved"
        print(f"\ninterrupted: {saved} in {ckpt_dir}; continue with `m2po train --resume {run_dir}`")
    elif interrupted:
        print(f"\ninterrupted: no checkpoint was saved in {run_dir}", file=sys.stderr)

    summary.update(_summary_fields(algo, history, seconds(), run_dir, interrupted=interrupted))
    summary["final_heldout_accuracy"] = _final_heldout(algo.config, run_dir, history, summary)
    _write_json(summary_path, summary, indent=2)
    algo.stop()
    if tb is not None:
        tb.close()
    _print_summary(summary)
    print(f"summary written to {summary_path}")
    return 130 if interrupted else 0


def _summary_fields(algo, history: list[dict], seconds: float, run_dir: Path, *, interrupted: bool) -> dict:
    cfg = algo.config
    fields = {
        "iterations": algo.iteration,
        keys.POLICY_VERSION: algo.policy_version,
        "train_seconds": round(seconds, 1),
        "policy_loss": cfg.policy_loss,
        "staleness": cfg.staleness,
        "final_train_reward": next((h["reward"] for h in reversed(history) if h["reward"] is not None), None),
        "run_dir": str(run_dir),
        "interrupted": interrupted,
        "placement": _placement(algo),
    }
    tok = [h.get("tokens_per_s") for h in history if h.get("tokens_per_s")]
    if tok:
        fields["rollout_tokens_per_s"] = sum(tok) / len(tok)
    return fields


def _placement(algo) -> dict | None:
    """Where the actors run now (resources.placement); None if a runner fails while asked:
    the record is written regardless."""
    try:
        return placement(algo)
    except Exception as e:
        logger.debug("placement not recorded: %s", e)
        return None


def _final_heldout(cfg, run_dir: Path, history: list[dict], summary: dict) -> float | None:
    """The run's final held-out accuracy as `m2po report` defines it: the mean of its last
    `runs.LAST_K` evaluations (one definition for the summary and the report)."""
    from m2po_rllib.jobs.runs import train_run

    return train_run(run_dir, {"evaluation_interval": cfg.evaluation_interval}, history, summary).final


def _write_json(path: Path, value, indent: int) -> None:
    """Whole or not at all: a crash mid-write leaves the previous file."""
    durable.write_json(path, value, indent=indent)


def _log_iteration(result: dict, it: int, history: list, tb, bar, last_eval, time_s: float, tb_all: bool = False):
    """History row, TensorBoard scalars and the progress line of one iteration; returns
    the latest held-out accuracy."""
    last_eval = _get(result, EVAL_ACC, last_eval)
    record = history_record(result, it, time_s)
    history.append(record)
    for key, value in tensorboard_scalars(result, everything=tb_all).items():
        tb.add_scalar(key, value, it)
    line = _progress_line(result, last_eval)
    if bar is not None:
        bar.set_postfix(line, refresh=False)
        bar.update(1)
    else:
        print(f"iter {it}: " + " ".join(f"{k}={v}" for k, v in line.items()), flush=True)
    return last_eval


def _print_summary(summary: dict[str, Any]) -> None:
    from m2po_rllib.jobs.runs import LAST_K

    start, end = summary.get("start_heldout_accuracy"), summary.get("end_heldout_accuracy")
    rows = [
        ("held-out accuracy (start)", f"{start:.3f}" if start is not None else "-"),
        ("held-out accuracy (end)", f"{end:.3f}" if end is not None else "-"),
        (f"held-out (mean of last {LAST_K})", f"{final:.3f}" if (final := summary.get("final_heldout_accuracy")) is not None else "-"),
        ("change (points)", f"{100 * (end - start):+.1f}" if start is not None and end is not None else "-"),
        ("iterations", str(summary.get("iterations"))),
        ("optimizer updates", str(summary.get(keys.POLICY_VERSION))),
        ("rollout tokens/s", f"{summary['rollout_tokens_per_s']:.0f}" if summary.get("rollout_tokens_per_s") else "-"),
        ("wall-clock time", f"{summary.get('train_seconds', 0) / 60:.1f} min"),
    ]
    width = max(len(r[0]) for r in rows)
    print("\n" + "-" * (width + 14))
    for k, v in rows:
        print(f"{k:<{width}}  {v:>10}")
    print("-" * (width + 14))


def run_eval(
    *,
    checkpoint: str | None,
    model: str | None,
    config_path: str | None,
    overrides: list[str] | None,
    split: str,
    num: int | None,
    samples: int,
) -> int:
    import tempfile

    from m2po_rllib.config.algorithm_config import M2POConfig
    from m2po_rllib.config.from_yaml import apply_overrides, load_spec
    from m2po_rllib.jobs.export import export_checkpoint
    from m2po_rllib.rollout.env_runner import LLMEnvRunner

    quiet_job_logs()
    if config_path:
        spec = load_spec(config_path)
    elif checkpoint and (Path(checkpoint) / "run.json").exists():
        spec = json.loads((Path(checkpoint) / "run.json").read_text())["spec"]
    else:
        spec = load_spec(runs.default_config_path())
    spec = apply_overrides(spec, overrides or [])
    spec.pop("run", None)
    with tempfile.TemporaryDirectory() as tmp:
        model_path = export_checkpoint(checkpoint, tmp) if checkpoint else model
        spec.setdefault("rl_module", {}).setdefault("model_config", {})["model"] = model_path
        config = M2POConfig.from_spec(spec)
        runner = LLMEnvRunner(config=config)
        try:
            n = num or int(config.evaluation_duration)
            size = runner.num_problems(split)
            if size is not None and size < n:
                has, evaluating = ("1 problem", "it") if size == 1 else (f"{size} problems", f"all {size}")
                print(f"the {split} split has {has}, fewer than {n}: evaluating {evaluating}", file=sys.stderr)
                n = size
            counts = runner.evaluate(indices=list(range(n)), samples=samples, seed=0, split=split)
        finally:
            runner.stop()
    result = {
        "source": checkpoint or model,
        "split": split,
        "problems": counts["n"],
        "greedy_accuracy": counts["greedy_correct"] / max(1, counts["n"]),
    }
    if samples > 1:
        result[f"mean@{samples}"] = counts["sampled_correct"] / max(1, counts["sampled_n"])
    print(json.dumps(result, indent=2))
    return 0
