"""Whether a multi-turn episode fits the model's context, measured before Ray starts.

A row holds the prompt and everything after it: per turn the policy's completion (at most
`max_new_tokens`) and, after every turn but the last, what the env inserts (feedback, a
tool's result); `max_episode_tokens` caps what follows the prompt (episodes.py). The engines
generate within the model's positions and the learner attends to the whole row, so

    longest prompt + min(max_episode_tokens, turns x max_new_tokens + (turns - 1) x longest reply)

must fit in them (`validation.check_episode_budget`). `episode_shape` measures the env's
side with one env bound to the policy's tokenizer, as a runner makes it; `model_positions`
reads the model's config.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EpisodeShape:
    max_turns: int
    """The env's own turn cap."""
    prompt_tokens: int
    """The longest first observation (`MathTextEnv.longest_prompt`)."""
    prompt_exact: bool
    """Every prompt was measured (else the longest of those sampled from each split)."""
    reply_tokens: int | None
    """An upper estimate of one env reply (`MathTextEnv.longest_reply`); None: no bound."""


_SHAPES: dict[tuple, EpisodeShape | None] = {}  # validate() runs on every copy of a config


def episode_shape(env_id, env_config: dict, model: str, max_new_tokens: int) -> EpisodeShape | None:
    """The shape of the env's episodes, or None where it is single-turn or cannot be measured
    here (not a `MathTextEnv`, a tokenizer or data that is not on this machine: the runner
    reports those when it makes the env). Raises the env's own ValueError for a bad env_config."""
    key = (env_id, repr(sorted(env_config.items())), model, max_new_tokens)
    if key not in _SHAPES:
        _SHAPES[key] = _measure(env_id, env_config, model, max_new_tokens)
    return _SHAPES[key]


def _measure(env_id, env_config: dict, model: str, max_new_tokens: int) -> EpisodeShape | None:
    import gymnasium as gym
    from gymnasium.envs.registration import load_env_creator

    import envs  # noqa: F401  (registers the m2po/* ids)
    from m2po_rllib.rollout.env_runner import make_text_env

    entry_point = gym.registry[env_id.rpartition(":")[2]].entry_point  # gym.make's "module:id" too
    env_cls = load_env_creator(entry_point) if isinstance(entry_point, str) else entry_point
    takes_turns = getattr(env_cls, "takes_turns", None)
    if takes_turns is None or not takes_turns(env_config):
        return None
    tokenizer = _tokenizer(model)
    if tokenizer is None:
        return None
    try:
        env = make_text_env(env_id, env_config, tokenizer=tokenizer).unwrapped
    except (OSError, RuntimeError, ImportError):  # data not here (a hub dataset offline)
        return None
    try:
        prompt_tokens, exact = env.longest_prompt()
        return EpisodeShape(int(env.max_turns), prompt_tokens, exact, env.longest_reply(max_new_tokens))
    finally:
        env.close()


def _tokenizer(model: str):
    from transformers import AutoTokenizer

    from m2po_rllib.models.builtin import resolve_model_path

    try:
        return AutoTokenizer.from_pretrained(resolve_model_path(model, check_hub=False), local_files_only=True)
    except (OSError, ValueError):  # a hub name not in the local cache
        return None


def model_positions(model: str) -> int | None:
    """The model's `max_position_embeddings`, or None where its config cannot be read here."""
    from transformers import AutoConfig

    from m2po_rllib.models.builtin import resolve_model_path

    try:
        config = AutoConfig.from_pretrained(resolve_model_path(model, check_hub=False), local_files_only=True)
    except (OSError, ValueError):
        return None
    return getattr(config.get_text_config(), "max_position_embeddings", None)
