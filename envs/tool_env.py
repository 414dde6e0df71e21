"""`m2po/ToolArithmetic-v0`: arithmetic episodes in which the policy may call a sandboxed
calculator before it answers.

Protocol (one policy turn per `step`):
- a turn that opens a call, `<calc>EXPR` (closed by `</calc>`, which is also a stop string:
  generation ends there and the runner's `stop` gets it from `env.stop`), runs EXPR in the
  `ToolSandbox` (`envs/tools.py`: a child process, time and memory limits, an AST whitelist)
  and the episode goes on with `<result>VALUE</result>` or `<error>WHY</error>` appended right
  after the call (`obs["inserted"]`, `obs["inserted_token_ids"]`);
- any other turn is the final answer: scored by the verifier (`\\boxed{...}` or the last
  number), the episode ends with its reward;
- a call made on the last allowed turn (`max_turns`) ends the episode truncated, reward 0.

Text of a call turn, as the policy writes it: `12345*6789=<calc>12345*6789</calc>`; the
runner hands `step` the text cut before the stop string, and `step` accepts it with or
without the closer. Hostile or unreadable calls (imports, names, huge powers, empty or
unclosed garbage, text that is not valid Unicode) get an `<error>` observation from the
sandbox, never an exception; every `info` says whether the turn was a call (`tool_call`),
whether it failed (`tool_error`) and how many characters of the inserted text the tokenizer
has no token for (`dropped_chars`: a result such as `7/3 (~2.33333333333)` for a vocabulary
without `~`). The markers and formats themselves must be made of characters the tokenizer
encodes: the env refuses others when it is made.
"""

from __future__ import annotations

from envs.arithmetic import ArithmeticTasks
from envs.reward import shared_verifier
from envs.text_env import MathTextEnv, _as_text, _split_config, dropped_chars, well_formed
from envs.tools import TOOLS, ToolSandbox

CALL_OPEN, CALL_CLOSE = "<calc>", "</calc>"
TOOL_KEYS = ("tool", "tool_time_limit_s", "call_open", "call_close", "result_format", "error_format")
_SANDBOXES: dict[tuple, ToolSandbox] = {}  # one child process per setting, shared by a process's envs


def parse_call(text: str, call_open: str = CALL_OPEN, call_close: str = CALL_CLOSE) -> str | None:
    """The expression of the turn's last call (`<calc>EXPR`, closer optional), or None if the
    turn makes no call."""
    start = text.rfind(call_open)
    if start < 0:
        return None
    expr = text[start + len(call_open):]
    end = expr.find(call_close)
    return (expr if end < 0 else expr[:end]).strip()


def shared_sandbox(time_limit_s: float = 2.0) -> ToolSandbox:
    key = (float(time_limit_s),)
    if key not in _SANDBOXES:
        _SANDBOXES[key] = ToolSandbox(time_limit_s=time_limit_s)
    return _SANDBOXES[key]


