"""`RolloutSampler`: the rounds a training run trains on, requested from the EnvRunners and
handed to the algorithm one training step at a time, in both modes.

It owns, for both modes:
- the numbering. Round n is one request to one runner (`prompts_per_step / R` prompts x
  `group_size` completions, R runners); it belongs to step `n // R`, its prompts and
  sampler are seeded by `round_seed(seed, n)`, and its rows get the sample ids
  `n * rows_per_round + j`, unique over the run;
- the runner calls (`foreach_env_runner` in sync mode; `foreach_env_runner_async` and
  `fetch_ready_async_reqs` in async mode, as RLlib's IMPALA/APPO);
- the steps dispatched to the learners, hence `dispatched_version`: the learner's policy
  version once every dispatched step is trained (a step is `updates_per_step` updates).

Synchronous (the paper's stale-k protocol): `sample()` one round from every runner with
the current weights, `push()` it into the FIFO and get back the step made `staleness`
updates earlier (None while the queue fills).

Asynchronous: `request()` every round the admission rule allows (`admission.py`: no trained
token older than `max_staleness`), `collect()` what is ready (re-requesting the rounds of a
runner that died), `pop_step()` once the next step's rounds are all in. With
`max_staleness="auto"` the bound is a `StalenessController`'s (staleness.py), fed by
`observe_m2()` with what the learners measured. With `streaming=True` (streaming.py) each
runner gets one call at a time (`stream_and_metrics`): the rounds admitted for it since its
last call, each with the oldest weights that may generate it, and back the rounds it
finished, in any order; `poll()` keeps the calls going when nothing new is admitted. With
`inflight_weight_updates` every call also hands over the newest published weights, which the
runner loads between two decoding steps.

Checkpoints: `get_state()` holds the queue (sync) or the arrived rounds and counters
(async; the algorithm drains the rounds in flight first, except with streaming runners that
can hand them over as far as they got: `snapshot_in_flight`, resumed after a restore).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import time
from typing import Any, Callable

import numpy as np

from m2po_rllib.common import keys
from m2po_rllib.rollout.admission import AsyncRollouts
from m2po_rllib.rollout.env_runner import sample_and_metrics, stream_and_metrics
from m2po_rllib.rollout.rounds import round_seed
from m2po_rllib.rollout.runners_down import RunnersDown
from m2po_rllib.rollout.staleness import StalenessController
from m2po_rllib.rollout.streaming import WAIT_S
from m2po_rllib.wire.batch import concat_rollouts
from m2po_rllib.wire.weights import PublishedWeights

logger = logging.getLogger(__name__)

SAMPLE_TAG = "m2po_sample"  # RLlib's tag of our in-flight sample requests
RETRY_S = 1.0  # sync: between attempts to restore runners that returned nothing

Rollout = dict[str, np.ndarray]



def runner_actors(runner_group) -> list:
    """The healthy remote EnvRunners' actor handles, in runner order (a native weight sync's
    targets). Ray 2.60's EnvRunnerGroup exposes them only through its private manager."""
    manager = runner_group._worker_manager
    actors = manager.actors()
    return [actors[i] for i in sorted(manager.healthy_actor_ids())]

