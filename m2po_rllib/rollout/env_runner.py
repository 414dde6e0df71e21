"""`LLMEnvRunner`: an RLlib EnvRunner whose policy is a generation engine (vLLM or HF).

One round of `sample()`:
  1. reset `num_prompts x group_size` text envs, each group with one seed (so one prompt),
  2. generate `group_size` completions per prompt with the engine, keeping the token ids
     and the behaviour log-probs,
  3. step each env with its completion text to get the verifier's reward,
  4. pack everything, tagged with the policy version of the engine's weights.

Weights arrive through `set_state` (RLlib's `EnvRunnerGroup.sync_weights` calls it) and are
loaded into the engine in place; a sync older than the engine's weights is ignored.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import gymnasium as gym
import numpy as np
import ray

from ray.rllib.core import COMPONENT_RL_MODULE, DEFAULT_MODULE_ID
from ray.rllib.env.env_runner import EnvRunner
from ray.rllib.utils.checkpoints import Checkpointable

from envs.reward import shared_verifier
from m2po_rllib.rollout.batch import pack_rollouts

logger = logging.getLogger(__name__)

# Metric keys (namespaced as in ../shared/STYLE.md).
REWARD_MEAN = "rollout/reward_mean"
ACCURACY = "rollout/accuracy"
RESPONSE_LEN = "rollout/response_len_mean"
TOKENS_PER_S = "rollout/tokens_per_s"
GENERATE_S = "rollout/generate_s"
SCORE_S = "rollout/score_s"
WEIGHT_SYNC_S = "rollout/weight_sync_s"
ENGINE_VERSION = "rollout/engine_policy_version"
EVAL_ACCURACY = "eval/accuracy"
EVAL_MEAN_AT_K = "eval/mean_at_k"
EVAL_RESPONSE_LEN = "eval/response_len_mean"


def make_text_env(env_id: str, env_config: dict, **overrides) -> gym.Env:
    import envs  # noqa: F401  (registers the m2po/* ids)

    return gym.make(env_id, disable_env_checker=True, **{**dict(env_config), **overrides})


def engine_settings(config) -> dict[str, Any]:
    """What an engine needs from an M2POConfig, as plain picklable values."""
    model_config = dict(config.model_config or {})
    return {
        "kind": config.resolved_rollout_engine(),
        "model": model_config.get("model"),
        "dtype": model_config.get("dtype", "float32"),
        "engine_kwargs": dict(config.engine_kwargs or {}),
    }


class LLMEnvRunner(EnvRunner, Checkpointable):
    """Samples grouped completions for verifiable text tasks with an LLM engine."""

    def __init__(self, *, config, **kwargs):
        super().__init__(config=config, **kwargs)
        self.worker_index = kwargs.get("worker_index") or 0
        self._engine = None
        # Newest weights version received, and weights an engine may still need: those that
        # arrived before the engine started, and (local runner only) the copy an in-place
        # engine restart reloads. A remote runner drops them once loaded: a restart replaces
        # the whole actor and RLlib resyncs it.
        self._weights_version = -1
        self._pending_weights: tuple[dict, int] | None = None
        self._tokenizer = None
        self._train_envs: list[gym.Env] = []
        self._eval_envs: dict[str, gym.Env] = {}
        self.make_env()

    # -- construction ---------------------------------------------------------------------
    def make_env(self):
        for env in self._train_envs:
            env.close()
        self._train_envs = []
        self._eval_envs = {}
        # One env tells the spaces; the rest are made on first use (prompts x group size).
        self.env = make_text_env(self.config.env, self.config.env_config)
        self._train_envs = [self.env]

    def _envs(self, n: int) -> list[gym.Env]:
        while len(self._train_envs) < n:
            self._train_envs.append(make_text_env(self.config.env, self.config.env_config))
        return self._train_envs[:n]

    def _split_env(self, split: str) -> gym.Env:
        if split not in self._eval_envs:
            self._eval_envs[split] = make_text_env(self.config.env, self.config.env_config, split=split)
        return self._eval_envs[split]

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            from m2po_rllib.models.builtin import resolve_model_path

            settings = engine_settings(self.config)
            self._tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(settings["model"]))
        return self._tokenizer

    @property
    def engine(self):
        """The engine, started on first use (the local runner of a multi-runner job never
        samples, so it never pays for one). A dead engine is restarted in place on the local
        runner; a remote runner reports itself dead so that RLlib replaces it."""
        if self._engine is not None and not self._engine.is_healthy():
            if self.worker_index > 0:
                from m2po_rllib.rollout.engine import EngineDeadError

                raise EngineDeadError(
                    f"EnvRunner {self.worker_index}: the rollout engine died; RLlib's "
                    "restart_failed_env_runners replaces this runner"
                )
            self._start_engine()
        if self._engine is None:
            self._start_engine()
        return self._engine

    def _start_engine(self):
        from m2po_rllib.models.builtin import resolve_model_path
        from m2po_rllib.rollout.engine import make_engine

        if self._engine is not None:
            logger.warning("rollout engine is unhealthy; restarting it")
            try:
                self._engine.shutdown()
            except Exception:  # a dead engine may fail to shut down; it is replaced anyway
                pass
        settings = engine_settings(self.config)
        kwargs = dict(settings["engine_kwargs"])
        kwargs.setdefault("dtype", settings["dtype"])
        if self._seed is not None:
            kwargs.setdefault("seed", self._seed)
        t0 = time.perf_counter()
        self._engine = make_engine(settings["kind"], resolve_model_path(settings["model"]), **kwargs)
        self.metrics.log_value("rollout/engine_start_s", time.perf_counter() - t0, reduce="mean")
        if self._pending_weights is not None:
            weights, version = self._pending_weights
            self._engine.update_weights(weights, version)

    # -- RLlib EnvRunner API ----------------------------------------------------------------
    def assert_healthy(self):
        assert self.env is not None, "LLMEnvRunner has no env"
        if self._engine is not None:
            assert self._engine.is_healthy(), "rollout engine is dead"

    def get_spaces(self):
        return {
            "__env__": (self.env.observation_space, self.env.action_space),
            DEFAULT_MODULE_ID: (self.env.observation_space, self.env.action_space),
        }

    def _sampling(self, *, n: int, greedy: bool, seed: int | None):
        from m2po_rllib.rollout.engine import SamplingConfig

        cfg = self.config
        return SamplingConfig(
            n=n,
            temperature=0.0 if greedy else cfg.temperature,
            top_p=1.0 if greedy else cfg.top_p,
            max_tokens=cfg.max_new_tokens,
            stop=list(cfg.stop or []),
            seed=seed,
        )

    def _encode(self, prompts: list[str]) -> list[list[int]]:
        return [self.tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]

    def sample(self, *, num_prompts: int | None = None, seed: int = 0, **kwargs) -> dict[str, np.ndarray]:
        """Samples `num_prompts` prompts x `group_size` completions with the current weights.

        `seed` makes a round reproducible: it picks the prompts and seeds the sampler.
        Returns a rollout batch (see `m2po_rllib.rollout.batch`).
        """
        cfg = self.config
        g = cfg.group_size
        num_prompts = num_prompts or cfg.prompts_per_step
        envs = self._envs(num_prompts * g)
        prompts = []
        for p in range(num_prompts):
            # Runners share the round seed; each draws its own prompts.
            prompt_seed = int(np.random.SeedSequence([seed, self.worker_index, 0, p]).generate_state(1)[0])
            for j in range(g):
                obs, _ = envs[p * g + j].reset(seed=prompt_seed)
            prompts.append(obs["prompt"] if isinstance(obs, dict) else obs)
        prompt_ids = self._encode(prompts)

        engine = self.engine
        # Requests draw from seeds base + i; spread the rounds' bases so that consecutive
        # rounds (seed, seed + 1) do not share per-request random streams.
        base = int(np.random.SeedSequence([seed, self.worker_index, 1]).generate_state(1)[0] >> 1)
        t0 = time.perf_counter()
        groups = engine.generate(prompt_ids, self._sampling(n=g, greedy=False, seed=base))
        t_gen = time.perf_counter() - t0

        t0 = time.perf_counter()
        rows_prompt, rows_resp, rows_logp, rewards, correct = [], [], [], [], []
        for p, completions in enumerate(groups):
            for j, c in enumerate(completions):
                _, reward, terminated, truncated, info = envs[p * g + j].step(c.text)
                if not (terminated or truncated):
                    raise NotImplementedError(
                        f"env {cfg.env!r} continued the episode after one turn; LLMEnvRunner "
                        "samples single-turn episodes (set env_config max_turns=1)"
                    )
                rows_prompt.append(prompt_ids[p])
                rows_resp.append(list(c.token_ids))
                rows_logp.append(list(c.logprobs))
                rewards.append(float(reward))
                correct.append(bool(info.get("correct", reward > 0)))
        t_score = time.perf_counter() - t0

        batch = pack_rollouts(
            rows_prompt, rows_resp, rows_logp, rewards, max(engine.version, 0), self.tokenizer.pad_token_id
        )
        n_tokens = int(batch["response_mask"].sum())
        self.metrics.log_value(REWARD_MEAN, float(np.mean(rewards)), reduce="mean")
        self.metrics.log_value(ACCURACY, float(np.mean(correct)), reduce="mean")
        self.metrics.log_value(RESPONSE_LEN, n_tokens / len(rewards), reduce="mean")
        self.metrics.log_value(TOKENS_PER_S, n_tokens / max(t_gen, 1e-9), reduce="mean")
        self.metrics.log_value(GENERATE_S, t_gen, reduce="mean")
        self.metrics.log_value(SCORE_S, t_score, reduce="mean")
        self.metrics.log_value(ENGINE_VERSION, engine.version, reduce="max")
        # The verifier's counters (reward/timeouts, reward/errors, fast/slow path, ...).
        for key, count in shared_verifier().metrics(reset=True).items():
            self.metrics.log_value(key, count, reduce="sum")
        self.metrics.log_value("num_env_steps_sampled_lifetime", len(rewards), reduce="lifetime_sum")
        self.metrics.log_value("num_episodes_lifetime", len(rewards), reduce="lifetime_sum")
        return batch

    def evaluate(
        self, *, indices: list[int], samples: int = 1, seed: int = 0, split: str = "heldout"
    ) -> dict[str, Any]:
        """Scores problems `indices` of `split`: greedy accuracy, and mean@k with `samples` > 1.

        Returns counts (not means) so results from several runners add up exactly.
        """
        env = self._split_env(split)
        prompts, answers = [], []
        for i in indices:
            obs, info = env.reset(options={"index": int(i)})
            prompts.append(obs["prompt"] if isinstance(obs, dict) else obs)
            answers.append(info["answer"])
        prompt_ids = self._encode(prompts)
        engine = self.engine
        out = {"n": len(indices), "greedy_correct": 0, "sampled_correct": 0, "sampled_n": 0, "tokens": 0}
        greedy = engine.generate(prompt_ids, self._sampling(n=1, greedy=True, seed=seed))
        for i, (group, answer) in enumerate(zip(greedy, answers)):
            out["greedy_correct"] += int(self._score(env, indices[i], group[0].text) > 0)
            out["tokens"] += len(group[0].token_ids)
        if samples > 1:
            sampled = engine.generate(prompt_ids, self._sampling(n=samples, greedy=False, seed=seed))
            for i, group in enumerate(sampled):
                for c in group:
                    out["sampled_correct"] += int(self._score(env, indices[i], c.text) > 0)
                    out["sampled_n"] += 1
        return out

    @staticmethod
    def _score(env: gym.Env, index: int, text: str) -> float:
        env.reset(options={"index": int(index)})
        _, reward, *_ = env.step(text)
        return float(reward)

    def get_metrics(self):
        return self.metrics.reduce()

    # -- state ----------------------------------------------------------------------------
    def set_state(self, state: dict) -> None:
        # RLlib sends remote runners the module state as one ObjectRef nested in the dict
        # (`sync_env_runner_states`, `sync_weights`); Ray resolves only top-level arguments.
        module_state = state.get(COMPONENT_RL_MODULE)
        if isinstance(module_state, ray.ObjectRef):
            module_state = ray.get(module_state)
        module_state = (module_state or {}).get(DEFAULT_MODULE_ID)
        if not module_state or "weights" not in module_state:
            return
        version = int(module_state.get("policy_version", 0))
        if version <= self._weights_version:
            return  # stale or duplicate sync
        self._weights_version = version
        weights = module_state["weights"]
        if self._engine is not None and self._engine.is_healthy():
            t0 = time.perf_counter()
            self._engine.update_weights(weights, version)
            self.metrics.log_value(WEIGHT_SYNC_S, time.perf_counter() - t0, reduce="mean")
            self._pending_weights = (weights, version) if self.worker_index == 0 else None
        else:
            self._pending_weights = (weights, version)

    def get_state(self, components=None, *, not_components=None, **kwargs) -> dict:
        return {"engine_version": self._engine.version if self._engine is not None else -1}

    def get_ctor_args_and_kwargs(self):
        return ((), {"config": self.config})

    def stop(self) -> None:
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None
        for env in self._train_envs:
            env.close()
        for env in self._eval_envs.values():
            env.close()

    def __del__(self):
        pass

    def ping(self) -> str:
        # RLlib pings a runner it marked unhealthy. With a dead engine, end this actor's
        # process: Ray restarts the actor (max_num_env_runner_restarts), RLlib's
        # restore_env_runners syncs the current weights to it, and it samples with those.
        if self.worker_index > 0 and self._engine is not None and not self._engine.is_healthy():
            logger.error("EnvRunner %d: rollout engine is dead; exiting for a restart", self.worker_index)
            os._exit(1)
        return "pong"
