"""Gymnasium text environments: the prompt is the observation, the completion the action.

    env = gymnasium.make("m2po/Arithmetic-v0", digits=3, template="plain")
    obs, info = env.reset(seed=7)          # obs["prompt"]: str; info["answer"], info["problem_id"]
    obs, reward, terminated, truncated, info = env.step("... \\boxed{579}")

Observation: a dict with "prompt" (the rendered prompt, or the whole conversation so far
in a multi-turn episode) and, when a tokenizer is bound, "prompt_token_ids" (int64
array; special tokens are added for non-chat templates, the chat template already has
them). Multi-turn envs add "inserted" (and "inserted_token_ids"): what the env appended
after the policy's last turn (empty at reset), which a runner keeping the policy's own
token ids appends instead of re-tokenizing the conversation; `info["dropped_chars"]` counts
the characters of that text the tokenizer has no token for, which the policy never sees
(each also logged once). Action: the completion text (str; bytes or None are accepted and
scored 0 if unreadable; text that is not valid Unicode, a lone surrogate, is kept with
U+FFFD in its place). Reward: 1.0 for a correct final answer, else 0.0, from `envs.reward`.

Episodes. `reset(seed=s)` picks the problem from `s` alone, so G copies reset with the
same seed share a prompt (GRPO groups); `reset(options={"index": i})` takes problem i of
the split (held-out evaluation enumerates `range(env.num_problems)`). With max_turns=1 an
episode is one step. With max_turns > 1 a wrong answer appends the completion and
`feedback(...)` to the conversation and the episode goes on; override `feedback` for
other multi-turn tasks.

Scoring many completions at once (the runner's hot path): `env.score_group(completions)`
scores a group of completions of the current problem; `env.score_batch(completions,
answers)` or `envs.shared_verifier().check_batch(pairs)` score arbitrary pairs.
"""

from __future__ import annotations

import inspect
import logging
import unicodedata
from collections import Counter

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from envs.answers import to_text
from envs.arithmetic import ArithmeticTasks
from envs.column_addition import ColumnAdditionTasks
from envs.datasets import DatasetTasks
from envs.reward import Verdict, shared_verifier
from envs.tasks import SPLITS, Problem, TaskSource, check_split
from envs.templates import INSTRUCTION, render_prompt

logger = logging.getLogger(__name__)
MAX_TEXT_CHARS = 1 << 20
_WARNED_CHARS: set[tuple[str, str]] = set()  # (tokenizer, character) already said


class AnyText(spaces.Text):
    """A Text space that contains any str up to max_length (Text's charset is alphanumeric)."""

    def contains(self, x) -> bool:
        return isinstance(x, str) and self.min_length <= len(x) <= self.max_length


def load_tokenizer(tokenizer):
    """A tokenizer object as given, or one loaded with AutoTokenizer from a local path/name."""
    if tokenizer is None or not isinstance(tokenizer, str):
        return tokenizer
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer)


def well_formed(text: str) -> str:
    """`text` with each lone surrogate replaced by U+FFFD: a str that is not valid Unicode
    (a hostile action, `"\\ud800"`) makes a tokenizer raise a TypeError."""
    return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def dropped_chars(tokenizer, text: str, ids: list[int] | None = None) -> Counter:
    """The characters of (well-formed) `text` that its tokens `ids` (default: `text` encoded
    without special tokens) do not hold, with how often: a byte-level vocabulary without them
    drops them silently, others make them the unknown token. Found by decoding the tokens (a
    character may exist only inside a longer token, as `{` in `\\boxed{`); whitespace is not
    counted (decoders normalize it)."""
    if ids is None:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    kept = tokenizer.decode([i for i in ids if i != tokenizer.unk_token_id], clean_up_tokenization_spaces=False)
    lost = Counter(unicodedata.normalize("NFC", text)) - Counter(kept)
    return Counter({char: n for char, n in lost.items() if not char.isspace()})