class RolloutSampler:
    def __init__(self, config, runners, restore: Callable[[], None], start_version: int):
        """`runners`: the algorithm's EnvRunnerGroup; `restore()` brings failed runners back
        (`Algorithm.restore_env_runners`); `start_version`: the learner's policy version now."""
        self.config = config
        self.runners = runners
        self._restore = restore
        self.remote = runners.num_remote_env_runners() > 0
        self.rounds_per_step = config.num_env_runners if config.async_rollouts else max(1, runners.num_remote_env_runners())
        self.prompts_per_round = config.prompts_per_step // self.rounds_per_step
        self.rows_per_round = self.prompts_per_round * config.group_size
        self.updates_per_step = config.updates_per_step
        # async: the admission bookkeeping (pure, no Ray), its bound fixed or steered by the
        # measured M2; sync: the stale-k FIFO
        self.staleness = (
            StalenessController(**config.staleness_controller_settings())
            if config.async_rollouts and config.auto_staleness
            else None
        )
        self.admission = (
            AsyncRollouts(
                rounds_per_step=self.rounds_per_step, updates_per_step=self.updates_per_step,
                max_staleness=self.staleness or config.max_staleness,
                rows_per_round=self.rows_per_round,
            )
            if config.async_rollouts
            else None
        )
        self.waiting = 0  # async: runner slots the bound held back at the last request
        self.streaming = bool(config.async_rollouts and config.streaming)
        self.inflight_loads = self.streaming and bool(config.inflight_weight_updates)
        self._offered: PublishedWeights | None = None  # the newest weights published (streaming)
        self._calling: set[int] = set()  # streaming: runners with a call in flight
        self._m2_buckets: set[int] = set()  # "auto": the age buckets reported so far
        self.queue: collections.deque[Rollout] = collections.deque()
        self.steps_sampled = 0  # sync: steps whose rounds were sampled
        self._base_version = start_version  # the learner's version before step 0
        self.down = RunnersDown(config)  # while runners are down: what the run waits for
        self._resume: dict[int, dict] = {}  # restored: round -> its resume, until it arrives (stream_snapshot.py)

    # -- both modes ----------------------------------------------------------------------
    @property
    def steps_dispatched(self) -> int:
        if self.admission is not None:
            return self.admission.next_step
        return self.steps_sampled - len(self.queue)

    @property
    def dispatched_version(self) -> int:
        """The learner's policy version once every step dispatched so far is trained."""
        return self._base_version + self.steps_dispatched * self.updates_per_step

    def round_request(self, n: int, weights: PublishedWeights | None) -> dict[str, Any]:
        """The keyword arguments of `LLMEnvRunner.sample` for round n (streaming: and the oldest
        weights version that may generate it)."""
        request = dict(
            num_prompts=self.prompts_per_round, seed=round_seed(self.config.seed, n), stream=0,
            weights=weights, first_sample_id=n * self.rows_per_round,
        )
        if self.streaming:
            request["min_version"] = self.admission.oldest_weights(n, self.dispatched_version)
            request.update(self._resume.get(n, {}))  # a round of a checkpoint, as far as it got
        return request

    def metrics(self) -> dict[str, float]:
        if self.admission is None:
            return {keys.QUEUE_LEN: len(self.queue)}
        out = {
            keys.QUEUE_LEN: len(self.admission.arrived),
            keys.DROPPED_ROWS: self.admission.dropped_rows,
            keys.ROUNDS_IN_FLIGHT: self.admission.num_in_flight(),
            keys.ROUNDS_ADMITTED: self.admission.admitted,
            keys.ROUNDS_WAITING: self.waiting,
            keys.STALENESS_BOUND: self.admission.max_staleness,
        }
        if self.staleness is not None:
            out[keys.STALENESS_BOUND_CHANGES] = self.staleness.changes
            measured = self.staleness.m2_by_bucket()
            self._m2_buckets |= set(measured)
            # a bucket no longer measured reads NaN (the logger would repeat its last value)
            out.update({keys.m2_at_age(b): measured.get(b, float("nan")) for b in sorted(self._m2_buckets)})
        return out

    def observe_m2(self, by_age: dict[int, tuple[float, float]], version: int) -> None:
        """The learners' squared log-ratios by age ({age: (sum, tokens)}) at policy version
        `version`: with max_staleness="auto", the bound for the next requests follows."""
        if self.staleness is not None and by_age:
            self.staleness.observe(by_age, version)

    @contextlib.contextmanager
    def engines_asleep(self, log: Callable[[str, float], None]):
        """Around a learner update with `colocate=True`: the engines sleep (their GPU memory
        goes to the learner beside them) and wake after it. `log(key, seconds)` gets the
        seconds both took (0 where the engines have no sleep mode). Otherwise does nothing."""
        if not self.config.colocate:
            yield
            return
        local = not self.remote
        t0 = time.perf_counter()
        self.runners.foreach_env_runner(lambda runner: runner.m2po_sleep(), local_env_runner=local)
        log(keys.ENGINE_SLEEP_S, time.perf_counter() - t0)
        try:
            yield
        finally:
            t0 = time.perf_counter()
            self.runners.foreach_env_runner(lambda runner: runner.m2po_wake_up(), local_env_runner=local)
            log(keys.ENGINE_WAKE_S, time.perf_counter() - t0)

    # -- synchronous ---------------------------------------------------------------------
    def sample(self, weights: PublishedWeights) -> tuple[Rollout, list[dict], float]:
        """One round from every runner (the local one when there are no remote runners):
        the rollout, the runners' metrics, and the seconds they were busy."""
        cfg = self.config
        first = self.steps_sampled * self.rounds_per_step
        # every runner's request, by worker index (the local runner is 0); the function
        # shipped to the runners holds plain values only
        requests = {i: self.round_request(first + max(0, i - 1), weights) for i in range(self.rounds_per_step + 1)}
        deadline = time.monotonic() + cfg.env_runner_restore_timeout_s + cfg.sample_timeout_s
        while True:
            out = self.runners.foreach_env_runner(
                lambda runner: sample_and_metrics(runner, **requests[runner.worker_index]),
                local_env_runner=not self.remote,
                timeout_seconds=cfg.sample_timeout_s,
            )
            if out:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"no EnvRunner returned samples within {cfg.sample_timeout_s} s, and none could "
                    "be restored; see the runners' logs (raise `sample_timeout_s` for slow rounds)"
                )
            # A failed runner (e.g. a dead vLLM engine) is restarted by Ray; bring it back and
            # sample this round again (requests carry the current weights).
            self._observe_down()
            time.sleep(RETRY_S)
            self._restore()
        if len(out) != self.rounds_per_step:
            logger.warning("%d of %d EnvRunners returned samples this round; training on %d prompts",
                           len(out), self.rounds_per_step, len(out) * self.prompts_per_round)
        self.steps_sampled += 1
        return concat_rollouts([b for b, _, _ in out]), [m for _, m, _ in out], sum(busy for _, _, busy in out)

    def push(self, rollout: Rollout) -> Rollout | None:
        """Queues a sampled step; returns the one `queue_lag_steps` older, or None while the
        queue fills."""
        self.queue.append(rollout)
        if len(self.queue) <= self.config.queue_lag_steps:
            return None
        return self.queue.popleft()

    # -- asynchronous --------------------------------------------------------------------
    def request(self, weights: PublishedWeights) -> None:
        """Sends every admissible round to a runner with room for one more request."""
        if self.admission is None:
            return
        if self.streaming:
            self._offered = weights  # inflight_loads: every call hands the newest over
            self._stream(weights)
            return
        pipe = self.admission
        limit = self.config.max_requests_in_flight_per_env_runner
        healthy = self.runners.healthy_env_runner_ids()
        self.waiting = 0
        for runner_id in healthy:
            while pipe.num_in_flight(runner_id) < limit:
                n = pipe.next_request(weights.version, self.dispatched_version)
                if n is None:  # the bound holds back every free slot
                    self.waiting = sum(max(0, limit - pipe.num_in_flight(r)) for r in healthy)
                    return
                sent = self.runners.foreach_env_runner_async(
                    sample_and_metrics, tag=SAMPLE_TAG, kwargs=self.round_request(n, weights),
                    remote_worker_ids=[runner_id],
                )
                if not sent:
                    break  # RLlib's in-flight limit for this runner
                pipe.sent(runner_id, n)

    def poll(self) -> None:
        """Streaming: a call to every runner with rounds in flight and none pending (new rounds
        are sent by `request`); otherwise nothing."""
        if self.streaming:
            self._stream(None)

    def _stream(self, weights: PublishedWeights | None) -> None:
        """Streaming: one call to each healthy runner without one in flight that has rounds in
        flight or may get new ones (none without `weights`)."""
        pipe = self.admission
        limit = self.config.max_requests_in_flight_per_env_runner
        healthy = self.runners.healthy_env_runner_ids()
        self.waiting = 0
        for runner_id in healthy:
            if runner_id in self._calling:
                continue
            new = []
            while weights is not None and pipe.num_in_flight(runner_id) < limit:
                n = pipe.next_request(weights.version, self.dispatched_version)
                if n is None:
                    self.waiting += limit - pipe.num_in_flight(runner_id)
                    break
                new.append(n)
                pipe.sent(runner_id, n)
            if not new and not pipe.num_in_flight(runner_id):
                continue
            offered = {"weights": self._offered} if self.inflight_loads and self._offered is not None else {}
            sent = self.runners.foreach_env_runner_async(
                stream_and_metrics, tag=SAMPLE_TAG,
                kwargs=dict(rounds=[self.round_request(n, weights) for n in new], wait_s=WAIT_S, **offered),
                remote_worker_ids=[runner_id],
            )
            if not sent:  # RLlib refused the call: the rounds go back to be requested again
                for n in new:
                    pipe.unsent(runner_id, n)
                continue
            self._calling.add(runner_id)

    def collect(self) -> tuple[bool, list[dict], float]:
        """Files the rounds that are ready and re-requests those of runners that died:
        (anything happened, the runners' metrics, the seconds they were busy)."""
        pipe = self.admission
        ready = self.runners.fetch_ready_async_reqs(tags=SAMPLE_TAG, timeout_seconds=0.0)
        metrics, busy = [], 0.0
        filed = 0
        for runner_id, (answer, runner_metrics, busy_s) in ready:
            batches = answer if self.streaming else [answer]
            self._calling.discard(runner_id)
            filed += sum(self._file(runner_id, batch) for batch in batches)
            metrics.append(runner_metrics)
            busy += busy_s
        healthy = set(self.runners.healthy_env_runner_ids())
        self._calling &= healthy  # a failed runner's call is gone with it
        lost = [r for r in list(pipe.in_flight) if r not in healthy and pipe.num_in_flight(r)]
        for runner_id in lost:
            rounds = pipe.lost(runner_id)
            logger.warning("EnvRunner %d failed with rounds %s in flight; requesting them again", runner_id, rounds)
        if len(healthy) < self.runners.num_remote_env_runners():
            self._restore()
        self._observe_down()
        # a streaming call that brought nothing is no progress (the wait for the rounds is)
        return bool(filed or lost or (ready and not self.streaming)), metrics, busy

    def _file(self, runner_id: int, batch: Rollout) -> bool:
        """Files a round a runner returned; False for one requested again since (not filed)."""
        n = self.admission.received(runner_id, batch)
        if n is None:
            logger.warning("EnvRunner %d returned rows from sample %d, requested again since: not filed",
                           runner_id, int(batch["sample_id"][0]))
            return False
        self._resume.pop(n, None)  # a resumed round is back (until then a lost runner's is resumed again)
        return True

    def _observe_down(self) -> None:
        """Tells `RunnersDown` which remote runners are not healthy now."""
        healthy = set(self.runners.healthy_env_runner_ids())
        self.down.observe(sorted(set(range(1, self.runners.num_remote_env_runners() + 1)) - healthy))

    def pop_step(self) -> tuple[Rollout | None, bool]:
        """(the next step's rounds as one batch, or None; whether rounds over the bound were
        dropped and re-requested)."""
        pipe = self.admission
        if not pipe.step_ready():
            return None, False
        dropped = pipe.dropped_rows
        batches = pipe.pop_step(self.dispatched_version)
        if batches is None:
            return None, pipe.dropped_rows > dropped
        return concat_rollouts(batches), False

    def num_in_flight(self) -> int:
        return self.admission.num_in_flight() if self.admission is not None else 0

    # -- checkpoints ---------------------------------------------------------------------
    def snapshot_in_flight(self) -> dict[int, dict] | None:
        """Streaming: the rounds in flight as far as they got, without waiting for them (a
        checkpoint that keeps partial sequences). Call it with no runner call in flight
        (`calls_in_flight`: collect them first; each returns within `WAIT_S`): each runner's
        stream is read (`LLMEnvRunner.m2po_stream_snapshot`), its finished rounds filed, and
        the generating ones' partial groups returned by round. None where a runner cannot hand
        them over (then the caller drains them)."""
        if not self.streaming:
            return None
        if self._calling:
            raise RuntimeError(f"streaming calls to runners {sorted(self._calling)} are in flight: collect them first")
        pipe, partials = self.admission, {}
        for runner_id in [r for r in self.runners.healthy_env_runner_ids() if pipe.num_in_flight(r)]:
            answers = self.runners.foreach_env_runner(lambda runner: runner.m2po_stream_snapshot(),
                                                      remote_worker_ids=[runner_id], local_env_runner=False)
            if not answers or answers[0] is None:
                return None
            for entry in answers[0]:
                if "batch" in entry:
                    self._file(runner_id, entry["batch"])
                elif "resume" in entry:
                    n = int(entry["request"]["first_sample_id"]) // self.rows_per_round
                    partials[n] = {"resume": entry["resume"], "prompt_ids": entry["prompt_ids"]}
        return partials

    @property
    def calls_in_flight(self) -> int:
        """Streaming: runner calls sent and not yet collected."""
        return len(self._calling)

    def get_state(self, partials: dict[int, dict] | None = None) -> dict[str, Any]:
        """`partials`: the rounds in flight as far as they got (`snapshot_in_flight`); they are
        resumed from there after a restore, as are the rounds of an earlier checkpoint not yet
        back (a round still waiting in a runner, or not requested again yet, keeps the partial
        groups it was restored with). Other rounds in flight are requested again whole."""
        return {
            "queue": list(self.queue),
            "steps_sampled": self.steps_sampled,
            "admission": self.admission.get_state() if self.admission is not None else None,
            "staleness": self.staleness.get_state() if self.staleness is not None else None,
            "partials": {**self._resume, **(partials or {})},
        }

    def set_state(self, state: dict[str, Any], learner_version: int) -> None:
        """Restores the counters; `learner_version`: the restored learner's (every step
        dispatched before the checkpoint was trained: it drained them)."""
        self.queue = collections.deque(state["queue"])
        self.steps_sampled = int(state["steps_sampled"])
        self._resume = {int(n): r for n, r in (state.get("partials") or {}).items()}
        if self.admission is not None and state.get("admission") is not None:
            self.admission.set_state(state["admission"])
        if self.staleness is not None and state.get("staleness") is not None:
            self.staleness.set_state(state["staleness"])
        self._base_version = learner_version - self.steps_dispatched * self.updates_per_step
