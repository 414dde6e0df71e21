"""The main job behind `m2po train` / `m2po eval`: RLlib's algorithm in a plain loop with a
progress bar, TensorBoard scalars, checkpoints, a resumable run directory and a summary."""

from __future__ import annotations

import json
import logging
import math
import signal
import time
from pathlib import Path
from typing import Any

from m2po_rllib.metrics import history_record

# Keys shown on the progress line and in the summary.
EVAL_ACC = ("evaluation", "env_runners", "eval/accuracy")
REWARD = ("env_runners", "rollout/reward_mean")
TRAIN_ACC = ("env_runners", "rollout/accuracy")
TOKENS_PER_S = ("env_runners", "rollout/tokens_per_s")
MASKED = ("learners", "default_policy", "m2po/masked_frac")
CLIPPED_KEYS = ("grpo/clipped_frac", "gspo/clipped_frac", "m2po/clipped_frac")

RUN_DEFAULTS = {"stop_iters": 100, "stop_minutes": None, "checkpoint_every": 10, "eval_at_start": True}


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


def _flatten(result: dict, prefix: str = "") -> dict[str, float]:
    out = {}
    for key, value in result.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flatten(value, name + "/"))
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            out[name] = float(value)
    return out


def _quiet() -> None:
    """Keep the job's output readable: RLlib's API-stack notices and transformers' weight
    loading bars say nothing actionable here. Errors still show."""
    logging.getLogger("ray.rllib").setLevel(logging.ERROR)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:
        pass


def _init_ray():
    import ray

    if not ray.is_initialized():
        # Under `ray job submit` (RAY_ADDRESS set) this joins the cluster; else a local Ray.
        ray.init(include_dashboard=False, logging_level=logging.WARNING, ignore_reinit_error=True)


