"""`LearnerWeightSync`: what a learner keeps of vLLM's native weight transfer (`weight_sync=
"native"`): a `NativeWeightSender` (sender.py) connected to the runners the driver names,
sending after the updates whose weights go out; a failed send, or a runner gone while the
group forms, is counted and the group formed again, the weights meanwhile going through the
object store."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from m2po_rllib.sync.sender import NativeWeightSender, RunnerGroupClient

logger = logging.getLogger(__name__)


class LearnerWeightSync:
    """A learner's native weight sync (`weight_sync="native"`): a `NativeWeightSender` formed
    with the runners the driver names (`connect`, which sends the current weights at once,
    so a runner that joined or restarted serves them), sending after each update whose
    weights go out (`send`). A failed send is not fatal: it is logged and counted, the group
    is closed, and the learner publishes that version through the object store while the
    driver forms the group again. The address is this learner's node and a free port, new
    for every group."""

    def __init__(self, *, backend: str, dtype: torch.dtype, state_fn, rank: int = 0, bucket_bytes: int | None = None,
                 only_changed: bool = False, timeout_s: float | None = None, materialize=None, agree=None):
        self.backend, self.rank = backend, rank
        self._sender_kwargs = dict(
            backend=backend, bucket_bytes=bucket_bytes, only_changed=only_changed, rank=rank,
            timeout_s=timeout_s if backend == "gloo" else None, materialize=materialize, agree=agree,
        )
        self._state_fn, self._dtype = state_fn, dtype
        self.sender: NativeWeightSender | None = None
        self.connects = 0
        self.failures = 0

    @property
    def connected(self) -> bool:
        return self.sender is not None and self.sender.connected

    def connect(self, targets: Sequence, workers_per_target: Sequence[int], version: int) -> dict[str, float] | None:
        """Forms a new group with `targets` (EnvRunner actors; rank 0 only, other ranks pass
        none) and sends the weights as `version`."""
        from m2po_rllib.common.net import free_port, node_address

        self.close()
        client = RunnerGroupClient(targets, workers_per_target) if self.rank == 0 else None
        address = node_address()
        self.sender = NativeWeightSender(
            client, self._state_fn, self._dtype, master_address=address,
            master_port=free_port("0.0.0.0" if address != "127.0.0.1" else address), **self._sender_kwargs,
        )
        from ray.exceptions import RayActorError

        try:
            self.sender.connect()
        except RayActorError:  # a runner gone meanwhile (died, its node lost): formed again once restored
            self.failures += 1
            logger.exception("native weight sync: the group could not be formed; the weights go through the "
                             "object store until it is")
            self.close()
            return None
        self.connects += 1
        return self.send(version)

    def send(self, version: int) -> dict[str, float] | None:
        """Broadcasts `version`; None if the send failed (the group is closed then) or there
        is no group to send through (not counted as a failure: nothing was sent)."""
        if not self.connected:
            return None
        try:
            return self.sender.send(version)
        except Exception:
            self.failures += 1
            logger.exception(
                "native weight sync of version %d failed; it goes through the object store, and the "
                "group is formed again", version,
            )
            return None

    def metrics(self, stats: dict[str, float] | None) -> dict[str, float]:
        """The metrics of a send that returned `stats` (None: it failed), by `keys` name."""
        from m2po_rllib.common import keys

        out = {keys.NATIVE_SYNC_FAILURES: self.failures, keys.NATIVE_SYNC_CONNECTS: self.connects,
               keys.NATIVE_SYNC_VERSION: -1 if stats is None else stats["version"]}
        if stats is not None:
            out.update({keys.NATIVE_SYNC_S: stats["seconds"], keys.NATIVE_SYNC_BYTES: stats["bytes"],
                        keys.NATIVE_SYNC_TENSORS: stats["tensors"]})
        return out

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
            self.sender = None