class MathTextEnv(gym.Env):
    """A single- or multi-turn math episode over any task source (`envs.tasks.TaskSource`).

    Args:
        tasks: where problems come from (ArithmeticTasks, DatasetTasks, ...).
        split: "train" or "heldout".
        template: a named prompt template ("plain", "chat", "compact") or a "{question}" format.
        tokenizer: a HF tokenizer, or a local path/name to load; adds "prompt_token_ids".
        max_turns: attempts per episode; > 1 gives feedback after a wrong answer.
    """

    metadata = {"render_modes": []}

    def __init__(
        self,
        tasks: TaskSource,
        split: str = "train",
        template: str = "plain",
        tokenizer=None,
        max_turns: int = 1,
    ):
        if not isinstance(max_turns, int) or max_turns < 1:
            raise ValueError(f"max_turns={max_turns!r} must be an integer >= 1")
        self.tasks = tasks
        self.split = check_split(split)
        self.template = template
        self.tokenizer = load_tokenizer(tokenizer)
        self.max_turns = max_turns
        render_prompt("1+1", template, self.tokenizer)  # fail now on a bad template, not at reset
        obs = {"prompt": AnyText(MAX_TEXT_CHARS)}
        if self.multi_turn:  # what the env appends after a policy turn (empty at reset)
            obs["inserted"] = AnyText(MAX_TEXT_CHARS, min_length=0)
        if self.tokenizer is not None:
            obs["prompt_token_ids"] = spaces.Sequence(spaces.Discrete(len(self.tokenizer)), stack=True)
            if self.multi_turn:
                obs["inserted_token_ids"] = spaces.Sequence(spaces.Discrete(len(self.tokenizer)), stack=True)
        self.observation_space = spaces.Dict(obs)
        self.action_space = AnyText(MAX_TEXT_CHARS)
        self.problem: Problem | None = None
        self.messages: list[dict] = []
        self.turn = 0
        self._done = True
        self._obs: dict = {}

    stop: tuple[str, ...] = ()
    """Strings that end a policy turn besides EOS (a tool env's call closer); the runner adds
    them to its stop strings."""

    @property
    def multi_turn(self) -> bool:
        """Episodes may take more than one policy turn (the runner then runs its episode loop)."""
        return self.max_turns > 1

    @classmethod
    def takes_turns(cls, env_config: dict) -> bool:
        """Whether the env made from `env_config` is `multi_turn`, told without making it (a
        dataset env loads its data): config validation asks before Ray starts."""
        turns = env_config.get("max_turns", 1)
        return isinstance(turns, int) and turns > 1

    @property
    def num_problems(self) -> int | None:
        """Problems in this env's split (None: unbounded, any index >= 0 is valid)."""
        return self.tasks.num_problems(self.split)

    # -- episode ------------------------------------------------------------------------
    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        options = options or {}
        unknown = set(options) - {"index"}
        if unknown:
            raise ValueError(f"unknown reset options {sorted(unknown)}; valid: ['index']")
        if "index" in options:
            self.problem = self.tasks.problem(int(options["index"]), self.split)
        elif seed is not None:
            # From the seed alone (not the env's history): same seed, same prompt.
            self.problem = self.tasks.sample(np.random.default_rng(seed), self.split)
        else:
            self.problem = self.tasks.sample(self.np_random, self.split)
        self.messages = [{"role": "user", "content": self.problem.question}]
        self.turn = 0
        self._done = False
        self._obs = self._observation()
        return self._obs, self._info()

    def step(self, action):
        if self._done:
            raise RuntimeError("step() called on a finished episode; call reset() first")
        verdict = shared_verifier().check(action, self.problem.answer)
        self.turn += 1
        terminated = verdict.correct or self.turn >= self.max_turns
        dropped = 0
        if not terminated:
            dropped = self._continue(_as_text(action), self.feedback(verdict, action))
        self._done = terminated
        info = self._info()
        info.update(correct=verdict.correct, extracted=verdict.extracted, verifier=verdict.verifier,
                    dropped_chars=dropped)
        return self._obs, verdict.reward, terminated, False, info

    def _continue(self, completion: str, reply: str, role: str = "user") -> int:
        """The episode goes on: the policy's turn and the env's reply join the conversation,
        and the observation holds the whole conversation and what the env inserted after the
        policy's turn (`inserted`, `inserted_token_ids`: what a runner that keeps the policy's
        own token ids appends, instead of re-tokenizing the conversation). Returns how many
        characters of the inserted text the tokenizer has no token for (`info["dropped_chars"]`:
        the policy reads the text without them)."""
        self.messages.append({"role": "assistant", "content": well_formed(completion)})
        self.messages.append({"role": role, "content": well_formed(reply)})
        self._obs = self._observation(inserted=self._inserted_text())
        if self.tokenizer is None:
            return 0
        lost = dropped_chars(self.tokenizer, self._obs["inserted"], self._obs["inserted_token_ids"].tolist())
        name = str(getattr(self.tokenizer, "name_or_path", type(self.tokenizer).__name__))
        for char in lost:
            if (name, char) not in _WARNED_CHARS:
                _WARNED_CHARS.add((name, char))
                logger.warning("the tokenizer %s has no token for %r, which the env inserted (a tool's result or "
                               "feedback): the policy reads the text without it (counted in episode/dropped_chars)",
                               name, char)
        return sum(lost.values())

    def _inserted_text(self) -> str:
        """The text the conversation holds after the policy's last turn: rendered with a
        sentinel in place of that turn, the part after it (the chat template's end of turn
        and next header included)."""
        sentinel = "\x00M2PO-TURN\x00"
        last = self.messages[-2]["content"]
        self.messages[-2]["content"] = sentinel
        try:
            text = self.render_conversation()
        finally:
            self.messages[-2]["content"] = last
        return text.split(sentinel, 1)[1]

    def feedback(self, verdict: Verdict, completion) -> str:
        """The user's reply after a wrong answer in a multi-turn episode (override to change)."""
        if verdict.extracted is None:
            return f"I could not find a final answer. {INSTRUCTION}"
        return f"The answer {verdict.extracted} is not correct. Try again. {INSTRUCTION}"

    # -- what an episode may hold (checked against the model's context before Ray starts) --
    def longest_prompt(self, limit: int = 512) -> tuple[int, bool]:
        """(tokens, exact): the longest first observation over both splits, exact where a split
        has at most `limit` problems (all measured), else the longest of `limit` drawn from it
        (seeds 0..limit-1, as the runner draws them)."""
        if self.tokenizer is None:
            raise ValueError("longest_prompt() needs a tokenizer bound to the env")
        longest, exact = 0, True
        for split in SPLITS:
            n = self.tasks.num_problems(split)
            if n is not None and n <= limit:
                problems = [self.tasks.problem(i, split) for i in range(n)]
            else:
                exact = False
                problems = [self.tasks.sample(np.random.default_rng(seed), split) for seed in range(limit)]
            prompts = [render_prompt(p.question, self.template, self.tokenizer) for p in problems]
            longest = max([longest, *(len(self._prompt_ids(prompt)) for prompt in prompts)])
        return longest, exact

    def longest_reply(self, max_new_tokens: int) -> int | None:
        """An upper estimate of the tokens the env inserts after a policy turn of at most
        `max_new_tokens` tokens (None: no bound is known before the run). The feedback is
        rendered for each kind of wrong answer with an empty answer, and what it echoes of the
        turn counted at `max_new_tokens` tokens, the whole turn."""
        if self.tokenizer is None:
            raise ValueError("longest_reply() needs a tokenizer bound to the env")
        saved = self.messages
        try:
            longest = 0
            for extracted in (None, ""):
                reply = self.feedback(Verdict(0.0, False, extracted, "fast"), "")
                self.messages = [{"role": "user", "content": "1+1"}, {"role": "assistant", "content": ""},
                                 {"role": "user", "content": reply}]
                inserted = self.tokenizer(self._inserted_text(), add_special_tokens=False)["input_ids"]
                longest = max(longest, len(inserted))
        finally:
            self.messages = saved
        return longest + max_new_tokens

    # -- batched scoring ----------------------------------------------------------------
    def score_group(self, completions) -> list[Verdict]:
        """Scores each completion as a one-turn answer to the current problem, in one batched
        verifier call, without advancing the episode: the G samples of a GRPO group share one
        `reset`. Same rewards as `step` on a fresh episode of this problem; override it with
        `step` when a subclass changes the reward."""
        if self.problem is None:
            raise RuntimeError("score_group() called before reset()")
        return shared_verifier().check_batch([(c, self.problem.answer) for c in completions])

    @staticmethod
    def score_batch(completions, answers) -> list[float]:
        """Rewards of many completions against their gold answers (slow ones in parallel)."""
        if len(completions) != len(answers):
            raise ValueError(f"got {len(completions)} completions but {len(answers)} answers")
        return shared_verifier().score_batch(list(zip(completions, answers)))

    # -- rendering ----------------------------------------------------------------------
    def render_conversation(self) -> str:
        """The prompt text: the first question through the template, then the later turns
        (the chat template's own turns; or, for text templates, each completion followed by
        a blank line, the feedback and "Answer:")."""
        if self.template == "chat":
            first = {"role": "user", "content": f"{self.messages[0]['content']}\n{INSTRUCTION}"}
            return self.tokenizer.apply_chat_template(
                [first, *self.messages[1:]], tokenize=False, add_generation_prompt=True
            )
        # Plain text: each completion, a blank line, the feedback, and a new "Answer:" cue.
        text = render_prompt(self.messages[0]["content"], self.template, self.tokenizer)
        for message in self.messages[1:]:
            if message["role"] == "assistant":
                text += message["content"] + "\n\n"
            elif message["role"] == "tool":  # a tool's result follows the call at once, as formatted
                text = text[:-2] + message["content"]
            else:
                text += message["content"] + "\nAnswer:"
        return text

    def _observation(self, inserted: str = "") -> dict:
        prompt = self.render_conversation()
        obs = {"prompt": prompt}
        if self.multi_turn:
            obs["inserted"] = inserted
        if self.tokenizer is not None:
            obs["prompt_token_ids"] = np.asarray(self._prompt_ids(prompt), dtype=np.int64)
            if self.multi_turn:
                extra = self.tokenizer(inserted, add_special_tokens=False)["input_ids"] if inserted else []
                obs["inserted_token_ids"] = np.asarray(extra, dtype=np.int64)
        return obs

    def _prompt_ids(self, prompt: str) -> list[int]:
        return self.tokenizer(prompt, add_special_tokens=self.template != "chat")["input_ids"]

    def _info(self) -> dict:
        return {
            "answer": self.problem.answer,
            "problem_id": self.problem.id,
            "question": self.problem.question,
            "split": self.split,
            "turn": self.turn,
        }


