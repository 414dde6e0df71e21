"""`LLMEnvRunner`: an RLlib EnvRunner whose policy is a generation engine (vLLM or HF).

One round of `sample()`:
  1. load the newest published weights if the request carries newer ones than the engine
     serves (`PublishedWeights`: applied between rounds, never in the middle of one),
  2. reset one text env per prompt (a GRPO group shares its prompt),
  3. generate `group_size` completions per prompt with the engine, keeping the token ids
     and the behaviour log-probs,
  4. score each group with one batched verifier call (`env.score_group`),
  5. pack everything, tagged with the policy version of the engine's weights and a sample
     id per completion; with `recompute_behavior_logp` in async mode, score the round in the
     learner's numerics with the same weights (`BehaviorScorer`), keeping the engine's
     log-probs as `engine_logp`.

Weights also arrive through `set_state` (RLlib's own syncs call it); a sync older than
the engine's weights is ignored either way. The engine owns the version it serves.
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
from ray.rllib.utils.annotations import override
from ray.rllib.utils.checkpoints import Checkpointable

from envs.reward import shared_verifier
from m2po_rllib import keys
from m2po_rllib.errors import ConfigError
from m2po_rllib.threads import cpus, use_cpus
from m2po_rllib.wire.batch import pack_rollouts
from m2po_rllib.wire.weights import PublishedWeights

logger = logging.getLogger(__name__)

def make_text_env(env_id: str, env_config: dict, **overrides) -> gym.Env:
    import envs  # noqa: F401  (registers the m2po/* ids)

    return gym.make(env_id, disable_env_checker=True, **{**dict(env_config), **overrides})


def engine_settings(config) -> dict[str, Any]:
    """What an engine needs from an M2POConfig, as plain picklable values."""
    model_config = dict(config.model_config or {})
    return {
        "kind": config.resolved_rollout_engine(),
        "model": model_config.get("model"),
        "dtype": model_config["dtype"],
        "engine_kwargs": dict(config.engine_kwargs or {}),
        # the training runners of a native sync build vLLM's receive path (evaluation runners
        # are not in the learner's group: the object store brings theirs)
        "weight_transport": (
            config.resolved_weight_sync_backend()
            if config.native_weight_sync and not config.in_evaluation
            else "object_store"
        ),
    }


def round_delay_s(delay: dict, seed: int, stream: int) -> float:
    """`round_delay`'s wait for the round seeded `seed` on `stream`: log-normal with median
    `median_s` and log-scale `sigma`."""
    rng = np.random.default_rng(np.random.SeedSequence([seed, stream, 2]))
    return float(delay["median_s"]) * float(np.exp(float(delay.get("sigma", 0.0)) * rng.standard_normal()))


def round_seed(base_seed: int | None, round_index: int) -> int:
    """The seed of sampling round `round_index`: picks its prompts and seeds its sampler."""
    return (base_seed or 0) * 1_000_003 + round_index


class LLMEnvRunner(EnvRunner, Checkpointable):
    """Samples grouped completions for verifiable text tasks with an LLM engine."""

    def __init__(self, *, config, **kwargs):
        super().__init__(config=config, **kwargs)
        self.worker_index = kwargs.get("worker_index") or 0
        if self.worker_index > 0:
            # A runner actor computes with the CPUs Ray gave it, no more (on a small machine
            # oversubscribed torch threads slow every process beside it 10x and more).
            use_cpus(config.num_cpus_per_env_runner)
        self._engine = None
        self._scorer = None  # BehaviorScorer, with the engine, when this runner scores its rounds
        # Weights that arrived before the engine started (loaded at its start), and, on the
        # local runner, the copy an in-place engine restart reloads. A remote runner drops
        # them once loaded: a restart replaces the whole actor, and the next request carries
        # the current weights.
        self._pending_weights: tuple[dict, int] | None = None
        self._tokenizer = None
        self._train_envs: list[gym.Env] = []
        self._eval_envs: dict[str, gym.Env] = {}
        self._eval_episode_envs: dict[str, list[gym.Env]] = {}  # multi-turn evaluation: one per episode
        self.make_env()

    # -- construction ---------------------------------------------------------------------
    def make_env(self):
        for env in self._train_envs:
            env.close()
        self._train_envs = []
        self._eval_envs = {}
        self._eval_episode_envs = {}
        # One env tells the spaces; the rest are made on first use (one per prompt).
        self.env = self._make_env()
        # Episodes of several policy turns (feedback, tools) go through the episode loop
        # (episodes.py); single-turn ones keep the grouped fast path.
        self.multi_turn = bool(getattr(self.env.unwrapped, "multi_turn", False))
        self._train_envs = [self.env]

    def _envs(self, n: int) -> list[gym.Env]:
        while len(self._train_envs) < n:
            self._train_envs.append(self._make_env())
        return self._train_envs[:n]

    def _split_env(self, split: str) -> gym.Env:
        if split not in self._eval_envs:
            self._eval_envs[split] = self._make_env(split=split)
        return self._eval_envs[split]

    def _make_env(self, **overrides) -> gym.Env:
        """A text env bound to the policy's tokenizer: the env renders and tokenizes each
        prompt (`prompt_token_ids`), one rule for every path (special tokens as the
        template wants them, as vLLM adds them to a text prompt)."""
        try:
            return make_text_env(self.config.env, self.config.env_config, tokenizer=self.tokenizer, **overrides)
        except ValueError as e:  # the env's own check of its env_config
            raise ConfigError(str(e), ("env_config",)) from e
        except TypeError as e:
            if "tokenizer" not in str(e):
                raise
            raise TypeError(
                f"env {self.config.env!r} must take a `tokenizer` argument and return `prompt_token_ids` "
                f"(LLMEnvRunner binds the policy's tokenizer to it; see envs.text_env.MathTextEnv): {e}"
            ) from None

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
        if settings["kind"] == "vllm":
            kwargs.setdefault("weight_transport", settings["weight_transport"])
            if self.worker_index > 0:
                kwargs.setdefault("num_threads", cpus(self.config.num_cpus_per_env_runner))
        if self._seed is not None:
            kwargs.setdefault("seed", self._seed)
        model_path = resolve_model_path(settings["model"])
        t0 = time.perf_counter()
        engine = make_engine(settings["kind"], model_path, **kwargs)
        self.metrics.log_value(keys.ENGINE_START_S, time.perf_counter() - t0, reduce="mean")
        try:  # the engine is this runner's only with its scorer, when it scores its rounds
            scorer = None
            if self.config.runners_recompute_behavior_logp:
                from m2po_rllib.rollout.scorer import BehaviorScorer

                scorer = BehaviorScorer.beside(engine, self.config, model_path)
        except BaseException:
            engine.shutdown()
            raise
        self._engine, self._scorer = engine, scorer
        if self._pending_weights is not None:
            weights, version = self._pending_weights
            if self._engine.update_weights(weights, version) and self._scorer is not None:
                self._scorer.load(weights)

    @property
    def weights_version(self) -> int:
        """Version of the newest weights this runner has: served by its engine, or waiting
        for the engine to start. -1 before any."""
        if self._engine is not None:
            return self._engine.version
        return self._pending_weights[1] if self._pending_weights is not None else -1

    def _load(self, version: int, fetch) -> None:
        """Loads the weights `fetch()` returns if `version` is newer than this runner's (the
        one check: older or duplicate versions are never fetched nor loaded)."""
        if version <= self.weights_version:
            return
        weights = fetch()
        if self._engine is not None and self._engine.is_healthy():
            t0 = time.perf_counter()
            self._engine.update_weights(weights, version)
            if self._scorer is not None:
                self._scorer.load(weights)
            self.metrics.log_value(keys.WEIGHT_SYNC_S, time.perf_counter() - t0, reduce="mean")
            self._pending_weights = (weights, version) if self.worker_index == 0 else None
        else:
            self._pending_weights = (weights, version)

    def _use(self, published: PublishedWeights | None) -> None:
        if published is None:
            return
        if published.native:
            # the learner broadcast these (`m2po_receive_weights`); a runner without them (it
            # restarted, and the group is not formed again yet) samples with what it serves,
            # and its rows say which version that is
            if published.version > self.weights_version:
                logger.warning("EnvRunner %d serves version %d; version %d went by native sync without it",
                               self.worker_index, self.weights_version, published.version)
            return
        self._load(published.version, published.get)

    # -- native weight sync (weight_sync="native"): the learner's RunnerGroupClient calls these --
    def m2po_weight_layout(self) -> dict[str, list[int]]:
        """The parameter names and shapes this runner's model has (checked before the group opens)."""
        from m2po_rllib.models.builtin import resolve_model_path
        from m2po_rllib.sync.transports import weight_layout

        return weight_layout(resolve_model_path(engine_settings(self.config)["model"]))

    def m2po_join_weight_group(self, init_info: dict) -> None:
        """Joins the learner's group (a new one replaces the last); starts the engine if needed."""
        self.engine.join_weight_group(init_info)

    def m2po_receive_weights(self, update_info: dict, version: int) -> bool:
        """Receives one broadcast as `version` (between rounds: Ray runs this actor's calls one
        at a time)."""
        from m2po_rllib.sync.transports import BroadcastWeights

        t0 = time.perf_counter()
        loaded = self.engine.update_weights(BroadcastWeights(**update_info), version)
        self._pending_weights = None  # superseded
        self.metrics.log_value(keys.WEIGHT_SYNC_S, time.perf_counter() - t0, reduce="mean")
        return loaded

    # -- RLlib EnvRunner API ----------------------------------------------------------------
    @override(EnvRunner)
    def assert_healthy(self):
        assert self.env is not None, "LLMEnvRunner has no env"
        if self._engine is not None:
            assert self._engine.is_healthy(), "rollout engine is dead"

    @override(EnvRunner)
    def get_spaces(self):
        return {
            "__env__": (self.env.observation_space, self.env.action_space),
            DEFAULT_MODULE_ID: (self.env.observation_space, self.env.action_space),
        }

    def _sampling(self, *, n: int, greedy: bool, seed: int | None):
        from m2po_rllib.rollout.engine import SamplingConfig

        cfg = self.config
        env_stop = [s for s in getattr(self.env.unwrapped, "stop", ()) if s not in (cfg.stop or [])]
        return SamplingConfig(
            n=n,
            temperature=0.0 if greedy else cfg.temperature,
            top_p=1.0 if greedy else cfg.top_p,
            top_k=0 if greedy else cfg.top_k,
            max_tokens=cfg.max_new_tokens,
            stop=list(cfg.stop or []) + env_stop,
            seed=seed,
        )

    # -- multi-turn episodes (episodes.py) ------------------------------------------------
    @property
    def max_episode_turns(self) -> int:
        """The turn cap: the env's own, or the runner's `max_episode_turns` if lower."""
        env_turns = int(getattr(self.env.unwrapped, "max_turns", 1))
        cap = self.config.max_episode_turns
        return env_turns if cap is None else min(env_turns, int(cap))

    def _play(self, envs: list[gym.Env], prompt_ids: list[list[int]], *, greedy: bool, seed: int):
        """Plays one episode per env (each already reset; `prompt_ids` its first observation),
        every turn's requests seeded from `seed` and the turn."""
        from m2po_rllib.rollout.episodes import Episode, run_episodes

        episodes = [Episode(list(ids), env.unwrapped) for ids, env in zip(prompt_ids, envs)]
        run_episodes(
            self.engine, episodes,
            lambda turn: self._sampling(n=1, greedy=greedy, seed=seed + turn * 100_003),
            max_turns=self.max_episode_turns, max_tokens=self.config.max_episode_tokens,
        )
        return episodes

    @override(EnvRunner)
    def sample(
        self,
        *,
        num_prompts: int | None = None,
        seed: int = 0,
        stream: int | None = None,
        weights: PublishedWeights | None = None,
        first_sample_id: int = 0,
        **kwargs,
    ) -> dict[str, np.ndarray]:
        """Samples `num_prompts` prompts x `group_size` completions.

        `seed` (with `stream`, default this runner's index, so runners sharing a round seed
        draw different prompts) makes a round reproducible: it picks the prompts and seeds
        the sampler. `weights`: load these first if newer. Rows get the sample ids
        `first_sample_id + 0..B-1`. Returns a rollout batch (`m2po_rllib.wire.batch`).
        """
        cfg = self.config
        g = cfg.group_size
        num_prompts = num_prompts or cfg.prompts_per_step
        stream = self.worker_index if stream is None else stream
        self._use(weights)
        # one env per prompt, or per sample in multi-turn episodes (the group's g envs reset on
        # the prompt's seed, so they share its problem)
        copies = g if self.multi_turn else 1
        envs = self._envs(num_prompts * copies)
        prompt_ids = []
        for i, env in enumerate(envs):
            prompt_seed = int(np.random.SeedSequence([seed, stream, 0, i // copies]).generate_state(1)[0])
            obs, _ = env.reset(seed=prompt_seed)
            prompt_ids.append(obs["prompt_token_ids"].tolist())

        engine = self.engine
        # Requests draw from seeds base + i; spread the rounds' bases so that consecutive
        # rounds (seed, seed + 1) do not share per-request random streams.
        base = int(np.random.SeedSequence([seed, stream, 1]).generate_state(1)[0] >> 1)
        t0 = time.perf_counter()
        policy_masks = None
        if self.multi_turn:
            episodes = self._play(envs, prompt_ids, greedy=False, seed=base)
        else:
            groups = engine.generate(prompt_ids, self._sampling(n=g, greedy=False, seed=base))
        if cfg.round_delay:  # emulated long-tailed generation time
            time.sleep(round_delay_s(cfg.round_delay, seed, stream))
        t_gen = time.perf_counter() - t0

        t0 = time.perf_counter()
        rows_prompt, rows_resp, rows_logp, rewards, correct = [], [], [], [], []
        if self.multi_turn:  # scored by the env, turn by turn
            from m2po_rllib.rollout.episodes import episode_metrics

            for e in episodes:
                rows_prompt.append(e.prompt_ids)
                rows_resp.append(e.token_ids)
                rows_logp.append(e.logprobs)
                rewards.append(e.reward)
                correct.append(e.correct)
            policy_masks = [e.policy_mask for e in episodes]
            for key, value in episode_metrics(episodes).items():
                self.metrics.log_value(key, value, reduce="mean")
        else:
            for ids, env, completions in zip(prompt_ids, envs, groups):
                for c, verdict in zip(completions, env.unwrapped.score_group([c.text for c in completions])):
                    rows_prompt.append(ids)
                    rows_resp.append(list(c.token_ids))
                    rows_logp.append(list(c.logprobs))
                    rewards.append(float(verdict.reward))
                    correct.append(bool(verdict.correct))
        t_score = time.perf_counter() - t0

        n_rows = len(rewards)
        batch = pack_rollouts(
            rows_prompt, rows_resp, rows_logp, rewards, max(engine.version, 0),
            sample_ids=range(first_sample_id, first_sample_id + n_rows), policy_masks=policy_masks,
        )
        if self._scorer is not None:  # behaviour log-probs in the learner's numerics
            t0 = time.perf_counter()
            batch["engine_logp"] = batch["behavior_logp"]
            batch["behavior_logp"] = self._scorer.score(batch)
            self.metrics.log_value(keys.BEHAVIOR_LOGP_S, time.perf_counter() - t0, reduce="mean")
        n_tokens = int(batch["response_mask"].sum())  # the policy's
        self.metrics.log_value(keys.REWARD_MEAN, float(np.mean(rewards)), reduce="mean")
        self.metrics.log_value(keys.ACCURACY, float(np.mean(correct)), reduce="mean")
        self.metrics.log_value(keys.RESPONSE_LEN, n_tokens / n_rows, reduce="mean")
        self.metrics.log_value(keys.TOKENS_PER_S, n_tokens / max(t_gen, 1e-9), reduce="mean")
        self.metrics.log_value(keys.GENERATE_S, t_gen, reduce="mean")
        self.metrics.log_value(keys.SCORE_S, t_score, reduce="mean")
        self.metrics.log_value(keys.ENGINE_VERSION, engine.version, reduce="max")
        # The verifier's counters (reward/timeouts, reward/errors, fast/slow path, ...).
        for key, count in shared_verifier().metrics(reset=True).items():
            self.metrics.log_value(key, count, reduce="sum")
        self.metrics.log_value("num_env_steps_sampled_lifetime", n_rows, reduce="lifetime_sum")
        self.metrics.log_value("num_episodes_lifetime", n_rows, reduce="lifetime_sum")
        return batch

    def num_problems(self, split: str = "heldout") -> int | None:
        """Problems in `split` (None: the task generates any index)."""
        return self._split_env(split).unwrapped.num_problems

    def evaluate(
        self,
        *,
        indices: list[int],
        samples: int = 1,
        seed: int = 0,
        split: str = "heldout",
        weights: PublishedWeights | None = None,
    ) -> dict[str, Any]:
        """Scores problems `indices` of `split`: greedy accuracy, and mean@k with `samples` > 1.

        Returns counts (not means) so results from several runners add up exactly.
        """
        self._use(weights)
        env = self._split_env(split)
        prompt_ids = []
        for i in indices:
            obs, _ = env.reset(options={"index": int(i)})
            prompt_ids.append(obs["prompt_token_ids"].tolist())
        engine = self.engine
        out = {"n": len(indices), "greedy_correct": 0, "sampled_correct": 0, "sampled_n": 0, "tokens": 0}
        if self.multi_turn:
            return self._evaluate_episodes(indices, samples, seed, split, out)
        greedy = engine.generate(prompt_ids, self._sampling(n=1, greedy=True, seed=seed))
        sampled = (
            engine.generate(prompt_ids, self._sampling(n=samples, greedy=False, seed=seed))
            if samples > 1
            else [[] for _ in indices]
        )
        for i, first, group in zip(indices, greedy, sampled):
            env.reset(options={"index": int(i)})
            verdicts = env.unwrapped.score_group([first[0].text] + [c.text for c in group])
            out["greedy_correct"] += int(verdicts[0].reward > 0)
            out["tokens"] += len(first[0].token_ids)
            out["sampled_correct"] += sum(int(v.reward > 0) for v in verdicts[1:])
            out["sampled_n"] += len(group)
        return out

    def _evaluate_episodes(self, indices, samples: int, seed: int, split: str, out: dict) -> dict[str, Any]:
        """`evaluate` for multi-turn envs: a greedy episode per problem (and `samples` sampled
        ones with samples > 1), each on its own env."""
        pool = self._eval_episode_envs.setdefault(split, [])
        for greedy, k in [(True, 1)] + ([(False, samples)] if samples > 1 else []):
            while len(pool) < len(indices) * k:
                pool.append(self._make_env(split=split))
            envs = pool[: len(indices) * k]  # k episodes of problem indices[j // k]
            first = [env.reset(options={"index": int(indices[j // k])})[0]["prompt_token_ids"].tolist()
                     for j, env in enumerate(envs)]
            episodes = self._play(envs, first, greedy=greedy, seed=seed)
            if greedy:
                out["greedy_correct"] += sum(int(e.reward > 0) for e in episodes)
                out["tokens"] += sum(e.policy_tokens for e in episodes)
            else:
                out["sampled_correct"] += sum(int(e.reward > 0) for e in episodes)
                out["sampled_n"] += len(episodes)
        return out

    @override(EnvRunner)
    def get_metrics(self):
        return self.metrics.reduce()

    # -- state ----------------------------------------------------------------------------
    @override(Checkpointable)
    def set_state(self, state: dict) -> None:
        # RLlib sends remote runners the module state as one ObjectRef nested in the dict
        # (`sync_env_runner_states`, `sync_weights`); Ray resolves only top-level arguments.
        module_state = state.get(COMPONENT_RL_MODULE)
        if isinstance(module_state, ray.ObjectRef):
            module_state = ray.get(module_state)
        module_state = (module_state or {}).get(DEFAULT_MODULE_ID)
        if module_state and "weights" in module_state:
            self._load(int(module_state["policy_version"]), lambda: module_state["weights"])

    @override(Checkpointable)
    def get_state(self, components=None, *, not_components=None, **kwargs) -> dict:
        return {"engine_version": self._engine.version if self._engine is not None else -1}

    @override(Checkpointable)
    def get_ctor_args_and_kwargs(self):
        return ((), {"config": self.config})

    @override(EnvRunner)
    def stop(self) -> None:
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None
        for env in self._train_envs:
            env.close()
        for env in [*self._eval_envs.values(), *(e for pool in self._eval_episode_envs.values() for e in pool)]:
            env.close()

    def __del__(self):
        pass

    def ping(self) -> str:
        # RLlib pings a runner it marked unhealthy. With a dead engine, end this actor's
        # process: Ray restarts the actor (max_num_env_runner_restarts), and its next
        # request carries the current weights.
        if self.worker_index > 0 and self._engine is not None and not self._engine.is_healthy():
            logger.error("EnvRunner %d: rollout engine is dead; exiting for a restart", self.worker_index)
            os._exit(1)
        return "pong"


def sample_and_metrics(runner: LLMEnvRunner, **kwargs) -> tuple[dict[str, np.ndarray], dict, float]:
    """One remote call: a round (see `LLMEnvRunner.sample`), the runner's metrics, and the
    seconds it spent on the round (for the runners' idle fraction)."""
    t0 = time.perf_counter()
    batch = runner.sample(**kwargs)
    return batch, runner.get_metrics(), time.perf_counter() - t0
