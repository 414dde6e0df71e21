"""The driver: `M2PO` (m2po.py, the RLlib `Algorithm` whose `training_step` reads as
IMPALA's beats) and the rooms it keeps besides the runners' (`rollout.RolloutSampler`): the
learners' (learners.py: `LearnerRoom`), an iteration's pace, complete checkpoints, held-out
evaluation, and whether the actors fit the cluster (resources.py)."""
