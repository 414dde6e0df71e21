"""M2PO for Ray RLlib: second-moment trust policy optimization on stale LLM rollouts.

`m2po_rllib.losses` is pure torch and imports no Ray; the RLlib classes load lazily so
that importing the loss library stays cheap.
"""

__version__ = "0.1.0"

from m2po_rllib import moved

moved.install()  # old module paths, for checkpoints pickled before the root was grouped

_LAZY = {
    "M2POConfig": "m2po_rllib.config.algorithm_config",
    "M2PO": "m2po_rllib.driver.m2po",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'm2po_rllib' has no attribute {name!r}")


__all__ = ["M2POConfig", "M2PO", "__version__"]