def _progress_line(result: dict, last_eval: float | None) -> dict[str, str]:
    learners = _get(result, ("learners", "default_policy"), {}) or {}
    masked = learners.get("m2po/masked_frac")
    clipped = next((learners[k] for k in CLIPPED_KEYS if k in learners), None)
    fields = {
        "reward": _get(result, REWARD),
        "heldout": last_eval,
        "masked": masked,
        "clipped": clipped,
        "stale": result.get("staleness/mean"),
        "tok/s": _get(result, TOKENS_PER_S),
    }
    out = {}
    for k, v in fields.items():
        if v is None:
            continue
        out[k] = f"{v:.0f}" if k in ("tok/s", "stale") else (f"{v:.2%}" if k in ("masked", "clipped") else f"{v:.3f}")
    if result.get("staleness/filling"):
        out["queue"] = f"filling {int(result.get('staleness/queue_len', 0))}"
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
    from m2po_rllib.config_io import apply_overrides, config_from_spec, load_spec
    from m2po_rllib.m2po import M2PO

    _quiet()
    if resume:
        run_dir = Path(resume).resolve()
        meta_path = run_dir / "run.json"
        if not meta_path.exists():
            raise FileNotFoundError(f"{meta_path} is missing: --resume takes a run directory of `m2po train`")
        meta = json.loads(meta_path.read_text())
        run = meta["run"]
    else:
        spec = apply_overrides(load_spec(config_path), overrides or [])
        run = {**RUN_DEFAULTS, **(spec.pop("run", None) or {})}
        unknown = set(run) - set(RUN_DEFAULTS)
        if unknown:
            raise ValueError(f"unknown `run` settings {sorted(unknown)}; valid: {sorted(RUN_DEFAULTS)}")
        config = config_from_spec(spec)
        config.validate()
        name = Path(config_path).stem
        # Absolute: RLlib's save_to_path reads a relative path as a URI without a scheme.
        run_dir = Path(output or Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
        run_dir.mkdir(parents=True, exist_ok=True)
        meta = {"config_path": str(config_path), "overrides": list(overrides or []), "spec": spec, "run": run}
        (run_dir / "run.json").write_text(json.dumps(meta, indent=2, default=str))
    if stop_iters is not None:
        run["stop_iters"] = stop_iters
    if stop_minutes is not None:
        run["stop_minutes"] = stop_minutes
    if checkpoint_every is not None:
        run["checkpoint_every"] = checkpoint_every

    _init_ray()
    ckpt_dir = run_dir / "checkpoint"
    history_path = run_dir / "history.json"
    history: list[dict] = json.loads(history_path.read_text()) if resume and history_path.exists() else []
    if resume:
        algo = M2PO.from_checkpoint(str(ckpt_dir))
        print(f"resumed {run_dir} at iteration {algo.iteration}")
    else:
        algo = config.build_algo()

    from torch.utils.tensorboard import SummaryWriter

    tb = SummaryWriter(str(run_dir / "tensorboard"))
    print(f"run directory: {run_dir}")
    print(f"  TensorBoard: tensorboard --logdir {run_dir / 'tensorboard'}")
    print(f"  checkpoint:  {ckpt_dir} (every {run['checkpoint_every']} iterations and at the end)")
    cfg = algo.config
    print(
        f"  {cfg.policy_loss} | staleness {cfg.staleness} updates | {cfg.prompts_per_step} prompts x "
        f"{cfg.group_size} samples | {cfg.updates_per_step} updates/step | engine "
        f"{cfg.resolved_rollout_engine()} | model {cfg.model_config.get('model')}"
    )

    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if resume and summary_path.exists() else {}
    t_start = time.perf_counter()
    elapsed_before = float(summary.get("train_seconds", 0.0))
    if "start_heldout_accuracy" not in summary and run.get("eval_at_start") and cfg.evaluation_interval:
        summary["start_heldout_accuracy"] = _get({"evaluation": algo.evaluate()}, EVAL_ACC)
        print(f"held-out accuracy before training: {summary['start_heldout_accuracy']:.3f}")
    last_eval = summary.get("end_heldout_accuracy", summary.get("start_heldout_accuracy"))

    interrupted = False

    def _stop(signum, frame):
        nonlocal interrupted
        interrupted = True

    previous = signal.signal(signal.SIGINT, _stop)
    bar = None
    try:
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=run["stop_iters"], initial=algo.iteration, unit="it", dynamic_ncols=True)
        while algo.iteration < run["stop_iters"] and not interrupted:
            result = algo.train()
            it = algo.iteration
            last_eval = _get(result, EVAL_ACC, last_eval)
            scalars = _flatten(result)
            for key, value in scalars.items():
                tb.add_scalar(key, value, it)
            history.append(history_record(result, it, elapsed_before + time.perf_counter() - t_start))
            line = _progress_line(result, last_eval)
            if bar is not None:
                bar.set_postfix(line, refresh=False)
                bar.update(1)
            else:
                print(f"iter {it}: " + " ".join(f"{k}={v}" for k, v in line.items()), flush=True)
            if run["checkpoint_every"] and it % run["checkpoint_every"] == 0:
                algo.save_to_path(str(ckpt_dir))
            minutes = (elapsed_before + time.perf_counter() - t_start) / 60
            if run.get("stop_minutes") and minutes >= run["stop_minutes"]:
                print(f"\nstopping: {minutes:.1f} min >= stop_minutes={run['stop_minutes']}")
                break
    finally:
        signal.signal(signal.SIGINT, previous)
        if bar is not None:
            bar.close()
        algo.save_to_path(str(ckpt_dir))
        history_path.write_text(json.dumps(history, indent=1))
    if interrupted:
        print(f"\ninterrupted: checkpoint saved to {ckpt_dir}; continue with `m2po train --resume {run_dir}`")

    train_seconds = elapsed_before + time.perf_counter() - t_start
    if not interrupted and cfg.evaluation_interval:
        summary["end_heldout_accuracy"] = _get({"evaluation": algo.evaluate()}, EVAL_ACC)
    summary.update(
        {
            "iterations": algo.iteration,
            "policy_version": algo.policy_version,
            "train_seconds": round(train_seconds, 1),
            "policy_loss": cfg.policy_loss,
            "staleness": cfg.staleness,
            "final_train_reward": next((h["reward"] for h in reversed(history) if h["reward"] is not None), None),
            "run_dir": str(run_dir),
            "interrupted": interrupted,
        }
    )
    tok = [h.get("tokens_per_s") for h in history if h.get("tokens_per_s")]
    if tok:
        summary["rollout_tokens_per_s"] = sum(tok) / len(tok)
    summary_path.write_text(json.dumps(summary, indent=2))
    algo.stop()
    tb.close()
    _print_summary(summary)
    print(f"summary written to {summary_path}")
    return 130 if interrupted else 0


def _print_summary(summary: dict[str, Any]) -> None:
    start, end = summary.get("start_heldout_accuracy"), summary.get("end_heldout_accuracy")
    rows = [
        ("held-out accuracy (start)", f"{start:.3f}" if start is not None else "-"),
        ("held-out accuracy (end)", f"{end:.3f}" if end is not None else "-"),
        ("change (points)", f"{100 * (end - start):+.1f}" if start is not None and end is not None else "-"),
        ("iterations", str(summary.get("iterations"))),
        ("optimizer updates", str(summary.get("policy_version"))),
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

    from m2po_rllib.cli import _default_config_path
    from m2po_rllib.config_io import apply_overrides, config_from_spec, load_spec
    from m2po_rllib.export import export_checkpoint
    from m2po_rllib.rollout.env_runner import LLMEnvRunner

    _quiet()
    if config_path:
        spec = load_spec(config_path)
    elif checkpoint and (Path(checkpoint) / "run.json").exists():
        spec = json.loads((Path(checkpoint) / "run.json").read_text())["spec"]
    else:
        spec = load_spec(_default_config_path())
    spec = apply_overrides(spec, overrides or [])
    spec.pop("run", None)
    with tempfile.TemporaryDirectory() as tmp:
        model_path = export_checkpoint(checkpoint, tmp) if checkpoint else model
        spec.setdefault("rl_module", {}).setdefault("model_config", {})["model"] = model_path
        config = config_from_spec(spec)
        runner = LLMEnvRunner(config=config)
        try:
            n = num or int(config.evaluation_duration)
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
