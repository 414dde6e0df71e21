"""`EngineHost`: one EnvRunner's generation engine, its life and health, the `BehaviorScorer`
beside it, and the one intake of weights.

Weights reach a runner three ways (a request's `PublishedWeights`, RLlib's own `set_state`
syncs, the learner's native broadcast); all three go through `EngineHost`, which applies
one rule: weights are loaded only when their version is newer than the runner's
(`version`: the engine's, or what waits for the engine to start), so a late or duplicate
handle never rolls the policy back, and weights change between rounds, never within one,
except where a streaming runner loads them mid-sequence (`inflight_weight_updates`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from m2po_rllib.common import keys
from m2po_rllib.common.threads import cpus
from m2po_rllib.wire.weights import PublishedWeights

logger = logging.getLogger(__name__)

# colocate=True with vLLM: its share of the GPU (gpu_memory_utilization) unless engine_kwargs
# sets one; the learner's weights, gradients and AdamW moments hold the rest (`m2po plan`).
COLOCATED_GPU_MEMORY_UTILIZATION = 0.4


def engine_settings(config) -> dict[str, Any]:
    """What an engine needs from an M2POConfig, as plain picklable values."""
    model_config = dict(config.model_config or {})
    return {
        "kind": config.resolved_rollout_engine(),
        "model": model_config.get("model"),
        "dtype": model_config["dtype"],
        "head_dtype": model_config.get("head_dtype"),
        "engine_kwargs": dict(config.engine_kwargs or {}),
        # the training runners of a native sync build vLLM's receive path (evaluation runners
        # are not in the learner's group: the object store brings theirs)
        "weight_transport": (
            config.resolved_weight_sync_backend()
            if config.native_weight_sync and not config.in_evaluation
            else "object_store"
        ),
    }


def model_path(config) -> str:
    """The local directory of the config's model (a built-in name or hub id resolved)."""
    from m2po_rllib.models.builtin import resolve_model_path

    return resolve_model_path(engine_settings(config)["model"])


