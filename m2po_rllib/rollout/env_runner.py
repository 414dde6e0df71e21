"""`LLMEnvRunner`: an RLlib EnvRunner whose policy is a generation engine (vLLM or HF).

The runner holds the text envs (bound to the policy's tokenizer) and RLlib's EnvRunner API;
its jobs live beside it, one file each:
- `engine_host.py` (`EngineHost`): the engine's life and health, the `BehaviorScorer`
  beside it, and the one intake of weights (a request's `PublishedWeights`, RLlib's
  `set_state`, the learner's native broadcast): loaded between rounds, never in the middle
  of one, and only when newer than what the runner has;
- `rounds.py`: one sampling round, one plain function per mode (single-turn groups,
  multi-turn episodes);
- `streaming.py` (`RoundStream`, with `streaming=True`): rounds streamed through the engine
  by a background thread, so that the next round's groups start as the last one's finish;
- `evaluate.py`: held-out scoring, one function per mode.

One round of `sample()`: take the request's weights if newer, reset one env per prompt,
generate and score the round, pack it (`wire.batch.pack_rollouts`) tagged with the version
of the engine's weights and a sample id per completion; with `recompute_behavior_logp` in
async mode the scorer rescores it in the learner's numerics, keeping the engine's
log-probs as `engine_logp`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
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
from m2po_rllib.common import keys
from m2po_rllib.common.errors import ConfigError
from m2po_rllib.rollout.engine_host import EngineHost, model_path
from m2po_rllib.rollout.evaluate import evaluate_episodes, evaluate_single_turn
from m2po_rllib.rollout.rounds import (
    episode_rows, request_base, reset_prompts, round_delay_s, sampling_config, single_turn_rows, turn_sampling,
)
from m2po_rllib.common.threads import use_cpus
from m2po_rllib.rollout.streaming import RoundPlan, RoundStream
from m2po_rllib.rollout.segments import splice
from m2po_rllib.wire.batch import pack_rollouts
from m2po_rllib.wire.weights import PublishedWeights

logger = logging.getLogger(__name__)


def make_text_env(env_id: str, env_config: dict, **overrides) -> gym.Env:
    import envs  # noqa: F401  (registers the m2po/* ids)

    return gym.make(env_id, disable_env_checker=True, **{**dict(env_config), **overrides})


class LLMEnvRunner(EnvRunner, Checkpointable):
    """Samples grouped completions for verifiable text tasks with an LLM engine."""

    def __init__(self, *, config, **kwargs):
        super().__init__(config=config, **kwargs)
        self.worker_index = kwargs.get("worker_index") or 0
        if self.worker_index > 0:
            # A runner actor computes with the CPUs Ray gave it, no more (on a small machine
            # oversubscribed torch threads slow every process beside it 10x and more).
            use_cpus(config.num_cpus_per_env_runner)
        self.host = EngineHost(config, self.worker_index, self._seed, self.metrics)
        self._tokenizer = None
        self._train_envs: list[gym.Env] = []
        self._eval_envs: dict[str, gym.Env] = {}
        self._eval_episode_envs: dict[str, list[gym.Env]] = {}  # multi-turn evaluation: one per episode
        self._stream: RoundStream | None = None  # streaming=True: started by the first `stream` call
        self.make_env()

    # -- envs -----------------------------------------------------------------------------
    def make_env(self):
        self._close_envs()
        # One env tells the spaces; the rest are made on first use (one per prompt).
        self.env = self._make_env()
        # Episodes of several policy turns (feedback, tools) go through the episode loop
        # (episodes.py); single-turn ones keep the grouped fast path.
        self.multi_turn = bool(getattr(self.env.unwrapped, "multi_turn", False))
        self._train_envs = [self.env]

    def _envs(self, n: int, slot: int = 0) -> list[gym.Env]:
        """Env set `slot` of `n` training envs (streaming holds several rounds at once, each its own)."""
        while len(self._train_envs) < (slot + 1) * n:
            self._train_envs.append(self._make_env())
        return self._train_envs[slot * n:(slot + 1) * n]

    def _split_env(self, split: str) -> gym.Env:
        if split not in self._eval_envs:
            self._eval_envs[split] = self._make_env(split=split)
        return self._eval_envs[split]

    def _episode_envs(self, split: str, n: int) -> list[gym.Env]:
        pool = self._eval_episode_envs.setdefault(split, [])
        while len(pool) < n:
            pool.append(self._make_env(split=split))
        return pool[:n]

    def _close_envs(self) -> None:
        for env in [*self._train_envs, *self._eval_envs.values(),
                    *(e for pool in self._eval_episode_envs.values() for e in pool)]:
            env.close()
        self._train_envs, self._eval_envs, self._eval_episode_envs = [], {}, {}

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

            self._tokenizer = AutoTokenizer.from_pretrained(model_path(self.config))
        return self._tokenizer

    @property
    def engine(self):
        """The engine, started on first use (the local runner of a multi-runner job never
        samples, so it never pays for one); see `EngineHost.engine` for a dead one."""
        return self.host.engine

    @property
    def max_episode_turns(self) -> int:
        """The turn cap: the env's own, or the runner's `max_episode_turns` if lower."""
        env_turns = int(getattr(self.env.unwrapped, "max_turns", 1))
        cap = self.config.max_episode_turns
        return env_turns if cap is None else min(env_turns, int(cap))

    def num_problems(self, split: str = "heldout") -> int | None:
        """Problems in `split` (None: the task generates any index)."""
        return self._split_env(split).unwrapped.num_problems

    # -- native weight sync (weight_sync="native"): the learner's RunnerGroupClient calls these --
    def m2po_weight_layout(self) -> dict[str, list[int]]:
        return self.host.layout()

    def m2po_join_weight_group(self, init_info: dict) -> None:
        self.host.join(init_info)

    def m2po_receive_weights(self, update_info: dict, version: int) -> bool:
        if self._stream is not None:  # streaming (inflight_weight_updates): between two decoding steps
            with self._stream.between_steps():
                return self.host.receive(update_info, version, mid_sequence=True)
        return self.host.receive(update_info, version)

    def m2po_stream_snapshot(self) -> list[dict] | None:
        """Streaming: the rounds this runner holds, as far as they got (`RoundStream.snapshot`;
        None where they cannot be handed over); [] when it streams nothing."""
        return self._stream.snapshot() if self._stream is not None else []

    # -- colocate=True: the driver puts the engine to sleep around each learner update ----------
    def m2po_sleep(self) -> bool:
        return self.host.sleep()

    def m2po_wake_up(self) -> None:
        self.host.wake_up()

    # -- RLlib EnvRunner API ----------------------------------------------------------------
    @override(EnvRunner)
    def assert_healthy(self):
        assert self.env is not None, "LLMEnvRunner has no env"
        assert not self.host.dead, "rollout engine is dead"

    @override(EnvRunner)
    def get_spaces(self):
        return {
            "__env__": (self.env.observation_space, self.env.action_space),
            DEFAULT_MODULE_ID: (self.env.observation_space, self.env.action_space),
        }

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
        self.host.use(weights)
        engine = self.engine
        plan = self.plan_round(dict(num_prompts=num_prompts, seed=seed, stream=stream))
        if plan.multi_turn:
            rows = episode_rows(engine, plan.envs, plan.prompt_ids, plan.sampling, max_turns=plan.max_turns,
                                max_tokens=plan.max_tokens)
        else:
            rows = single_turn_rows(engine, plan.envs, plan.prompt_ids, plan.sampling)
        if cfg.round_delay:  # emulated long-tailed generation time
            delay = round_delay_s(cfg.round_delay, seed, self.worker_index if stream is None else stream)
            time.sleep(delay)
            rows.generate_s += delay
        return self.pack_round(rows, first_sample_id, engine.version)

    def plan_round(self, request: dict, slot: int = 0) -> RoundPlan:
        """A round's envs (set `slot`), reset on its prompts, and its sampling settings, from
        `num_prompts` (None: prompts_per_step), `seed` and `stream` (None: this runner's index)
        as `sample` takes them. Single-turn: one env per prompt, one group each; multi-turn: one
        env per sample (a group's envs reset on its prompt's seed, so they share its problem)."""
        cfg = self.config
        num_prompts = request.get("num_prompts") or cfg.prompts_per_step
        seed = int(request.get("seed", 0))
        stream = self.worker_index if request.get("stream") is None else int(request["stream"])
        base = request_base(seed, stream)
        if self.multi_turn:
            envs = self._envs(num_prompts * cfg.group_size, slot)
            return RoundPlan(envs, reset_prompts(envs, seed, stream, cfg.group_size),
                             turn_sampling(cfg, self.env, greedy=False, seed=base), multi_turn=True,
                             max_turns=self.max_episode_turns, max_tokens=cfg.max_episode_tokens)
        envs = self._envs(num_prompts, slot)
        sampling = sampling_config(cfg, self.env, n=cfg.group_size, greedy=False, seed=base)
        return RoundPlan(envs, reset_prompts(envs, seed, stream, 1), sampling)

    def pack_round(self, rows, first_sample_id: int, version: int) -> dict[str, np.ndarray]:
        """A scored round as a rollout batch: sample ids from `first_sample_id`, tagged with the
        generating `version`; rescored in the learner's numerics when this runner scores."""
        n_rows = len(rows.rewards)
        # an engine that has loaded nothing yet (-1) serves the initial weights, version 0
        token_versions = [None if v is None else [max(x, 0) for x in v] for v in rows.versions] or None
        batch = pack_rollouts(
            rows.prompts, rows.responses, rows.logprobs, rows.rewards, max(version, 0),
            sample_ids=range(first_sample_id, first_sample_id + n_rows), policy_masks=rows.policy_masks,
            token_versions=token_versions,
        )
        if self.host.scorer is not None:  # behaviour log-probs in the learner's numerics
            t0 = time.perf_counter()
            batch["engine_logp"] = batch["behavior_logp"]
            # tokens sampled by older weights (loaded mid-sequence, or resumed) keep the log-probs
            # scored under those (`rows.scored`: segments.py)
            batch["behavior_logp"] = splice(self.host.scorer.score(batch), rows.scored, batch["response_mask"])
            self.metrics.log_value(keys.BEHAVIOR_LOGP_S, time.perf_counter() - t0, reduce="mean")
        self._log_round(rows, int(batch["response_mask"].sum()), version)
        return batch

    # -- streaming=True -------------------------------------------------------------------
    def stream(self, rounds: list[dict], wait_s: float,
               weights: PublishedWeights | None = None) -> tuple[list[dict[str, np.ndarray]], float]:
        """Streaming sampling's one call (`streaming.py`): queues `rounds` (each `sample`'s
        keyword arguments and `min_version`), waits up to `wait_s` for finished rounds and
        returns them (any order) with the seconds the engine was busy since the last call.
        `weights` (inflight_weight_updates): the newest published, loaded mid-sequence."""
        if self._stream is None:
            # the generating thread logs the rounds' metrics beside Ray's call thread (RLlib's
            # IMPALA learner takes the same lock for its threads)
            self.metrics._threading_lock = threading.RLock()
            self._stream = RoundStream(self.host, self.plan_round, self.pack_round,
                                       inflight_loads=bool(self.config.inflight_weight_updates))
        return self._stream.exchange(rounds, wait_s, weights)

    def _engine_to_self(self):
        """A context in which this call may use the engine: with streaming, once the groups in
        flight are done and while no new ones start."""
        return self._stream.paused() if self._stream is not None else contextlib.nullcontext()

    def _log_round(self, rows, n_tokens: int, version: int) -> None:
        """A round's metrics (`n_tokens`: the policy's)."""
        n_rows = len(rows.rewards)
        for key, value in rows.metrics.items():
            self.metrics.log_value(key, value, reduce="mean")
        self.metrics.log_value(keys.REWARD_MEAN, float(np.mean(rows.rewards)), reduce="mean")
        self.metrics.log_value(keys.ACCURACY, float(np.mean(rows.correct)), reduce="mean")
        self.metrics.log_value(keys.RESPONSE_LEN, n_tokens / n_rows, reduce="mean")
        self.metrics.log_value(keys.TOKENS_PER_S, n_tokens / max(rows.generate_s, 1e-9), reduce="mean")
        self.metrics.log_value(keys.GENERATE_S, rows.generate_s, reduce="mean")
        self.metrics.log_value(keys.SCORE_S, rows.score_s, reduce="mean")
        self.metrics.log_value(keys.ENGINE_VERSION, version, reduce="max")
        # The verifier's counters (reward/timeouts, reward/errors, fast/slow path, ...).
        for key, count in shared_verifier().metrics(reset=True).items():
            self.metrics.log_value(key, count, reduce="sum")
        self.metrics.log_value("num_env_steps_sampled_lifetime", n_rows, reduce="lifetime_sum")
        self.metrics.log_value("num_episodes_lifetime", n_rows, reduce="lifetime_sum")

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
        with self._engine_to_self():
            self.host.use(weights)
            if self.multi_turn:
                return evaluate_episodes(self.engine, self.config, lambda n: self._episode_envs(split, n), indices,
                                         samples=samples, seed=seed, max_turns=self.max_episode_turns)
            return evaluate_single_turn(self.engine, self.config, self._split_env(split), indices,
                                        samples=samples, seed=seed)

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
            with self._engine_to_self():
                self.host.load(int(module_state["policy_version"]), lambda: module_state["weights"])

    @override(Checkpointable)
    def get_state(self, components=None, *, not_components=None, **kwargs) -> dict:
        return {"engine_version": self.host.served_version}

    @override(Checkpointable)
    def get_ctor_args_and_kwargs(self):
        return ((), {"config": self.config})

    @override(EnvRunner)
    def stop(self) -> None:
        if self._stream is not None:
            self._stream.stop()
        self.host.shutdown()
        self._close_envs()

    def __del__(self):
        pass

    def ping(self) -> str:
        # RLlib pings a runner it marked unhealthy. With a dead engine, end this actor's
        # process: Ray restarts the actor (max_num_env_runner_restarts), and its next
        # request carries the current weights.
        if self.worker_index > 0 and (self.host.dead or (self._stream is not None and self._stream.failed)):
            logger.error("EnvRunner %d: rollout engine is dead (or its streaming thread failed); exiting for a "
                         "restart", self.worker_index)
            os._exit(1)
        return "pong"


def sample_and_metrics(runner: LLMEnvRunner, **kwargs) -> tuple[dict[str, np.ndarray], dict, float]:
    """One remote call: a round (see `LLMEnvRunner.sample`), the runner's metrics, and the
    seconds it spent on the round (for the runners' idle fraction)."""
    t0 = time.perf_counter()
    batch = runner.sample(**kwargs)
    return batch, runner.get_metrics(), time.perf_counter() - t0


def stream_and_metrics(runner: LLMEnvRunner, rounds: list[dict], wait_s: float,
                       weights: PublishedWeights | None = None) -> tuple[list[dict], dict, float]:
    """One remote call of streaming sampling (see `LLMEnvRunner.stream`): the rounds finished
    so far, the runner's metrics, and the seconds its engine was busy since the last call."""
    batches, busy_s = runner.stream(rounds, wait_s, weights)
    return batches, runner.get_metrics(), busy_s
