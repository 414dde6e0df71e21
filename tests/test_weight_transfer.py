"""The CPU side of the weight transports (`m2po_rllib.sync.transports`).

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

from m2po_rllib.sync.sender import RunnerGroupClient, StateDictSource
from m2po_rllib.sync.transports import BroadcastWeights


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
    # The tied lm_head is sent too: vLLM's layerwise reload would leave it on the old embedding.
    assert names == list(state) and "lm_head.weight" in names
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
    # ... reaches a runner as BroadcastWeights, and goes back to the worker unchanged.
    notice = BroadcastWeights(**asdict(info))
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


@pytest.mark.filterwarnings("ignore:Tensor .* exceeds buffer_size_bytes")  # a bigger tensor: a bucket of its own
def test_gloo_receiver_cuts_the_buckets_the_sender_packs(tied_model):
    """The gloo worker sizes each receive buffer from the names, dtypes and shapes alone: its
    bucket plan must be exactly how vLLM's `pack_tensors` groups the same tensors."""
    from vllm.distributed.weight_transfer.packed_tensor import pack_tensors

    from m2po_rllib.sync.gloo import bucket_plan

    pairs = list(StateDictSource(tied_model.state_dict, torch.float32))
    for bucket_bytes in (1, 10_000, 200_000, 10**9):
        it, packed = iter(pairs), []
        while (chunk := pack_tensors(it, lambda item: item[1], bucket_bytes)) is not None:
            packed.append((chunk.names, chunk.packed_tensor.numel()))
        plan = bucket_plan([n for n, _ in pairs], [t.dtype for _, t in pairs], [list(t.shape) for _, t in pairs],
                           bucket_bytes)
        assert [[pairs[i][0] for i in b] for b in plan] == [names for names, _ in packed]
        assert [sum(pairs[i][1].numel() * 4 for i in b) for b in plan] == [size for _, size in packed]
    assert len(bucket_plan([n for n, _ in pairs], [t.dtype for _, t in pairs], [list(t.shape) for _, t in pairs], 1)) == len(pairs)


def test_native_transport_names_its_vllm_backend_and_refuses_others():
    from m2po_rllib.sync.sender import NativeWeightSender
    from m2po_rllib.sync.transports import NativeTransport

    gloo = NativeTransport("gloo")
    assert gloo.llm_kwargs == {"weight_transfer_config": {"backend": "m2po_gloo"},
                               "worker_extension_cls": "m2po_rllib.sync.gloo.GlooWeightSyncExtension"}
    assert NativeTransport("nccl").llm_kwargs == {"weight_transfer_config": {"backend": "nccl"}}
    with pytest.raises(ValueError, match="'ipc' is not one of"):
        NativeTransport("ipc")
    with pytest.raises(ValueError, match="timeout_s is a setting of the gloo backend"):
        NativeWeightSender(RunnerGroupClient([object()]), dict, torch.float32, master_address="h", master_port=1,
                           backend="nccl", timeout_s=5)


def test_a_runner_serving_another_layout_is_refused_before_the_group_opens(tmp_path, tied_model):
    """The served model's names and shapes come from its config alone (meta device); a
    learner whose tensors do not fit them is told so at connect, naming what differs."""
    from m2po_rllib.models.tiny import build_tiny_model
    from m2po_rllib.sync.sender import NativeWeightSender
    from m2po_rllib.sync.transports import check_weight_layout, weight_layout

    served = weight_layout(build_tiny_model(tmp_path / "same", seed=3))
    assert served == {n: list(t.shape) for n, t in tied_model.state_dict().items()}
    sent = {m.name: list(m.shape) for m in StateDictSource(tied_model.state_dict, torch.float32).metadata()}
    check_weight_layout(sent, served, "runner 0")  # the same architecture fits, whatever the seed

    narrower = weight_layout(build_tiny_model(tmp_path / "narrower", hidden_size=64, intermediate_size=128))
    with pytest.raises(ValueError, match=r"shapes differ \(learner vs runner\), e.g. \['model.embed_tokens.weight"):
        check_weight_layout(sent, narrower, "runner 1")

    class Target:  # a runner whose model lacks the last layer; connect must stop before any rendezvous
        def m2po_weight_layout(self):
            return {n: s for n, s in served.items() if ".layers.1." not in n}

        def m2po_join_weight_group(self, init_info):
            raise AssertionError("the group must not open")

    sender = NativeWeightSender(RunnerGroupClient([Target()]), tied_model.state_dict, torch.float32,
                                backend="gloo", master_address="127.0.0.1", master_port=1)
    with pytest.raises(ValueError, match=r"the model runner 0 serves: \d+ names it does not have, e.g. \['model.layers.1"):
        sender.connect()


