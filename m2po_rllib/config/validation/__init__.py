"""The checks `M2POConfig.validate()` runs, each a function of the config that returns its
problems: `(settings, message)`, the settings at fault and a message naming the value and
the fix. `validate()` runs them in stages (types first: RLlib's own checks fail with a
traceback on e.g. `lr="abc"`; shapes only once every value is in range) and raises one
`ConfigError` listing every problem of the first stage that has any.

problems.py: a problem, and the types (stage 1); values.py: each value on its own (stage 2),
the batch shapes (stage 3) and the notices; runners.py: the runners' side (an episode fits
the model, stage 3; weight sync, the rollout mode and its bound, GPUs, colocation and
streaming, stage 4).
"""

from __future__ import annotations

import logging

from m2po_rllib.common.errors import ConfigError
from m2po_rllib.config.validation.problems import Check, Problem, check_types, problem
from m2po_rllib.config.validation.runners import (
    check_colocate,
    check_engine_core,
    check_episode_budget,
    check_gpu_requests,
    check_rollout_mode,
    check_streaming,
    check_weight_sync,
)
from m2po_rllib.config.validation.values import (
    MODEL_DTYPES,
    check_batch_shapes,
    check_correction,
    check_evaluation,
    check_loss,
    check_model_and_env,
    check_optimization,
    check_sampling,
    env_id_error,
    notices,
)

# Stages after RLlib's own `validate()`: a later stage assumes the earlier ones passed.
STAGES: tuple[tuple[Check, ...], ...] = (
    (check_loss, check_correction, check_optimization, check_sampling, check_model_and_env, check_evaluation),
    (check_batch_shapes, check_episode_budget),
    (check_rollout_mode, check_weight_sync, check_gpu_requests, check_engine_core, check_colocate,
     check_streaming),
)

logger = logging.getLogger(__name__)
_NOTICED: set[str] = set()


def raise_problems(problems: list[Problem]) -> None:
    """One `ConfigError` naming every problem's settings and listing their messages; nothing
    when there is none."""
    if not problems:
        return
    settings = tuple(dict.fromkeys(name for names, _ in problems for name in names))
    messages = [message for _, message in problems]
    if len(messages) == 1:
        raise ConfigError(f"Invalid M2POConfig: {messages[0]}", settings)
    raise ConfigError("Invalid M2POConfig:\n  - " + "\n  - ".join(messages), settings)


def log_notices(config) -> None:
    """Logs each of `notices(config)` once per process (`validate()` runs on every copy of a
    config)."""
    for notice in notices(config):
        if notice not in _NOTICED:
            _NOTICED.add(notice)
            logger.warning(notice)


__all__ = ["STAGES", "Check", "Problem", "problem", "check_types", "notices", "env_id_error", "MODEL_DTYPES",
           "raise_problems", "log_notices"]
