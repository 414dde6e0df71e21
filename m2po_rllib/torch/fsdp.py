"""Sharded learner weights: FSDP2 (`torch.distributed.fsdp.fully_shard`) over the learners.

With `training(learner_sharding="fsdp")` and `num_learners >= 2`, each learner holds
1/n of the parameters, gradients and AdamW moments (float32 master weights), and gathers
one decoder layer at a time for its forward and backward: what a 7B model needs, whose
replica (weights, gradients, moments: ~112 GB in float32) fits no 80 GB GPU.

The plan follows torchtitan's and verl's: every decoder layer is its own unit, and the
root unit is `LogpForward`, the module that runs the whole log-prob computation (decoder,
then the chunked LM head of `m2po_rllib.torch.logp`), so the embedding, the final norm
and the LM head (tied or not) are gathered for exactly the span of that computation.
Gradients are reduce-scattered after every backward (averaged over the learners, as
DDP's all-reduce is), so accumulating micro-batches never holds an unsharded gradient.
With a bf16 compute dtype, parameters are gathered in bf16 and gradients reduced in
float32 onto the float32 shards (what `m2po plan`'s estimate assumes).

Every forward is a collective: all learners must run the same number of them, which
`equal_slices` arranges (a learner with fewer rows runs padding micro-batches whose
loss is zero). State leaves the shards only through the full-state-dict helpers here,
collectives too, called by every learner at once.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

DDP, FSDP = "ddp", "fsdp"
SHARDINGS = (DDP, FSDP)


class LogpForward(torch.nn.Module):
    """The log-prob computation as one module call, FSDP's root unit: `model` is the
    causal LM, `fn` the function computing `(logp, entropy)` from it."""

    def __init__(self, model: torch.nn.Module, fn):
        super().__init__()
        self.model = model
        self._fn = fn

    def forward(self, batch: dict[str, Any], **kwargs):
        return self._fn(self.model, batch, **kwargs)


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks of a HF causal LM (`model.model.layers` for Qwen2/Llama)."""
    decoder = model.get_decoder()
    layers = getattr(decoder, "layers", None)
    if layers is None:
        raise TypeError(
            f"{type(model).__name__}: its decoder has no `.layers` to shard; learner_sharding='fsdp' "
            "supports HF decoder-only models with `model.model.layers` (Qwen2, Llama, ...), else use 'ddp'"
        )
    return list(layers)


def shard(model: torch.nn.Module, fn, compute_dtype: torch.dtype = torch.float32) -> LogpForward:
    """Shards `model` in place over the default process group; returns the root unit to
    call for log-probs. Parameters become DTensors: build the optimizer after this.

    The shards stay float32 (master weights); with a bf16 compute dtype they are gathered
    in bf16 and gradients are reduced in float32 (FSDP2's MixedPrecisionPolicy)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    device = next(model.parameters()).device
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    root = LogpForward(model, fn)
    fully_shard(root, mesh=mesh, mp_policy=mp)
    return root


def full_tensor(value: torch.Tensor) -> torch.Tensor:
    """A DTensor's whole value (a collective), any other tensor as it is."""
    from torch.distributed.tensor import DTensor

    return value.full_tensor() if isinstance(value, DTensor) else value


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's state on CPU on rank 0 ({} on the others). Every rank calls it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_full_state_dict(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Loads a whole state (every rank has it) into this rank's shards."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=True))


def full_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer's whole state keyed by parameter name, on rank 0 ({} elsewhere)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(
        model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )


def load_full_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))


def equal_slices(n: int, micro: int, sharded: bool, device=None) -> tuple[list[slice], int]:
    """Micro-batch slices of `n` rows, and how many padding micro-batches this learner
    must add so that every learner runs as many forwards as the one with the most
    (only when sharded: FSDP's forwards are collectives)."""
    slices = [slice(i, min(i + micro, n)) for i in range(0, n, micro)]
    if not sharded:
        return slices, 0
    count = torch.tensor([len(slices)], dtype=torch.int64, device=device)  # NCCL: a device tensor
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    return slices, int(count) - len(slices)
