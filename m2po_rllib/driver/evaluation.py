"""Held-out evaluation for M2PO, run through RLlib's `Algorithm.evaluate()` machinery
(`custom_evaluation_function`), on the training EnvRunners unless dedicated ones exist."""

from __future__ import annotations

import collections
import logging

from ray.rllib.utils.metrics import ENV_RUNNER_RESULTS, EVALUATION_RESULTS
from ray.rllib.utils.metrics.metrics_logger import MetricsLogger

from m2po_rllib.common.errors import ConfigError
from m2po_rllib.common.keys import EVAL_ACCURACY, EVAL_MEAN_AT_K, EVAL_PROBLEMS, EVAL_RESPONSE_LEN

logger = logging.getLogger(__name__)
_warned: set[tuple[int, int]] = set()  # (split size, evaluation_duration) already said


def heldout_problems(group, wanted: int) -> int:
    """`wanted` held-out problems, or as many as the split has (said once)."""
    if group.num_remote_env_runners() == 0:
        size = group.local_env_runner.num_problems("heldout")
    else:
        sizes = group.foreach_env_runner(lambda runner: runner.num_problems("heldout"), local_env_runner=False)
        size = sizes[0] if sizes else None  # no runner answered: the evaluation itself will say why
    if size is None or size >= wanted:
        return wanted
    if size == 0:
        raise ConfigError(
            "the env's held-out split is empty: nothing to evaluate; give it held-out problems (e.g. "
            "env_config heldout_fraction or heldout_path) or set evaluation_interval=0",
            ("evaluation_interval", "env_config"),
        )
    if (size, wanted) not in _warned:
        _warned.add((size, wanted))
        has, evaluating = ("1 problem", "it") if size == 1 else (f"{size} problems", f"all {size}")
        logger.warning("the held-out split has %s, fewer than evaluation_duration=%d: evaluating %s",
                       has, wanted, evaluating)
    return size


def evaluate_heldout(algo, eval_group) -> tuple[dict, int, int]:
    """RLlib custom evaluation function: greedy (and mean@k) accuracy on held-out problems,
    with the learners' current weights (they ride with the request)."""
    cfg = algo.config
    group = eval_group if eval_group is not None and eval_group.num_remote_env_runners() > 0 else algo.env_runner_group
    n = max(1, group.num_remote_env_runners())
    total = heldout_problems(group, int(cfg.evaluation_duration))
    shards = [list(range(i, total, n)) for i in range(n)]
    samples = cfg.eval_samples
    seed = (cfg.seed or 0) + 7_777
    weights = algo.learner_weights()

    if group.num_remote_env_runners() == 0:
        results = [group.local_env_runner.evaluate(indices=shards[0], samples=samples, seed=seed, weights=weights)]
    else:
        results = group.foreach_env_runner(
            lambda runner: runner.evaluate(
                indices=shards[(runner.worker_index - 1) % n], samples=samples, seed=seed, weights=weights
            ),
            local_env_runner=False,
        )
    counts = collections.Counter()
    for r in results:
        counts.update(r)
    accuracy = counts["greedy_correct"] / max(1, counts["n"])
    algo.record_heldout_accuracy(accuracy)
    logger_ = MetricsLogger(root=False)
    logger_.log_value(EVAL_ACCURACY, accuracy, window=1)
    logger_.log_value(EVAL_RESPONSE_LEN, counts["tokens"] / max(1, counts["n"]), window=1)
    if counts["sampled_n"]:
        logger_.log_value(EVAL_MEAN_AT_K, counts["sampled_correct"] / counts["sampled_n"], window=1)
    logger_.log_value(EVAL_PROBLEMS, counts["n"], window=1)
    algo.metrics.aggregate([logger_.reduce()], key=(EVALUATION_RESULTS, ENV_RUNNER_RESULTS))
    steps = int(counts["n"] + counts["sampled_n"])
    return {}, steps, steps
