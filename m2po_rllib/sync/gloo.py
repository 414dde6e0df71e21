"""vLLM's weight-transfer API over gloo: the native path (`LLM(weight_transfer_config=...)`,
`init_weight_transfer_engine` / `start_weight_update` / `update_weights` /
`finish_weight_update`) on machines without NCCL, registered with vLLM as backend
"m2po_gloo".

vLLM 0.32 ships NCCL, IPC and RDMA engines only. This one is the NCCL engine's protocol with
the data plane swapped: a stateless gloo process group (vLLM's
`stateless_init_torch_distributed_process_group`: its own TCPStore, clear of vLLM's and the
learners' torch.distributed groups), and the same packing as vLLM's packed NCCL path
(`pack_tensors`: tensors flattened to bytes and concatenated into buckets of about
`packed_buffer_size_bytes`, the receiver cutting the same bucket boundaries from the names,
dtypes and shapes it is sent). Rank 0 is the learner's sender, the vLLM workers follow.
Each bucket is received into a fresh buffer (layerwise reload keeps references to what it
was handed until a layer is complete).

The same trainer/worker calls select NCCL on CUDA (`weight_sync_backend="auto"`), so the
protocol tested here on CPU (group set-up, versions, a runner joining late, a failed peer)
is the one a GPU cluster runs.

Import this module in every process that builds either side: the vLLM worker imports it
through `GlooWeightSyncExtension` (the `worker_extension_cls` of a `VLLMEngine` asked for
gloo), the learner through `NativeWeightSender`.
"""

from __future__ import annotations

import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import ClassVar

import torch
from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    WeightTransferEngine,
    WeightTransferInitInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory
from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerWeightTransferEngine, NCCLWeightTransferUpdateInfo
from vllm.distributed.weight_transfer.packed_tensor import pack_tensors, unpack_tensor

from m2po_rllib.sync.vllm_worker import WeightSyncExtension

BACKEND = "m2po_gloo"
DEFAULT_BUCKET_BYTES = 64 * 2**20
DEFAULT_TIMEOUT_S = 300.0


def _open_group(address: str, port: int, rank: int, world_size: int, timeout_s: float):
    from vllm.distributed.utils import stateless_init_torch_distributed_process_group

    return stateless_init_torch_distributed_process_group(
        address, port, rank, world_size, backend="gloo", timeout=timedelta(seconds=timeout_s)
    )


def _close_group(group) -> None:
    from vllm.distributed.utils import stateless_destroy_torch_distributed_process_group

    stateless_destroy_torch_distributed_process_group(group)


def _broadcast(group, tensor: torch.Tensor) -> None:
    group.broadcast(tensor, 0).wait()  # ProcessGroup.broadcast(tensor, root): no global rank needed


def bucket_plan(names, dtypes, shapes, bucket_bytes: int) -> list[list[int]]:
    """The indices of the tensors in each bucket, by `pack_tensors`' rule (a bucket closes
    once its bytes pass `bucket_bytes`, the tensor that passed them included): what the
    receiver must cut without seeing the bytes."""
    buckets, current, size = [], [], 0
    for i, (dtype, shape) in enumerate(zip(dtypes, shapes)):
        current.append(i)
        size += torch.Size(shape).numel() * dtype.itemsize
        if size > bucket_bytes:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


# --- the vLLM worker's side ------------------------------------------------------------------


@dataclass(kw_only=True)
class GlooWeightTransferInitInfo(WeightTransferInitInfo):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    packed_buffer_size_bytes: int = DEFAULT_BUCKET_BYTES
    timeout_s: float = DEFAULT_TIMEOUT_S