def test_only_changed_rounds_declare_and_yield_what_changed_since_the_last_commit(tied_model):
    """The sender's delta rounds: all tensors first, then only the units (a decoder layer, a
    top-level module) holding a tensor whose wire value changed since the last committed
    round, whole; a failed round (no commit) is declared again; reset sends everything;
    metadata and iteration always agree (what vLLM checks)."""
    from m2po_rllib.sync.sender import delta_unit

    assert delta_unit("model.layers.12.self_attn.q_proj.weight") == "model.layers.12"
    assert delta_unit("model.norm.weight") == "model.norm" and delta_unit("lm_head.weight") == "lm_head"
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerWeightTransferEngine

    model = tied_model
    source = StateDictSource(model.state_dict, torch.bfloat16, only_changed=True)

    def round_names():
        meta = source.metadata()
        return [n for n, _ in NCCLTrainerWeightTransferEngine._checked_iter(source, meta)]

    everything = list(source.layout())
    assert round_names() == everything
    source.commit()
    assert round_names() == []  # nothing changed
    source.commit()
    layer = model.model.layers[0].mlp.up_proj.weight
    saved = layer.detach().clone()
    with torch.no_grad():
        layer.add_(1e-5)  # below bf16's resolution for most entries, not all: still a change
        changed_in_bf16 = not torch.equal(layer.to(torch.bfloat16), saved.to(torch.bfloat16))
        model.model.norm.weight.add_(0.5)
    layer0 = [n for n in everything if n.startswith("model.layers.0.")]  # the whole layer: vLLM fuses up with gate
    expected = (layer0 if changed_in_bf16 else []) + ["model.norm.weight"]
    assert changed_in_bf16 and len(layer0) > 1 and round_names() == expected
    assert round_names() == expected  # not committed (a failed send): declared again
    source.commit()
    assert round_names() == []
    source.reset()
    assert round_names() == everything
    with torch.no_grad():
        layer.copy_(saved)
        model.model.norm.weight.sub_(0.5)


def test_a_sharded_sender_whose_broadcast_fails_still_joins_every_gather(tied_model):
    """With sharded learners each tensor is made whole by a collective every learner runs in
    the same order; a sending rank whose broadcast fails part way materializes the rest of
    the round (its peers wait in those gathers), closes the group and sends everything next
    time. `agree` decides the delta round's units on every rank (rank 0's set)."""
    from m2po_rllib.sync.sender import NativeWeightSender

    gathered = []

    def materialize(t):
        gathered.append(t.data_ptr())
        return t

    sender = NativeWeightSender(None, tied_model.state_dict, torch.float32, backend="gloo", rank=1,
                                materialize=materialize, agree=lambda units: {"model.norm"})

    class Broken:  # the trainer engine: iterates two tensors of the round, then the broadcast fails
        def send_weights(self):
            sender.source.metadata()
            it = iter(sender.source)
            next(it), next(it)
            raise ConnectionError("peer gone")

        def shutdown(self):
            pass

    sender._engine = Broken()
    with pytest.raises(ConnectionError):
        sender.send(1)
    assert len(gathered) == len(tied_model.state_dict()) and not sender.connected

    # a delta round decides its units by `agree` (rank 0's choice), not by what this rank saw
    delta = NativeWeightSender(None, tied_model.state_dict, torch.float32, backend="gloo", rank=1,
                               only_changed=True, materialize=materialize, agree=lambda units: {"model.norm"})
    gathered.clear()
    names = [m.name for m in delta.source.metadata()]
    assert names == ["model.norm.weight"] and len(gathered) == len(tied_model.state_dict())  # pass 1: all compared
    assert [n for n, _ in delta.source] == names


