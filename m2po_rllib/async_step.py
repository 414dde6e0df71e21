"""The asynchronous beat of `M2PO.training_step` (`async_rollouts=True`), the way RLlib's
APPO/IMPALA overlap sampling and learning: keep rounds in flight on every remote EnvRunner
(`foreach_env_runner_async` / `fetch_ready_async_reqs`), admitted only if they will be
trained within `max_staleness` updates of the weights that made them (the bookkeeping and
the rule are in async_rollouts.py); collect what is ready; dispatch the next step to the
learners without waiting (`LearnerGroup.update(async_update=True)` with remote learners);
publish the weights an update returns, so the next requests carry them.

A mixin of `M2PO`, which owns the state it uses (`_async`, `_weights`, `_dispatched_version`,
`_pending_results`) and the shared beats (`_update`, `_take_update_results`).
"""

from __future__ import annotations

import logging
import time

from ray.rllib.utils.metrics import (
    ENV_RUNNER_RESULTS,
    ENV_RUNNER_SAMPLING_TIMER,
    LEARNER_UPDATE_TIMER,
    SYNCH_WORKER_WEIGHTS_TIMER,
    TIMERS,
)

from m2po_rllib.rollout.batch import concat_rollouts
from m2po_rllib.rollout.env_runner import round_seed, sample_and_metrics

logger = logging.getLogger(__name__)

QUEUE_LEN = "staleness/queue_len"
DROPPED_ROWS = "staleness/dropped_rows"
ROUNDS_IN_FLIGHT = "async/rounds_in_flight"
SAMPLE_TAG = "m2po_sample"
POLL_S = 0.002  # between polls of the in-flight requests when nothing is ready


class AsyncTrainingStep:
    def _async_training_step(self) -> None:
        cfg = self.config
        pipe = self._async
        remote_learners = self.learner_group.is_remote
        max_updates_in_flight = 2 if remote_learners else 1
        deadline = time.monotonic() + cfg.sample_timeout_s
        while True:
            with self.metrics.log_time((TIMERS, ENV_RUNNER_SAMPLING_TIMER)):
                progressed = self._collect_rounds()
                self._request_rounds()
            if remote_learners and self._updates_in_flight:
                progressed |= self._take_update_results(self._fetch_ready_updates())
            if pipe.step_ready() and self._updates_in_flight < max_updates_in_flight:
                batches = pipe.pop_step(self._dispatched_version)
                if batches is not None:
                    break
                progressed = True  # rounds over the bound were dropped and re-requested
            if progressed:
                deadline = time.monotonic() + cfg.sample_timeout_s
            elif time.monotonic() > deadline:
                raise RuntimeError(
                    f"async rollouts made no progress for {cfg.sample_timeout_s} s (rounds in flight: "
                    f"{pipe.num_in_flight()}, healthy runners: {self.env_runner_group.healthy_env_runner_ids()}, "
                    f"updates in flight: {self._updates_in_flight}); see the runners' logs, or raise "
                    "`sample_timeout_s` if one round takes longer"
                )
            else:
                time.sleep(POLL_S)

        self.metrics.log_value(DROPPED_ROWS, pipe.dropped_rows, window=1)
        self.metrics.log_value(ROUNDS_IN_FLIGHT, pipe.num_in_flight(), window=1)
        self.metrics.log_value(QUEUE_LEN, len(pipe.arrived), window=1)
        batch = concat_rollouts(batches)
        with self.metrics.log_time((TIMERS, LEARNER_UPDATE_TIMER)):
            results = self._update(batch, async_update=remote_learners)
        with self.metrics.log_time((TIMERS, SYNCH_WORKER_WEIGHTS_TIMER)):
            self._take_update_results(results)
            self._request_rounds()  # the new weights go out with the next requests at once

    def _collect_rounds(self) -> bool:
        """Files the rounds that are ready; requeues those of runners that died."""
        group, pipe = self.env_runner_group, self._async
        ready = group.fetch_ready_async_reqs(tags=SAMPLE_TAG, timeout_seconds=0.0)
        for runner_id, (batch, metrics, busy_s) in ready:
            pipe.received(runner_id, batch)
            self.metrics.aggregate([metrics], key=ENV_RUNNER_RESULTS)
            self._iter.runner_busy_s += busy_s
        healthy = set(group.healthy_env_runner_ids())
        lost = [r for r in list(pipe.in_flight) if r not in healthy and pipe.num_in_flight(r)]
        for runner_id in lost:
            rounds = pipe.lost(runner_id)
            logger.warning("EnvRunner %d failed with rounds %s in flight; requesting them again", runner_id, rounds)
        if len(healthy) < group.num_remote_env_runners():
            self.restore_env_runners(group)
        return bool(ready or lost)

    def _request_rounds(self) -> None:
        """Sends every admissible round to a runner with room for one more request."""
        cfg, group, pipe = self.config, self.env_runner_group, self._async
        per_runner = cfg.prompts_per_step // cfg.num_env_runners
        for runner_id in group.healthy_env_runner_ids():
            while pipe.num_in_flight(runner_id) < cfg.max_requests_in_flight_per_env_runner:
                n = pipe.next_request(self._weights.version, self._dispatched_version)
                if n is None:
                    return
                sent = group.foreach_env_runner_async(
                    sample_and_metrics,
                    tag=SAMPLE_TAG,
                    kwargs=dict(
                        num_prompts=per_runner, seed=round_seed(cfg.seed, n), stream=0,
                        weights=self._weights, first_sample_id=n * pipe.rows_per_round,
                    ),
                    remote_worker_ids=[runner_id],
                )
                if not sent:
                    break  # RLlib's in-flight limit for this runner
                pipe.sent(runner_id, n)

    def _fetch_ready_updates(self) -> list[dict]:
        """Results of asynchronous updates that are done, without sending another one
        (`LearnerGroup.update(async_update=True)` polls the same way before it sends; Ray
        2.60 has no public call for it)."""
        group = self.learner_group
        return group._get_results(group._worker_manager.fetch_ready_async_reqs(timeout_seconds=0.0))

    def _drain(self) -> None:
        """Waits for every round and update in flight, so the state loses nothing."""
        if self._async is None:
            return
        deadline = time.monotonic() + self.config.sample_timeout_s
        while (self._async.num_in_flight() or self._updates_in_flight) and time.monotonic() < deadline:
            self._collect_rounds()
            if self._updates_in_flight:
                self._take_update_results(self._fetch_ready_updates())
            time.sleep(POLL_S)
        if self._async.num_in_flight() or self._updates_in_flight:
            raise RuntimeError(
                f"checkpoint: {self._async.num_in_flight()} rounds and {self._updates_in_flight} updates "
                f"still in flight after {self.config.sample_timeout_s} s"
            )
