"""Third-party log lines the package drops: only the one message, and only where it asks
nothing of the user."""

from __future__ import annotations

import logging

import torch


def test_the_gputil_hint_is_dropped_on_a_machine_without_gpus():
    """Every Algorithm (a Tune Trainable) starts Ray Tune's UtilMonitor, which asks for
    GPUtil even without GPUs; importing the algorithm drops that one line there, and the
    logger's other messages still pass."""
    import m2po_rllib.m2po  # noqa: F401  (installs the filter)
    from ray.tune.utils.util import UtilMonitor

    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logger = logging.getLogger("ray.tune.utils.util")
    logger.addHandler(handler)
    try:
        monitor = UtilMonitor(start=True, delay=0.05)
        monitor.stop()
        logger.warning("another message")
    finally:
        logger.removeHandler(handler)
    assert torch.cuda.is_available() or "Install gputil for GPU system monitoring." not in seen
    assert "another message" in seen
