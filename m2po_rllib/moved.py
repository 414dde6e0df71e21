"""The modules that moved when the package root was grouped by side (driver/, config/,
common/), importable under their old names: checkpoints written before pickle the old paths
(the algorithm's class, its config's), and a run resumed from one must find them. Nothing
in the package imports an old name (tests/test_layout.py)."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

MOVED = {
    "m2po_rllib.m2po": "m2po_rllib.driver.m2po",
    "m2po_rllib.learners": "m2po_rllib.driver.learners",
    "m2po_rllib.pace": "m2po_rllib.driver.pace",
    "m2po_rllib.checkpoints": "m2po_rllib.driver.checkpoints",
    "m2po_rllib.evaluation": "m2po_rllib.driver.evaluation",
    "m2po_rllib.resources": "m2po_rllib.driver.resources",
    "m2po_rllib.config_derived": "m2po_rllib.config.derived",
    "m2po_rllib.config_io": "m2po_rllib.config.from_yaml",
    "m2po_rllib.validation": "m2po_rllib.config.validation",
    **{f"m2po_rllib.{name}": f"m2po_rllib.common.{name}" for name in (
        "keys", "errors", "truncation", "durable", "net", "threads", "log_filters", "ray_watchdog")},
}


def new_name(old: str) -> str | None:
    """Where a moved module (or one inside a moved package) lives now; None if it did not move."""
    for before, after in MOVED.items():
        if old == before or old.startswith(before + "."):
            return after + old[len(before):]
    return None


class MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports an old name as the module at its new one (the same module object)."""

    def find_spec(self, fullname, path=None, target=None):
        return importlib.util.spec_from_loader(fullname, self) if new_name(fullname) else None

    def create_module(self, spec):
        return importlib.import_module(new_name(spec.name))

    def exec_module(self, module):
        pass  # already executed under its new name


def install() -> None:
    if not any(isinstance(finder, MovedModules) for finder in sys.meta_path):
        sys.meta_path.insert(0, MovedModules())  # before the path finders, which would load a second copy
