"""Third-party log lines the package drops: only the one message, and only where it asks
nothing of the user."""

from __future__ import annotations

import logging

import pytest
import torch

HINT = "Install gputil for GPU system monitoring."


def _logged_by_util_monitor(logger: logging.Logger) -> list[str]:
    from ray.tune.utils.util import UtilMonitor

    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logger.addHandler(handler)
    try:
        monitor = UtilMonitor(start=True, delay=0.05)
        monitor.stop()
        logger.warning("another message")
    finally:
        logger.removeHandler(handler)
    return seen


def test_the_gputil_hint_is_dropped_only_on_a_machine_without_gpus(monkeypatch):
    """Every Algorithm (a Tune Trainable) starts Ray Tune's UtilMonitor, which asks for
    GPUtil even without GPUs. Without GPUs that one line is dropped (the logger's other
    messages still pass); with GPUs it is a real hint and stays."""
    from m2po_rllib.common.log_filters import quiet_gputil_hint_without_gpus

    logger = logging.getLogger("ray.tune.utils.util")
    monkeypatch.setattr(logger, "filters", [])  # as in a fresh process; restored afterwards

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    quiet_gputil_hint_without_gpus()
    seen = _logged_by_util_monitor(logger)
    assert HINT in seen and "another message" in seen

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    quiet_gputil_hint_without_gpus()
    seen = _logged_by_util_monitor(logger)
    assert HINT not in seen and "another message" in seen


def test_rllibs_new_api_stack_notice_is_dropped_for_m2po_only():
    """RLlib logs "You are running M2PO on the new API stack! ... set config.api_stack(...)"
    on every build; M2PO has no old stack to go back to, so that line (and only that one,
    for M2PO only) is dropped once the algorithm is imported."""
    import m2po_rllib.driver.m2po  # noqa: F401  (installs the filter)

    logger = logging.getLogger("ray.rllib.algorithms.algorithm_config")
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logger.addHandler(handler)
    try:
        for algo in ("M2PO", "PPO"):  # RLlib's own wording (algorithm_config.py)
            logger.warning(f"You are running {algo} on the new API stack! This is the new default behavior for "
                           "this algorithm.")
    finally:
        logger.removeHandler(handler)
    assert seen == ["You are running PPO on the new API stack! This is the new default behavior for this algorithm."]


def test_vllm_logs_warnings_only_and_not_its_advisories(monkeypatch):
    """An engine start at vLLM's INFO prints ~60 lines among the job's own. With the logging
    config the engines pass (applied by vLLM's own `configure_logging`, as in each of its
    processes): INFO lines and the advisories of VLLM_ADVISORIES are dropped, other warnings
    are printed."""
    import io

    pytest.importorskip("vllm")
    import vllm.logger
    from vllm.config.logging import LoggingConfig

    from m2po_rllib.common.log_filters import VLLM_LOGGING_CONFIG

    vllm_root = logging.getLogger("vllm")
    for attr in ("handlers", "filters", "level", "propagate"):  # restored afterwards
        monkeypatch.setattr(vllm_root, attr, getattr(vllm_root, attr))
    monkeypatch.setattr(vllm.logger, "_last_configured_logging_config", None)
    vllm.logger.configure_logging(LoggingConfig(pylogging_config_file=str(VLLM_LOGGING_CONFIG)))
    out = io.StringIO()
    (handler,) = vllm_root.handlers
    handler.setStream(out)

    logging.getLogger("vllm.config.model").info("Resolved architecture: %s", "Qwen2ForCausalLM")
    logging.getLogger("vllm.config.vllm").warning(  # vLLM 0.32's wording (config/vllm.py)
        "Enforce eager set, disabling torch.compile, CUDAGraphs, and JIT kernel warmup."
    )
    logging.getLogger("vllm.v1.worker.cpu_worker").warning("%s is not found in LD_PRELOAD. For best", "libiomp")
    logging.getLogger("vllm.v1.engine.core").warning("engine core died: %s", "out of memory")
    lines = out.getvalue().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].endswith("engine core died: out of memory") and " WARNING " in lines[0]


@pytest.mark.parametrize("chosen", [None, "env", "kwarg"])
def test_the_vllm_engine_passes_that_config_unless_the_user_chose_one(monkeypatch, chosen):
    """`VLLMEngine` hands vLLM the quiet logging config (and no checkpoint-loading bar); a
    user who set vLLM's logging (VLLM_LOGGING_LEVEL, or `engine_kwargs: {log_level: ...}`)
    keeps theirs."""
    vllm = pytest.importorskip("vllm")
    from m2po_rllib.common.log_filters import VLLM_LOGGING_CONFIG, VLLM_LOGGING_ENV
    from m2po_rllib.rollout.vllm_engine import VLLMEngine

    seen = {}

    class Stop(Exception):
        pass

    def fake_llm(**kwargs):
        seen.update(kwargs)
        raise Stop

    monkeypatch.setattr(vllm, "LLM", fake_llm)
    for name in VLLM_LOGGING_ENV:
        monkeypatch.delenv(name, raising=False)
    if chosen == "env":
        monkeypatch.setenv("VLLM_LOGGING_LEVEL", "INFO")
    with pytest.raises(Stop):
        VLLMEngine("some/model", **({"log_level": "INFO"} if chosen == "kwarg" else {}))
    assert seen["use_tqdm_on_load"] is False
    if chosen is None:
        assert seen["logging_config"].pylogging_config_file == str(VLLM_LOGGING_CONFIG)
    else:
        assert "logging_config" not in seen
        assert seen.get("log_level") == ("INFO" if chosen == "kwarg" else None)