class ToolMathEnv(MathTextEnv):
    """A math episode with a calculator (`tool="calculator"`, or the restricted Python
    evaluator, `tool="python"`); see the module docstring. `max_turns` counts calls and the
    answer together."""

    stop = (CALL_CLOSE,)

    def __init__(self, tasks, *, tool: str = "calculator", tool_time_limit_s: float = 2.0, max_turns: int = 4,
                 call_open: str = CALL_OPEN, call_close: str = CALL_CLOSE, result_format: str = "<result>{}</result>",
                 error_format: str = "<error>{}</error>", **env_kw):
        if tool not in TOOLS:
            raise ValueError(f"tool={tool!r} must be one of {TOOLS}")
        for name, value in (("call_open", call_open), ("call_close", call_close)):
            if not isinstance(value, str) or not value.strip():
                raise ValueError(f"{name}={value!r} must be a non-empty string")
        if not isinstance(result_format, str) or result_format.count("{}") != 1:
            raise ValueError(f"result_format={result_format!r} must be a string with one '{{}}' where the result goes")
        if not isinstance(error_format, str) or error_format.count("{}") > 1:
            raise ValueError(f"error_format={error_format!r} must be a string with at most one '{{}}' (the error message)")
        super().__init__(tasks, max_turns=max_turns, **env_kw)
        self.tool = tool
        self.call_open, self.call_close = call_open, call_close
        self.result_format, self.error_format = result_format, error_format
        self.stop = (call_close,)
        self._check_encodable()
        self.sandbox = shared_sandbox(tool_time_limit_s)

    def _check_encodable(self) -> None:
        """Refuses markers and formats with characters the tokenizer has no token for: the
        policy could never write such a marker, nor read what the env inserts as it was meant."""
        if self.tokenizer is None:
            return
        settings = (("call_open", self.call_open), ("call_close", self.call_close),
                    ("result_format", self.result_format), ("error_format", self.error_format))
        lost = {name: dropped_chars(self.tokenizer, well_formed(value.replace("{}", ""))) for name, value in settings}
        bad = [f"{name}={value!r} ({''.join(lost[name])!r})" for name, value in settings if lost[name]]
        if bad:
            name = getattr(self.tokenizer, "name_or_path", type(self.tokenizer).__name__)
            raise ValueError(
                f"the tokenizer ({name}) has no token for some characters of {', '.join(bad)}: it would drop "
                "them from what the policy writes and reads; make the markers of characters it has (the "
                "built-in models': call_open='CALC(', call_close=')=', result_format='{}.', error_format='ERR.')"
            )

    @property
    def multi_turn(self) -> bool:
        return True

    @classmethod
    def takes_turns(cls, env_config: dict) -> bool:
        return True

    def longest_reply(self, max_new_tokens: int) -> int | None:
        """None: a tool's result has no bound known before the run (up to ~6000 digits)."""
        return None

    def step(self, action):
        if self._done:
            raise RuntimeError("step() called on a finished episode; call reset() first")
        text = _as_text(action)
        self.turn += 1
        expr = parse_call(text, self.call_open, self.call_close)
        if expr is None:  # the final answer
            verdict = shared_verifier().check(text, self.problem.answer)
            self._done = True
            info = self._info()
            info.update(correct=verdict.correct, extracted=verdict.extracted, verifier=verdict.verifier,
                        tool_call=False, tool_error=False, dropped_chars=0)
            return self._obs, verdict.reward, True, False, info
        result = self.sandbox.run(self.tool, expr)  # text that is not valid Unicode: an error result
        info = self._info()
        info.update(correct=False, tool_call=True, tool_error=not result.ok, dropped_chars=0)
        if self.turn >= self.max_turns:  # out of turns with a call pending: no answer
            self._done = True
            info["budget"] = "max_turns"
            return self._obs, 0.0, False, True, info
        call = text if text.rstrip().endswith(self.call_close) else text + self.call_close
        reply = (self.result_format if result.ok else self.error_format).format(result.output)
        info["dropped_chars"] = self._continue(call, reply, role="tool")
        return self._obs, 0.0, False, False, info


class ToolArithmeticEnv(ToolMathEnv):
    """`m2po/ToolArithmetic-v0`: env_config is ArithmeticTasks' knobs (default: multiplication
    of two 4-digit numbers, too long to do in one's head) plus the MathTextEnv keys and
    `TOOL_KEYS` (the call and result markers are settings: a small vocabulary, like the
    built-in models' characters, has no `<` or `>`)."""

    def __init__(self, **env_config):
        env_config = {"digits": 4, "num_operands": 2, "operators": "*", **env_config}
        tool_kw = {k: env_config.pop(k) for k in TOOL_KEYS if k in env_config}
        task_kw, env_kw = _split_config(ArithmeticTasks, env_config, "m2po/ToolArithmetic-v0")
        env_kw.setdefault("max_turns", 4)
        super().__init__(ArithmeticTasks(**task_kw), **tool_kw, **env_kw)
