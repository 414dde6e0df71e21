"""Third-party log lines the package drops: only the one message, and only where it asks
nothing of the user."""

from __future__ import annotations

import logging

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
    from m2po_rllib.log_filters import quiet_gputil_hint_without_gpus

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
    import m2po_rllib.m2po  # noqa: F401  (installs the filter)

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
