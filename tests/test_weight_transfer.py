"""The CPU side of the weight transports (`m2po_rllib.rollout.weight_transfer`).

The NCCL broadcast itself needs two GPUs (bench/gpu_vllm_check.py measures it); here: which
transport is chosen, and that what the learner and the runners exchange is what vLLM 0.32's
NCCL weight-transfer engine expects (its own dataclasses and checks parse it). The object-store
path runs against a real vLLM engine in test_engines.py.
"""

from __future__ import annotations

import threading
from dataclasses import asdict

import pytest
import torch

from m2po_rllib.rollout.weight_transfer import (
    NCCLWeights,
    RunnerGroupClient,
    StateDictSource,
    select_transport,
)


@pytest.mark.parametrize(
    "vllm_gpu, trainer_gpu, shared, expected",
    [
        (True, True, False, "nccl"),
        (True, True, True, "object_store"),  # NCCL refuses two ranks on one GPU
        (True, False, False, "object_store"),
        (False, True, False, "object_store"),
        (False, False, False, "object_store"),
    ],
)
def test_auto_picks_nccl_only_between_separate_gpus(vllm_gpu, trainer_gpu, shared, expected):
    assert select_transport("auto", vllm_on_gpu=vllm_gpu, trainer_on_gpu=trainer_gpu, shared_gpu=shared) == expected
    assert select_transport("object_store", vllm_on_gpu=vllm_gpu, trainer_on_gpu=trainer_gpu) == "object_store"


def test_explicit_nccl_without_gpus_or_on_a_shared_gpu_is_a_clear_error():
    with pytest.raises(ValueError, match=r"CUDA on both sides \(vLLM on GPU: False, learner on GPU: True\)"):
        select_transport("nccl", vllm_on_gpu=False, trainer_on_gpu=True)
    with pytest.raises(ValueError, match="share a GPU"):
        select_transport("nccl", vllm_on_gpu=True, trainer_on_gpu=True, shared_gpu=True)
    with pytest.raises(ValueError, match="'ipc' is not one of"):
        select_transport("ipc", vllm_on_gpu=True, trainer_on_gpu=True)


@pytest.fixture(scope="module")
def tied_model():
    from m2po_rllib.models.tiny import new_tiny_model

    model, _ = new_tiny_model(seed=0)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model


def test_source_metadata_matches_what_it_yields_and_casts_to_the_served_dtype(tied_model):
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerWeightTransferEngine

    source = StateDictSource(tied_model.state_dict, torch.bfloat16)
    meta = source.metadata()
    # vLLM's own check that iteration agrees with metadata() (the worker sizes its receive
    # buffers from the metadata; a mismatch would hang the broadcast).
    sent = list(NCCLTrainerWeightTransferEngine._checked_iter(source, meta))
    names = [n for n, _ in sent]
    state = tied_model.state_dict()
    # The tied lm_head shares the embedding's storage: sent once, vLLM ties it itself.
    assert names == [n for n in state if n != "lm_head.weight"]
    assert all(t.dtype == torch.bfloat16 for _, t in sent)
    for name, t in sent:
        torch.testing.assert_close(t, state[name].to(torch.bfloat16), rtol=0, atol=0)
    # A fresh pass every round.
    assert [n for n, _ in source] == names


def test_update_notice_is_vllms_nccl_update_info(tied_model):
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferUpdateInfo

    meta = StateDictSource(tied_model.state_dict, torch.bfloat16).metadata()
    # What NCCLTrainerWeightTransferEngine.send_weights builds from the metadata ...
    info = NCCLWeightTransferUpdateInfo(
        names=[m.name for m in meta],
        dtype_names=[str(m.dtype).split(".")[-1] for m in meta],
        shapes=[list(m.shape) for m in meta],
    )
    # ... reaches a runner as NCCLWeights, and goes back to the worker unchanged.
    notice = NCCLWeights(**asdict(info))
    assert NCCLWeightTransferUpdateInfo(**asdict(notice)) == info
    params = sum(torch.Size(m.shape).numel() for m in meta)
    assert notice.num_bytes == 2 * params


class Runner:
    """A target as `LLMEnvRunner` would be: records what it was sent. `barrier` stands in
    for NCCL's rendezvous: every rank must be inside the call at once."""

    def __init__(self, barrier: threading.Barrier):
        self.barrier = barrier
        self.init_info = None
        self.received = []

    def m2po_join_weight_group(self, init_info):
        self.barrier.wait(timeout=10)
        self.init_info = init_info

    def m2po_receive_weights(self, update_info, version):
        self.received.append((update_info, version))
        return True


def test_client_gives_each_runner_its_ranks_and_joins_them_side_by_side():
    from vllm.distributed.weight_transfer.base import VLLMWeightSyncClient
    from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo, worker_init_payload

    barrier = threading.Barrier(3)
    runners = [Runner(barrier) for _ in range(3)]
    client = RunnerGroupClient(runners, workers_per_target=[1, 2, 1])  # the middle one: TP=2
    assert isinstance(client, VLLMWeightSyncClient)
    assert client.world_size == 5
    # What NCCLTrainerWeightTransferEngine.trainer_init sends the inference side.
    payload = worker_init_payload(
        NCCLWeightTransferInitInfo(
            master_address="10.0.0.1", master_port=29512, rank_offset=1, world_size=5, packed=True
        )
    )
    client.init_weight_transfer_engine(payload)  # would time out if called one by one
    infos = [NCCLWeightTransferInitInfo(**r.init_info) for r in runners]  # vLLM parses them
    assert [i.rank_offset for i in infos] == [1, 2, 4]
    assert {(i.master_address, i.master_port, i.world_size, i.packed) for i in infos} == {("10.0.0.1", 29512, 5, True)}

    with pytest.raises(RuntimeError, match="version is unset"):
        client.update_weights({"names": []})
    client.version = 7
    client.start_weight_update()
    client.update_weights({"names": ["w"], "dtype_names": ["bfloat16"], "shapes": [[2]]})
    client.finish_weight_update()
    assert all(r.received == [({"names": ["w"], "dtype_names": ["bfloat16"], "shapes": [[2]]}, 7)] for r in runners)


def test_client_rejects_a_world_size_that_does_not_count_its_workers():
    client = RunnerGroupClient([Runner(threading.Barrier(1))] * 2)
    with pytest.raises(ValueError, match="world_size 2 != 1 learner \\+ 2 workers"):
        client.init_weight_transfer_engine({"world_size": 2, "rank_offset": 1})
    with pytest.raises(ValueError, match="one count >= 1 per target"):
        RunnerGroupClient([object()], workers_per_target=[0])
