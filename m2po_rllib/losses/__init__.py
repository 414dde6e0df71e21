"""The policy-loss library: pure torch, no Ray.

- `m2po_keep_mask`, `m2po_keep_mask_global`: M2PO's second-moment token mask (Alg. 1,
  arXiv 2510.01161), on one process or over every data-parallel rank.
- `m2po_official_tau`: the official code's M2 budget turned into a PPO clip radius.
- `compute_policy_loss(name, ...)`: every registered loss (`POLICY_LOSSES`): "m2po",
  "m2po_official", "grpo", "grpo_no_tr", "gspo".
- `aggregate_loss`, `compute_advantages`: loss reduction modes, group advantages.
"""

from m2po_rllib.losses._dist import LOCAL
from m2po_rllib.losses.aggregation import (
    ADVANTAGE_ESTIMATORS,
    LOSS_AGG_MODES,
    aggregate_loss,
    compute_advantages,
)
from m2po_rllib.losses.mask import PAPER_M2_THRESHOLD, m2po_keep_mask, m2po_keep_mask_global, m2po_official_tau
from m2po_rllib.losses.policy import (
    MASK_SCOPES,
    POLICY_LOSSES,
    PolicyLossInputs,
    compute_policy_loss,
    policy_loss_params,
    register_policy_loss,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "LOCAL",
    "LOSS_AGG_MODES",
    "MASK_SCOPES",
    "PAPER_M2_THRESHOLD",
    "POLICY_LOSSES",
    "PolicyLossInputs",
    "aggregate_loss",
    "compute_advantages",
    "compute_policy_loss",
    "m2po_keep_mask",
    "m2po_keep_mask_global",
    "m2po_official_tau",
    "policy_loss_params",
    "register_policy_loss",
]
