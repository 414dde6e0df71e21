"""YAML configs that mirror the AlgorithmConfig methods.

    environment: {env: m2po/Arithmetic-v0, env_config: {...}}
    env_runners: {num_env_runners: 0, rollout_engine: hf, temperature: 1.0, ...}
    learners:    {num_learners: 0}
    rl_module:   {model_config: {model: builtin:arith-tiny}}
    training:    {policy_loss: m2po, m2_threshold: 0.04, staleness: 64, lr: 3.0e-5, ...}
    evaluation:  {evaluation_interval: 5, evaluation_duration: 200}
    debugging:   {seed: 0}

Each section is passed as keyword arguments to the method of the same name, so the config
object validates it; nothing is `exec`ed. Overrides use dotted keys: `training.lr=1e-5`.
A key that is not an argument of that method (M2PO's or RLlib's) is an error that names
the closest valid one.
"""

from __future__ import annotations

import copy
import difflib
import inspect
import re
from typing import Any

import yaml

from m2po_rllib.common.errors import ConfigError

# YAML 1.1 reads `1e-5` (no dot) as a string; configs mean the number.
_FLOAT_RE = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+$")


def _numbers(value):
    if isinstance(value, str) and _FLOAT_RE.match(value):
        return float(value)
    if isinstance(value, dict):
        return {k: _numbers(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_numbers(v) for v in value]
    return value

SECTIONS = (
    "environment",
    "env_runners",
    "learners",
    "rl_module",
    "training",
    "evaluation",
    "debugging",
    "reporting",
    "resources",
    "fault_tolerance",
    "checkpointing",
)


# The `m2po train` job's own settings (stop_iters, ...); not part of the algorithm config.
JOB_SECTION = "run"


def parse_override(item: str) -> tuple[str, str, Any]:
    """`section.key=value` -> (section, key, YAML-parsed value)."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like section.key=value, e.g. training.lr=1e-5")
    path, raw = item.split("=", 1)
    if "." not in path:
        raise ConfigError(
            f"override {item!r} needs a section: one of {', '.join(SECTIONS)} (e.g. training.{path}={raw})"
        )
    section, key = path.split(".", 1)
    return section, key, parse_value(raw, f"override {item!r}")


def parse_value(raw: str, source: str | None = None) -> Any:
    """A command-line value as YAML reads it (`1e-5` is a number, as configs mean it).
    `source` names the argument it came from in the error a malformed value raises."""
    try:
        return _numbers(yaml.safe_load(raw))
    except yaml.YAMLError as e:
        # yaml's own message is a multi-line excerpt; the problem and its place suffice.
        mark = getattr(e, "problem_mark", None)
        where = ""
        if mark is not None and mark.line == 0:
            where = ", at the end of the value" if mark.column >= len(raw) else f", at character {mark.column + 1}"
        what = f"{source}: its value" if source else f"value {raw!r}"
        raise ConfigError(
            f"{what} is not valid YAML ({getattr(e, 'problem', None) or str(e).splitlines()[0]}{where}); "
            f"close every bracket and quote, as in {{digits: 3}} or [1, 2], and put a string that "
            f"holds ':', '{{' or '[' in YAML quotes, as in \"a: b\""
        ) from None


def apply_overrides(spec: dict, overrides: dict | list | None) -> dict:
    spec = copy.deepcopy(spec)
    if not overrides:
        return spec
    items = overrides.items() if isinstance(overrides, dict) else []
    if isinstance(overrides, (list, tuple)):
        items = [(f"{s}.{k}", v) for s, k, v in map(parse_override, overrides)]
    for path, value in items:
        section, key = path.split(".", 1)
        node = spec.setdefault(section, {})
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return spec


def load_spec(path: str) -> dict:
    with open(path) as f:
        spec = _numbers(yaml.safe_load(f) or {})
    if not isinstance(spec, dict):
        raise ConfigError(f"{path}: a config is a mapping of sections ({', '.join(SECTIONS)})")
    return spec


def section_settings(config_cls, section: str) -> list[str]:
    """The keyword arguments of `config_cls.<section>()`, the class's and RLlib's."""
    names = []
    for cls in config_cls.__mro__:
        method = cls.__dict__.get(section)
        if method is None:
            continue
        for p in inspect.signature(method).parameters.values():
            if p.name != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and p.name not in names:
                names.append(p.name)
    return names


def _check_keys(config_cls, section: str, keys) -> None:
    valid = section_settings(config_cls, section)
    for key in keys:
        if key in valid:
            continue
        close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
        hint = f"did you mean `{close[0]}`?" if close else f"see `M2POConfig.{section}()` for the settings"
        raise ConfigError(f"unknown setting `{section}.{key}`; {hint}", (f"{section}.{key}", key))


def config_from_spec(spec: dict, config_cls):
    """`config_cls()` with each section of `spec` passed to the method of that name."""
    config = config_cls()
    unknown = set(spec) - set(SECTIONS) - {JOB_SECTION}
    if unknown:
        raise ConfigError(
            f"unknown config section(s) {sorted(unknown)}; valid: {', '.join(SECTIONS)}, {JOB_SECTION}"
        )
    for section in SECTIONS:
        if section in spec and spec[section]:
            if not isinstance(spec[section], dict):
                raise ConfigError(f"config section `{section}` must be a mapping of settings, got {spec[section]!r}")
            kwargs = dict(spec[section])
            _check_keys(config_cls, section, kwargs)
            if section == "environment" and "env" in kwargs:
                config.environment(kwargs.pop("env"), **kwargs)
                continue
            try:
                getattr(config, section)(**kwargs)
            except TypeError as e:
                raise ConfigError(f"config section {section!r}: {e}") from None
    return config
