"""The checks `M2POConfig.validate()` runs that take more than a line: the type of each
setting (before RLlib's own checks, which fail with a traceback on e.g. `lr="abc"`) and
whether the env id is registered (with close matches for a typo)."""

from __future__ import annotations

# The type each M2PO setting (and the RLlib settings M2PO reads) must have.
_INT, _NUMBER = "an int", "a number"
_TYPES = {
    **dict.fromkeys(
        ("group_size", "prompts_per_step", "minibatch_prompts", "staleness", "num_epochs",
         "max_new_tokens", "logp_mismatch_interval", "eval_samples", "evaluation_duration",
         "num_env_runners", "num_learners", "broadcast_interval", "logp_chunk_size"),
        _INT,
    ),
    **dict.fromkeys(("m2_threshold", "temperature", "top_p", "weight_decay"), _NUMBER),
}
_OPTIONAL = {
    "eps_low": _NUMBER, "eps_high": _NUMBER, "evaluation_interval": _INT, "seed": _INT,
    "micro_batch_size": _INT, "max_staleness": _INT,
}


def _is(value, kind: str) -> bool:
    if isinstance(value, bool):
        return False
    return isinstance(value, int) if kind == _INT else isinstance(value, (int, float))


def type_errors(config) -> list[str]:
    errors = [
        f"`{name}` ({getattr(config, name)!r}) must be {kind}"
        for name, kind in [*_TYPES.items(), *_OPTIONAL.items()]
        if not _is(getattr(config, name), kind) and not (name in _OPTIONAL and getattr(config, name) is None)
    ]
    if not (_is(config.lr, _NUMBER) or isinstance(config.lr, (list, tuple))):
        errors.append(f"`lr` ({config.lr!r}) must be a number (or an RLlib schedule, [[step, lr], ...])")
    for name in ("recompute_behavior_logp", "async_rollouts"):
        if not isinstance(getattr(config, name), bool):
            errors.append(f"`{name}` ({getattr(config, name)!r}) must be true or false")
    return errors


def env_id_error(env) -> str | None:
    """None if `env` is a gymnasium id `gymnasium.make` can build, else why not."""
    import difflib
    import importlib

    import gymnasium as gym

    import envs  # noqa: F401  (registers the m2po/* ids)

    if not isinstance(env, str):
        return f"`env` ({env!r}) must be a gymnasium env id (str), e.g. 'm2po/Arithmetic-v0'"
    module, _, env_id = env.rpartition(":")
    if module:
        try:
            importlib.import_module(module)
        except ImportError as e:
            return f"`env` ({env!r}): cannot import module {module!r} ({e})"
    if env_id in gym.registry:
        return None
    close = difflib.get_close_matches(env_id, list(gym.registry), n=3, cutoff=0.6)
    hint = f"did you mean {' or '.join(map(repr, close))}?" if close else "the project's are 'm2po/Arithmetic-v0' and 'm2po/MathDataset-v0'"
    return f"`env` ({env!r}) is not a registered gymnasium env id; {hint}"