def _as_text(action) -> str:
    try:
        return to_text(action)
    except TypeError:
        return ""


_ENV_KEYS = ("split", "template", "tokenizer", "max_turns")


def _split_config(task_cls, kwargs: dict, env_id: str) -> tuple[dict, dict]:
    task_keys = [p for p in inspect.signature(task_cls).parameters]
    unknown = [k for k in kwargs if k not in task_keys and k not in _ENV_KEYS]
    if unknown:
        raise ValueError(
            f"{env_id}: unknown env_config key(s) {unknown}; valid keys are "
            f"{sorted(task_keys)} (task) and {list(_ENV_KEYS)} (env)"
        )
    task_kw = {k: v for k, v in kwargs.items() if k in task_keys}
    env_kw = {k: v for k, v in kwargs.items() if k in _ENV_KEYS}
    return task_kw, env_kw


class ArithmeticEnv(MathTextEnv):
    """`m2po/Arithmetic-v0`: env_config is ArithmeticTasks' knobs plus the MathTextEnv keys."""

    def __init__(self, **env_config):
        task_kw, env_kw = _split_config(ArithmeticTasks, env_config, "m2po/Arithmetic-v0")
        super().__init__(ArithmeticTasks(**task_kw), **env_kw)


class ColumnAdditionEnv(MathTextEnv):
    """`m2po/ColumnAddition-v0`: env_config is ColumnAdditionTasks' knobs plus the MathTextEnv
    keys; the reasoning-length task (answers of 24-64 tokens worked column by column)."""

    def __init__(self, **env_config):
        task_kw, env_kw = _split_config(ColumnAdditionTasks, env_config, "m2po/ColumnAddition-v0")
        super().__init__(ColumnAdditionTasks(**task_kw), **env_kw)


class MathDatasetEnv(MathTextEnv):
    """`m2po/MathDataset-v0`: env_config is DatasetTasks' arguments plus the MathTextEnv keys."""

    def __init__(self, **env_config):
        task_kw, env_kw = _split_config(DatasetTasks, env_config, "m2po/MathDataset-v0")
        super().__init__(DatasetTasks(**task_kw), **env_kw)


ENV_IDS = {
    "m2po/Arithmetic-v0": "envs.text_env:ArithmeticEnv",
    "m2po/ColumnAddition-v0": "envs.text_env:ColumnAdditionEnv",
    "m2po/MathDataset-v0": "envs.text_env:MathDatasetEnv",
    "m2po/ToolArithmetic-v0": "envs.tool_env:ToolArithmeticEnv",
}


def register_envs() -> None:
    """Register the env ids with gymnasium (idempotent)."""
    for env_id, entry_point in ENV_IDS.items():
        if env_id not in gym.registry:
            gym.register(id=env_id, entry_point=entry_point, disable_env_checker=False)