class EngineHost:
    """The engine of runner `worker_index` (0: the local runner), started on first use.

    A dead engine is restarted in place on the local runner; on a remote runner `engine`
    raises `EngineDeadError`, so that RLlib replaces the whole actor (its next request then
    carries the current weights). `metrics`: the runner's MetricsLogger.
    """

    def __init__(self, config, worker_index: int, seed: int | None, metrics) -> None:
        self.config = config
        self.worker_index = worker_index
        self.seed = seed
        self.metrics = metrics
        self._engine = None
        self.scorer = None  # BehaviorScorer, with the engine, when this runner scores its rounds
        # Weights that arrived before the engine started (loaded at its start), and, on the
        # local runner, the copy an in-place engine restart reloads. A remote runner drops
        # them once loaded: a restart replaces the whole actor.
        self._pending: tuple[dict, int] | None = None
        self._said_no_sleep = False

    # -- the engine's life ----------------------------------------------------------------
    @property
    def started(self) -> bool:
        return self._engine is not None

    @property
    def dead(self) -> bool:
        """The engine was started and has died since."""
        return self._engine is not None and not self._engine.is_healthy()

    @property
    def engine(self):
        if self.dead:
            if self.worker_index > 0:
                from m2po_rllib.rollout.engine import EngineDeadError

                raise EngineDeadError(
                    f"EnvRunner {self.worker_index}: the rollout engine died; RLlib's "
                    "restart_failed_env_runners replaces this runner"
                )
            logger.warning("rollout engine is unhealthy; restarting it")
            self._shutdown_engine()
        if self._engine is None:
            self._start()
        return self._engine

    def _start(self) -> None:
        from m2po_rllib.rollout.engine import make_engine

        settings = engine_settings(self.config)
        kwargs = dict(settings["engine_kwargs"])
        kwargs.setdefault("dtype", settings["dtype"])
        if settings["head_dtype"]:  # the LM head as the learner computes it (model_config["head_dtype"])
            kwargs.setdefault("head_dtype", settings["head_dtype"])
        if settings["kind"] == "vllm":
            kwargs.setdefault("weight_transport", settings["weight_transport"])
            if self.config.colocate:  # the learner's GPU: a share of its memory, given back during updates
                kwargs.setdefault("sleep_mode", True)
                kwargs.setdefault("gpu_memory_utilization", COLOCATED_GPU_MEMORY_UTILIZATION)
            if self.worker_index > 0:  # a runner actor: the process is the engine's own
                kwargs.setdefault("num_threads", cpus(self.config.num_cpus_per_env_runner))
                kwargs.setdefault("core", "auto")  # inline on CPU (vllm_cpu.py)
            else:  # the algorithm's own process (validation refuses an inline core without remote runners)
                kwargs.pop("core", None)
        if self.seed is not None:
            kwargs.setdefault("seed", self.seed)
        path = model_path(self.config)
        t0 = time.perf_counter()
        engine = make_engine(settings["kind"], path, **kwargs)
        self.metrics.log_value(keys.ENGINE_START_S, time.perf_counter() - t0, reduce="mean")
        try:  # the engine is this runner's only with its scorer, when it scores its rounds
            scorer = None
            if self.config.runners_recompute_behavior_logp:
                from m2po_rllib.rollout.scorer import BehaviorScorer

                scorer = BehaviorScorer.beside(engine, self.config, path)
        except BaseException:
            engine.shutdown()
            raise
        self._engine, self.scorer = engine, scorer
        if self._pending is not None:
            weights, version = self._pending
            self._apply(weights, version)

    def _shutdown_engine(self) -> None:
        try:
            self._engine.shutdown()
        except Exception:  # a dead engine may fail to shut down; it is replaced anyway
            pass
        self._engine = self.scorer = None

    def shutdown(self) -> None:
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = self.scorer = None

    # -- sleep (colocate=True) ---------------------------------------------------------------
    def sleep(self) -> bool:
        """Frees the engine's accelerator memory while the learner beside it updates. False
        when it stays awake: not started yet, or no sleep mode here (said once in the log)."""
        if self._engine is None:
            return False
        if self._engine.sleep():
            return True
        if not self._said_no_sleep:
            self._said_no_sleep = True
            logger.warning("colocate: the rollout engine stays awake during the learner's updates (%s); the sleep "
                           "step is skipped", self._engine.sleep_unavailable)
        return False

    def wake_up(self) -> None:
        if self._engine is not None:
            self._engine.wake_up()

    @property
    def served_version(self) -> int:
        """The version of the engine's weights; -1 before it starts (this does not start it)."""
        return self._engine.version if self._engine is not None else -1

    # -- the one intake of weights --------------------------------------------------------
    @property
    def version(self) -> int:
        """Version of the newest weights this runner has: served by its engine, or waiting
        for the engine to start. -1 before any."""
        if self._engine is not None:
            return self._engine.version
        return self._pending[1] if self._pending is not None else -1

    def load(self, version: int, fetch: Callable[[], dict], mid_sequence: bool = False,
             before_load: Callable[[], None] | None = None) -> None:
        """Loads the weights `fetch()` returns if `version` is newer than this runner's (the
        one check: older or duplicate versions are never fetched nor loaded); `mid_sequence`:
        with streamed groups in flight (`GenerationEngine.update_weights`); `before_load`: run
        just before the engine's weights change (a streaming runner's rows scored so far)."""
        if version <= self.version:
            return
        weights = fetch()
        if self._engine is not None and self._engine.is_healthy():
            if before_load is not None:
                before_load()
            t0 = time.perf_counter()
            self._apply(weights, version, mid_sequence)
            self.metrics.log_value(keys.WEIGHT_SYNC_S, time.perf_counter() - t0, reduce="mean")
            self._pending = (weights, version) if self.worker_index == 0 else None
        else:
            self._pending = (weights, version)

    def _apply(self, weights, version: int, mid_sequence: bool = False) -> bool:
        loaded = self._engine.update_weights(weights, version, mid_sequence=mid_sequence)
        if loaded and self.scorer is not None:
            self.scorer.load(weights)
        return loaded

    def use(self, published: PublishedWeights | None, mid_sequence: bool = False,
            before_load: Callable[[], None] | None = None) -> None:
        """A request's weights: loaded if newer (the object store's path). Native ones were
        broadcast to the engine (`receive`); a runner without them (it restarted and the group
        is not formed again yet) samples with what it serves, and its rows say which version."""
        if published is None:
            return
        if published.native:
            if published.version > self.version:
                logger.warning("EnvRunner %d serves version %d; version %d went by native sync without it",
                               self.worker_index, self.version, published.version)
            return
        self.load(published.version, published.get, mid_sequence, before_load)

    # -- native weight sync (weight_sync="native") -----------------------------------------
    def layout(self) -> dict[str, list[int]]:
        """The parameter names and shapes of this runner's model (checked before the group
        opens), its engine started first: an engine that cannot start fails here, where the
        learner gets the error at once, not in the join, where it would wait for this rank
        until the group's timeout (300 s)."""
        from m2po_rllib.sync.transports import weight_layout

        self.engine  # noqa: B018 (started, or its error raised)
        return weight_layout(model_path(self.config))

    def join(self, init_info: dict) -> None:
        """Joins the learner's group (a new one replaces the last); starts the engine if needed."""
        self.engine.join_weight_group(init_info)

    def receive(self, update_info: dict, version: int, mid_sequence: bool = False) -> bool:
        """Receives one broadcast as `version`, whatever the version (a rank that stays out of
        a collective hangs it): between rounds (Ray runs a runner's calls one at a time), or,
        `mid_sequence`, between two decoding steps of a streaming runner's groups."""
        from m2po_rllib.sync.transports import BroadcastWeights

        t0 = time.perf_counter()
        loaded = self.engine.update_weights(BroadcastWeights(**update_info), version, mid_sequence=mid_sequence)
        self._pending = None  # superseded
        self.metrics.log_value(keys.WEIGHT_SYNC_S, time.perf_counter() - t0, reduce="mean")
        return loaded
