"""Gymnasium text-generation environments for verifiable math tasks.

Importing `envs` registers `m2po/Arithmetic-v0`, `m2po/ColumnAddition-v0` (the
reasoning-length task: additions worked column by column) and `m2po/MathDataset-v0` with
gymnasium.
In a process that has not imported it (a fresh Ray worker), `gymnasium.make` also accepts
"envs:m2po/Arithmetic-v0", which imports this package first.
"""

from envs.arithmetic import ArithmeticTasks
from envs.column_addition import ColumnAdditionTasks, worked_solution
from envs.datasets import DatasetTasks
from envs.reward import MathVerifier, Verdict, math_reward, shared_verifier
from envs.tasks import Problem, TaskSource
from envs.templates import render_prompt
from envs.text_env import ArithmeticEnv, ColumnAdditionEnv, MathDatasetEnv, MathTextEnv, register_envs

register_envs()

__all__ = [
    "ArithmeticEnv",
    "ArithmeticTasks",
    "ColumnAdditionEnv",
    "ColumnAdditionTasks",
    "DatasetTasks",
    "MathDatasetEnv",
    "MathTextEnv",
    "MathVerifier",
    "Problem",
    "TaskSource",
    "Verdict",
    "math_reward",
    "render_prompt",
    "shared_verifier",
    "worked_solution",
]