class GlooWeightTransferEngine(WeightTransferEngine[GlooWeightTransferInitInfo, NCCLWeightTransferUpdateInfo]):
    """Receives the learner's broadcast in a vLLM worker and loads it (layerwise reload)."""

    init_info_cls = GlooWeightTransferInitInfo
    update_info_cls = NCCLWeightTransferUpdateInfo  # names, dtype names, shapes: the same notice as NCCL's

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group = None
        self.bucket_bytes = DEFAULT_BUCKET_BYTES

    def init_transfer_engine(self, init_info: GlooWeightTransferInitInfo) -> None:
        pc = self.parallel_config
        rank = pc.data_parallel_index * pc.world_size + pc.rank + init_info.rank_offset
        self.bucket_bytes = init_info.packed_buffer_size_bytes
        self.shutdown()  # a learner that reconnects (runners joined or restarted): a new group
        self.group = _open_group(init_info.master_address, init_info.master_port, rank, init_info.world_size,
                                 init_info.timeout_s)

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def receive_weights(self, update_info: NCCLWeightTransferUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("gloo weight transfer is not initialised: call init_weight_transfer_engine first")
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        dtypes = [getattr(torch, d) for d in update_info.dtype_names]
        sizes = [torch.Size(s).numel() * d.itemsize for d, s in zip(dtypes, update_info.shapes)]
        with disable_mtp_completeness_check():
            for bucket in bucket_plan(update_info.names, dtypes, update_info.shapes, self.bucket_bytes):
                buf = torch.empty(sum(sizes[i] for i in bucket), dtype=torch.uint8)
                _broadcast(self.group, buf)
                tensors = unpack_tensor(
                    buf, [update_info.names[i] for i in bucket], [update_info.shapes[i] for i in bucket],
                    [dtypes[i] for i in bucket], [sizes[i] for i in bucket],
                )
                self.model.load_weights(tensors)

    def shutdown(self) -> None:
        if self.group is not None:
            _close_group(self.group)
            self.group = None


class GlooWeightSyncExtension(WeightSyncExtension):
    """The worker extension of a `VLLMEngine` with the gloo path: importing it (vLLM does, in
    each worker, before the model loads) registers the "m2po_gloo" engine there."""


# --- the learner's side ----------------------------------------------------------------------


@dataclass
class GlooTrainerInitInfo(TrainerInitInfo):
    backend: ClassVar[str] = BACKEND

    master_address: str
    master_port: int
    world_size: int
    packed_buffer_size_bytes: int = DEFAULT_BUCKET_BYTES
    timeout_s: float = DEFAULT_TIMEOUT_S


class GlooTrainerWeightTransferEngine(TrainerWeightTransferEngine[GlooTrainerInitInfo]):
    """Rank 0 of the group: opens it with the workers, then broadcasts one bucket at a time
    while the workers receive (`client.update_weights` on a side thread, as vLLM's NCCL
    trainer engine does)."""

    init_info_cls = GlooTrainerInitInfo

    def __init__(self, *, client, source, is_sender: bool = True, bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.bucket_bytes = bucket_bytes
        self.group = None

    @classmethod
    def trainer_init(cls, init_info: GlooTrainerInitInfo, *, client, source=None):
        if source is None:
            raise ValueError("the gloo trainer weight transfer needs a WeightSource")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender,
                     bucket_bytes=init_info.packed_buffer_size_bytes)
        if not engine.is_sender:
            return engine
        worker_info = GlooWeightTransferInitInfo(
            master_address=init_info.master_address, master_port=init_info.master_port, rank_offset=1,
            world_size=init_info.world_size, packed_buffer_size_bytes=init_info.packed_buffer_size_bytes,
            timeout_s=init_info.timeout_s,
        )
        pool = ThreadPoolExecutor(max_workers=1)  # the workers block in the rendezvous too
        try:
            joined = pool.submit(engine.client.init_weight_transfer_engine, asdict(worker_info))
            engine.group = _open_group(init_info.master_address, init_info.master_port, 0, init_info.world_size,
                                       init_info.timeout_s)
            joined.result()
        except BaseException:
            engine.shutdown()  # frees the store's port; workers still waiting time out on their own
            raise
        finally:
            pool.shutdown(wait=False)
        return engine

    def send_weights(self) -> None:
        meta = self.source.metadata()
        if not self.is_sender:
            for _ in self.source:  # stay in the trainer-side gathers (sharded learners)
                pass
            return
        notice = NCCLWeightTransferUpdateInfo(
            names=[m.name for m in meta], dtype_names=[str(m.dtype).split(".")[-1] for m in meta],
            shapes=[list(m.shape) for m in meta],
        )
        self.client.start_weight_update()
        pool = ThreadPoolExecutor(max_workers=1)
        try:
            received = pool.submit(self.client.update_weights, asdict(notice))
            if received.done():
                received.result()  # a request refused before any broadcast: say so, do not hang
            pairs = NCCLTrainerWeightTransferEngine._checked_iter(self.source, meta)
            while True:
                with warnings.catch_warnings():  # a tensor bigger than a bucket is a bucket of its own
                    warnings.filterwarnings("ignore", "Tensor .* exceeds buffer_size_bytes")
                    chunk = pack_tensors(pairs, lambda item: item[1].detach().cpu(), self.bucket_bytes)
                if chunk is None:
                    break
                _broadcast(self.group, chunk.packed_tensor)
            received.result()
        finally:
            pool.shutdown(wait=False)  # a failed broadcast leaves the workers blocked: never join them
        self.client.finish_weight_update()

    def shutdown(self) -> None:
        if self.group is not None:
            _close_group(self.group)
            self.group = None


def _register() -> None:
    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, GlooWeightTransferEngine)
    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(BACKEND, GlooTrainerWeightTransferEngine)


_register()
