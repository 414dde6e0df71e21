"""The configuration: `M2POConfig` (algorithm_config.py: every setting, its default and
meaning, once), what the settings imply (derived.py), its checks (validation/) and the YAML
files that mirror it (from_yaml.py). `M2POConfig` loads lazily, so that reading a YAML
config imports no Ray."""


def __getattr__(name):
    if name == "M2POConfig":
        from m2po_rllib.config.algorithm_config import M2POConfig

        return M2POConfig
    raise AttributeError(f"module 'm2po_rllib.config' has no attribute {name!r}")


__all__ = ["M2POConfig"]
