"""A text env whose reward a *random* tiny model can earn, so loop tests see real gradients.

Same task source, prompts and observation/info contract as `m2po/Arithmetic-v0`; only the
reward differs: 1 when the completion contains a digit (about half of a random char model's
6-token completions do), else 0.
"""

from __future__ import annotations

import gymnasium as gym

from envs.arithmetic import ArithmeticTasks
from envs.reward import Verdict
from envs.text_env import MathTextEnv

ENV_ID = "m2po-test/DigitReward-v0"


class DigitRewardEnv(MathTextEnv):
    def __init__(self, split="train", template="compact", tokenizer=None, **task):
        super().__init__(ArithmeticTasks(**task), split=split, template=template, tokenizer=tokenizer)

    @staticmethod
    def _verdict(action) -> Verdict:
        text = action if isinstance(action, str) else ""
        reward = float(any(ch.isdigit() for ch in text))
        return Verdict(reward=reward, correct=reward > 0, extracted=None, verifier="test")

    def step(self, action):
        verdict = self._verdict(action)
        self._done = True
        info = self._info()
        info.update(correct=verdict.correct, extracted=None, verifier="test")
        return self._observation(), verdict.reward, True, False, info

    def score_group(self, completions):
        return [self._verdict(c) for c in completions]


if ENV_ID not in gym.registry:
    gym.register(id=ENV_ID, entry_point=DigitRewardEnv)