def test_a_runner_gone_while_the_group_forms_fails_the_connect_not_the_run(tied_model):
    """A runner that died (or whose node was lost) after the driver named it: the connect is
    counted as a failure and the weights go through the object store until the group is
    formed again; a runner serving another model still raises (previous test)."""
    from ray.exceptions import ActorDiedError

    from m2po_rllib.sync.learner_sync import LearnerWeightSync

    class Gone:
        def m2po_weight_layout(self):
            raise ActorDiedError()

    sync = LearnerWeightSync(backend="gloo", dtype=torch.float32, state_fn=tied_model.state_dict)
    assert sync.connect([Gone()], [1], version=3) is None
    assert not sync.connected and sync.send(4) is None
    assert sync.metrics(None) == {"weights/native_failures": 1, "weights/native_connects": 0,
                                  "weights/native_version": -1}


def test_after_a_failed_send_there_is_no_group_to_send_through_and_no_more_failures_count(tied_model):
    """A failed send closes the group (`NativeWeightSender.send`); until it is formed again
    each version goes through the object store without another send tried, logged or
    counted as a failure."""
    from m2po_rllib.sync.learner_sync import LearnerWeightSync

    sync = LearnerWeightSync(backend="gloo", dtype=torch.float32, state_fn=tied_model.state_dict)
    try:
        assert sync.connect([], [], version=0)["version"] == 0  # a group of the learner alone
        sync.sender.close()  # what the failed send leaves
        assert not sync.connected and sync.send(1) is None
        assert sync.metrics(None) == {"weights/native_failures": 0, "weights/native_connects": 1,
                                      "weights/native_version": -1}
    finally:
        sync.close()


def test_with_no_runner_up_the_learners_form_no_group_and_ask_to_connect_again(tiny_model_dir):
    """Every runner out of service (dead, being restored): the learners' room forms no group
    (one of the learner alone would reach nobody and count as a connect), and leaves the
    request to connect set, so the group is formed with the runner RLlib brings back."""
    from _configs import tiny_config

    from m2po_rllib.driver.learners import LearnerRoom
    from m2po_rllib.rollout.env_runner import make_text_env

    cfg = tiny_config(tiny_model_dir).env_runners(num_env_runners=1, rollout_engine="vllm", weight_sync="native")
    cfg.validate()
    group = cfg.build_learner_group(env=make_text_env(cfg.env, cfg.env_config))
    try:
        room = LearnerRoom(group, cfg)
        assert not room.needs_reconnect
        assert room.connect_weight_sync([]) is None and room.needs_reconnect
        assert group._learner._weight_sync is None  # no group was formed, none counted
    finally:
        group.shutdown()


def test_a_runner_whose_engine_cannot_start_fails_the_layout_check_before_the_group_opens(tiny_model_dir):
    """The learner checks each runner's layout before it opens the weight group, and that call
    starts the runner's engine: an engine that cannot start raises its own error there, at
    once. (In the join, the learner would wait for a rank that never comes until the group's
    300 s timeout, and only then see why.)"""
    from ray.rllib.utils.metrics.metrics_logger import MetricsLogger

    from m2po_rllib import M2POConfig
    from m2po_rllib.rollout.engine_host import EngineHost

    config = (M2POConfig().environment("m2po/Arithmetic-v0")
              .env_runners(rollout_engine="hf", engine_kwargs={"no_such_setting": 1})
              .rl_module(model_config={"model": tiny_model_dir}))
    host = EngineHost(config, 1, 0, MetricsLogger())
    with pytest.raises(TypeError, match="no_such_setting"):
        host.layout()
    assert not host.started
