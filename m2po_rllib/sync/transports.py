"""How the learner's weights reach the vLLM workers: `WeightTransport` and its two paths.

- `ObjectStoreTransport` ("object_store"; the CPU default, and the fallback everywhere): the
  tensors reach the EnvRunner through the Ray object store (`PublishedWeights`), are cast
  to the served dtype, packed into safetensors byte strings of at most `chunk_bytes` each
  and sent with `collective_rpc` to `WeightSyncExtension` (`vllm_worker.py`) in every vLLM worker (a copy per
  hop over vLLM's ZMQ socket). One layerwise-reload session spans all chunks, so fused or
  repacked kernel weights are rebuilt once, whole.
- `NativeTransport` (vLLM 0.32's weight-transfer API, `LLM(weight_transfer_config=...)`):
  the learner is rank 0 of a group whose other ranks are the vLLM workers of every
  EnvRunner (`NativeWeightSender` in sender.py, around vLLM's trainer engine); it broadcasts the tensors
  in buckets while each runner, sent only their names, dtypes and shapes
  (`BroadcastWeights`), receives them inside `start_weight_update` / `update_weights` /
  `finish_weight_update`. Backend "nccl" (vLLM's, GPU to GPU; NCCL refuses two ranks on
  one GPU, so a learner sharing a GPU with vLLM keeps the object-store path) or "gloo"
  (`gloo.py`: the same protocol over a gloo group, registered with vLLM as
  "m2po_gloo"; any machine, and how the protocol is tested on CPU).

Which one a run uses is the config's (`M2POConfig.resolved_weight_sync_backend`). Versions stay with `GenerationEngine.update_weights`; a collective
cannot skip a rank, so the sender only ever broadcasts a version newer than any before (see
`NativeWeightSender`).
"""

from __future__ import annotations

import abc
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from typing import Any, ClassVar, Protocol

import torch

DEFAULT_SYNC_CHUNK_BYTES = 256 * 2**20
TRANSPORTS = ("auto", "object_store", "nccl", "gloo")
NATIVE_BACKENDS = {"nccl": "nccl", "gloo": "m2po_gloo"}  # transport -> vLLM's weight_transfer_config backend


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
            kwargs["worker_extension_cls"] = "m2po_rllib.sync.gloo.GlooWeightSyncExtension"
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
