"""Filters for third-party log lines that fire on every run and ask nothing of the user.

Each filter drops one exact message, where it is logged, and nothing else; the causes
are in the libraries (explained per function), not in how this package calls them.
"""

from __future__ import annotations

import logging
from typing import Callable


class _Drop(logging.Filter):
    def __init__(self, name: str, matches: Callable[[logging.LogRecord], bool]):
        super().__init__()
        self.filter_name = name
        self.matches = matches

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.matches(record)


def _install(logger_name: str, name: str, matches: Callable[[logging.LogRecord], bool]) -> None:
    logger = logging.getLogger(logger_name)
    if not any(getattr(f, "filter_name", None) == name for f in logger.filters):
        logger.addFilter(_Drop(name, matches))


def quiet_rllib_module_config_deprecation() -> None:
    """RLlib 2.60's own `RLModule.__init__` builds the deprecated `RLModuleConfig` for every
    module (`self.config = RLModuleConfig(...)`, rl_module.py), so each process that builds
    one logs "`RLModule(config=[RLModuleConfig object])` has been deprecated" whatever the
    caller passes (RLlib's own PPO modules included)."""
    _install(
        "ray._common.deprecation",
        "m2po:rlmodule-config",
        lambda r: "RLModule(config=[RLModuleConfig object])" in r.getMessage(),
    )


def quiet_vllm_rotary_reload() -> None:
    """vLLM's layerwise reload counts every buffer of a layer as a weight to load, so a
    rotary embedding, whose only tensor is its derived `cos_sin_cache` (never part of a
    checkpoint), is reported as "RotaryEmbedding: Failed to load weights" on every reload;
    vLLM then puts the same cache back, which is right. Other layers still warn."""
    _install(
        "vllm.model_executor.model_loader.reload.layerwise",
        "m2po:rotary-reload",
        lambda r: r.msg == "%s: Failed to load weights"
        and bool(r.args)
        and str(r.args[0]).endswith("RotaryEmbedding"),
    )


def quiet_gputil_hint_without_gpus() -> None:
    """Every Ray Tune `Trainable` (an RLlib `Algorithm` is one) starts a system-usage monitor
    that logs "Install gputil for GPU system monitoring." when GPUtil is missing, also on a
    machine without GPUs, where there is nothing for it to monitor. Dropped only there."""
    import torch

    if torch.cuda.is_available():
        return
    _install(
        "ray.tune.utils.util",
        "m2po:gputil-hint",
        lambda r: r.getMessage() == "Install gputil for GPU system monitoring.",
    )


def quiet_rllib_new_api_stack_notice() -> None:
    """RLlib 2.60's `AlgorithmConfig.validate()` logs "You are running M2PO on the new API
    stack! This is the new default behavior ... If you don't want to use the new API stack,
    set `config.api_stack(...=False)`" on every build, whatever the config says. M2PO runs
    on the new API stack only (its Learner, RLModule and EnvRunner are new-stack classes), so
    the advice cannot be taken: dropped for M2PO, kept for any other algorithm."""
    _install(
        "ray.rllib.algorithms.algorithm_config",
        "m2po:new-api-stack",
        lambda r: r.getMessage().startswith("You are running M2PO on the new API stack!"),
    )
