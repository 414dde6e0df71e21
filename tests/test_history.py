"""What `m2po train` writes to TensorBoard by default (jobs/history.py)."""

from __future__ import annotations

from m2po_rllib.common import keys
from m2po_rllib.jobs.history import tensorboard_scalars


def test_tensorboard_gets_the_native_weight_sync_metrics_by_default():
    """The driver logs native weight sync's `weights/native_*` at the top of a result; they
    reach TensorBoard without `run.tensorboard: all`, RLlib's other numbers do not."""
    result = {
        keys.NATIVE_SYNC_S: 0.25,
        "weights": {"native_bytes": 1.0e6},  # as a nested result holds it
        keys.NATIVE_SYNC_FAILURES: 0,
        "env_runners": {"weights_seq_no": 3, "rollout": {"reward_mean": 0.5}},
        "num_training_step_calls_per_iteration": 1,
    }
    scalars = tensorboard_scalars(result)
    assert scalars == {
        keys.NATIVE_SYNC_S: 0.25, keys.NATIVE_SYNC_BYTES: 1.0e6, keys.NATIVE_SYNC_FAILURES: 0.0,
        "env_runners/rollout/reward_mean": 0.5,
    }
    assert len(tensorboard_scalars(result, everything=True)) == 6
