"""Filters for third-party log lines that fire on every run and ask nothing of the user.

Each filter drops one exact message, where it is logged, and nothing else; the causes
are in the libraries (explained per function), not in how this package calls them.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
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


# vLLM's logging for the engines of this package: its own handler and format, at WARNING,
# with `VLLMAdvisories` on the handler. A dictConfig file, because vLLM applies it itself in
# each process of an engine (the engine core and its workers are processes of their own,
# where a filter added in this one would not reach).
VLLM_LOGGING_CONFIG = Path(__file__).resolve().parents[1] / "assets" / "vllm_logging.json"
# Where the user chose vLLM's logging; then it is left as they set it.
VLLM_LOGGING_SETTINGS = ("log_level", "logging_config", "log_config_file")
VLLM_LOGGING_ENV = ("VLLM_LOGGING_LEVEL", "VLLM_LOGGING_CONFIG_PATH", "VLLM_CONFIGURE_LOGGING")

# (logger, message start) of the warnings vLLM 0.32 logs at every engine start, in each of its
# processes, that ask nothing of this package's user:
# - eager mode: the engines run eager on CPU by design (`VLLMEngine`'s `enforce_eager`), and on
#   GPU only when asked; vLLM restates the setting, then that Inductor is therefore off;
# - Triton: vLLM's CPU wheel comes without triton-cpu, so on CPU it says so and that it uses
#   its V1 model runner, which is the one that serves CPU;
# - LD_PRELOAD: tcmalloc / Intel OpenMP speed up CPU serving of large models; the CPU jobs
#   here serve tiny models.
# - chunked prefill: on CPU `VLLMEngine` turns it off (rollout/vllm_cpu.py: vLLM's CPU worker
#   crashes a seeded request split across steps); vLLM then warns that the model does not
#   "officially" support it off, and the tests with vLLM runners check the engine's log-probs
#   against the learner's with it off.
VLLM_ADVISORIES = (
    ("vllm.config.vllm", "Enforce eager set, disabling torch.compile"),
    ("vllm.config.vllm", "Inductor compilation was disabled by user settings"),
    ("vllm.config.vllm", "Model Runner V2 requires Triton; using the V1 model runner"),
    ("vllm.platforms.cpu", "Triton is not installed. triton-cpu is expected on x86 CPUs."),
    ("vllm.v1.worker.cpu_worker", "%s is not found in LD_PRELOAD."),
    ("vllm.engine.arg_utils", "This model does not officially support disabling chunked prefill."),
)


class VLLMAdvisories(logging.Filter):
    """Drops the warnings of `VLLM_ADVISORIES` (matched on the unformatted message)."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = str(record.msg)
        return not any(record.name == name and msg.startswith(start) for name, start in VLLM_ADVISORIES)


def quiet_vllm_logging(llm_kwargs: dict, environ=os.environ) -> dict:
    """`llm_kwargs` for `vllm.LLM` with vLLM's logging at WARNING, minus `VLLM_ADVISORIES`:
    at INFO an engine start prints ~60 lines of configuration among the job's own. Left as
    it is when the user chose vLLM's logging: a `log_level` / `logging_config` /
    `log_config_file` in `llm_kwargs` (`engine_kwargs: {log_level: INFO}`), or one of
    VLLM_LOGGING_LEVEL, VLLM_LOGGING_CONFIG_PATH, VLLM_CONFIGURE_LOGGING in the environment."""
    if any(k in llm_kwargs for k in VLLM_LOGGING_SETTINGS) or any(v in environ for v in VLLM_LOGGING_ENV):
        return llm_kwargs
    from vllm.config.logging import LoggingConfig

    return {**llm_kwargs, "logging_config": LoggingConfig(pylogging_config_file=str(VLLM_LOGGING_CONFIG))}
