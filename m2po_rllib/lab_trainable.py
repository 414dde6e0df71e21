"""The Tune trainable of the lab: `"M2PO"` once the algorithm reports what the lab needs in
every result (it then defines `m2po.HELDOUT_ACCURACY`), until then `LabM2PO`, which adds it.

`LabM2PO` is a stop-gap for what the algorithm is getting: a top-level `heldout_accuracy`
in every result (evaluated at iteration 1 if the interval has not come yet, then carried,
so ASHA and the collapse stopper always see it), `policy_version` = optimizer updates done
by the end of the iteration, and torch threads that follow the trial's CPUs
(`num_cpus_for_main_process`: the trial's process holds the local learner and runner), so
trials never oversubscribe the machine.
"""

from __future__ import annotations

import torch

from ray.rllib.utils.annotations import override

from m2po_rllib import m2po as _m2po
from m2po_rllib.m2po import M2PO
from m2po_rllib.metrics import EVAL_ACCURACY, HELDOUT_ACCURACY, lookup


class LabM2PO(M2PO):
    @override(M2PO)
    def setup(self, config) -> None:
        from m2po_rllib.train import _quiet

        _quiet()  # a trial's log is what `m2po train` prints: no API-stack notices, no loading bars
        torch.set_num_threads(max(1, int(config.num_cpus_for_main_process)))
        self._heldout = None
        super().setup(config)

    @override(M2PO)
    def step(self):
        result = super().step()
        acc = lookup(result, EVAL_ACCURACY)
        if acc is None and self._heldout is None and self.config.evaluation_interval:
            evaluation = self.evaluate()
            result["evaluation"] = evaluation
            acc = lookup(evaluation, EVAL_ACCURACY[1:])
        if acc is not None:
            self._heldout = acc
        result.setdefault(HELDOUT_ACCURACY, self._heldout)
        # M2PO logs the version before this step's update; the lab counts updates done
        result["policy_version"] = self.policy_version
        return result


def lab_trainable():
    """What `tune.Tuner` trains: "M2PO" when the algorithm reports `heldout_accuracy`."""
    return "M2PO" if hasattr(_m2po, "HELDOUT_ACCURACY") else LabM2PO
