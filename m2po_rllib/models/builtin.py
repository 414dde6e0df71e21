"""Models shipped inside the package, so `make train` needs no model hub.

`resolve_model_path("builtin:arith-tiny")` gives the directory of the shipped weights (a
Hugging Face directory that transformers and vLLM load); a model directory or a hub name
passes through unchanged once it is known to load, and anything else is one `ValueError`
naming the setting, the value and the fix. The weights are made by
`scripts/build_builtin_model.py`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from importlib.resources import files
from pathlib import Path

from m2po_rllib.common.errors import ConfigError

BUILTIN_PREFIX = "builtin:"


@dataclass(frozen=True)
class BuiltinModel:
    description: str
    task: dict = field(default_factory=dict)
    """The arguments of the task family it was warm-started on (`task_family`)."""
    template: str = "compact"
    """The `envs.templates` prompt template it was trained with."""
    task_family: str = "ArithmeticTasks"
    """`envs.ArithmeticTasks` (answers "\\boxed{579}") or `envs.ColumnAdditionTasks` (worked
    solutions, `Problem.solution`)."""
    answer_tokens: int = 8
    """Longest answer it was trained to write, in tokens (`max_new_tokens` for it)."""
    tool: dict | None = None
    """For a tool-use model: the `m2po/ToolArithmetic-v0` env_config keys of its call syntax
    (markers made of its characters), and `call_when_first_digit`: the warm start's examples
    call the calculator when the question starts with one of these digits (the others answer
    at once)."""


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    "arith-tiny": BuiltinModel(
        description=(
            "0.8M-parameter character-level Qwen2, warm-started by supervised training on "
            "3-digit addition to 15-35% greedy held-out accuracy: room for RL to show."
        ),
        task=dict(digits=3, num_operands=2, operators="+"),
    ),
    "column-add-tiny": BuiltinModel(
        description=(
            "The same 0.8M-parameter character-level Qwen2, warm-started on 5-digit addition "
            "worked column by column (`m2po/ColumnAddition-v0`: 31-51 token answers) to "
            "20-35% greedy held-out accuracy."
        ),
        task=dict(digits=5, num_operands=2),
        task_family="ColumnAdditionTasks",
        answer_tokens=64,
    ),
    "column-mixed-tiny": BuiltinModel(
        description=(
            "The same 0.8M-parameter character-level Qwen2, warm-started on column additions of "
            "mixed widths (2 to 12 digits, `m2po/ColumnAddition-v0` with digits=[2, 12]): worked "
            "answers of 14-118 tokens, the long-tailed task of the streaming runners."
        ),
        task=dict(digits=[2, 12], num_operands=2),
        task_family="ColumnAdditionTasks",
        answer_tokens=128,
    ),
    "tool-tiny": BuiltinModel(
        description=(
            "The same 0.8M-parameter character-level Qwen2, warm-started on 3-digit "
            "multiplication (`m2po/ToolArithmetic-v0`): problems whose first digit is 1-3 are "
            "taught to call the calculator, `123*456=CALC(123*456)=56088.\\boxed{56088}`, the "
            "rest to guess `\\boxed{...}` at once: it calls the tool on a third of the problems, "
            "and can hardly multiply."
        ),
        task=dict(digits=3, num_operands=2, operators="*"),
        answer_tokens=24,
        tool=dict(call_open="CALC(", call_close=")=", result_format="{}.", error_format="ERR.", call_when_first_digit="123"),
    ),
}


def tool_env_config(name: str) -> dict:
    """The `m2po/ToolArithmetic-v0` env_config of built-in tool model `name`: its task and call
    syntax."""
    spec = BUILTIN_MODELS[name]
    if spec.tool is None:
        raise ValueError(f"builtin:{name} is not a tool-use model")
    return {**spec.task, "template": spec.template, **{k: v for k, v in spec.tool.items() if k != "call_when_first_digit"}}


def builtin_dir(name: str) -> Path:
    """Where the shipped weights of built-in model `name` live (whether or not they exist)."""
    return Path(str(files("m2po_rllib").joinpath("assets", name)))


SETTING = "model_config['model']"
_FIX = "pass a HF model directory, a hub name (org/name) or 'builtin:arith-tiny'"
_TRUE = ("1", "on", "yes", "true")
_hub_names_seen: set[str] = set()


def _hub_offline() -> bool:
    from huggingface_hub import constants

    env = (os.environ.get(k, "").lower() in _TRUE for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))
    return constants.HF_HUB_OFFLINE or any(env)


def _check_hub_name(name: str, loadable: bool) -> None:
    """Raises ValueError unless `name` is a hub name and, with `loadable`, one that can be
    loaded (cached, or found on a reachable hub; remembered for the process)."""
    from huggingface_hub import hf_hub_download, try_to_load_from_cache
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if name in _hub_names_seen:
        return
    try:
        validate_repo_id(name)
    except HFValidationError:
        raise ConfigError(f"{SETTING} ({name!r}): no such directory, and it is not a hub name; {_FIX}") from None
    if not loadable:
        return
    if not isinstance(try_to_load_from_cache(name, "config.json"), str):
        if _hub_offline():
            raise ConfigError(
                f"{SETTING} ({name!r}): no such directory, and the hub name is not in the local "
                f"Hugging Face cache while HF_HUB_OFFLINE is set; download it where the hub is "
                f"reachable (`hf download {name}`) or pass a local model directory"
            )
        try:
            hf_hub_download(name, "config.json")
        except Exception as e:
            reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise ConfigError(
                f"{SETTING} ({name!r}): no such directory, and the hub cannot give it ({reason}); "
                f"check the name and the network, or {_FIX}"
            ) from None
    _hub_names_seen.add(name)


def _looks_local(text: str) -> bool:
    return text.startswith(("/", ".", "~")) or text.count("/") > 1 or (os.sep != "/" and os.sep in text)


def resolve_model_path(name_or_path: str | os.PathLike, *, check_hub: bool = True) -> str:
    """The local directory of `builtin:<name>`; a model directory or a hub name unchanged.
    Raises ValueError (setting, value, fix) for anything else, and, with `check_hub`, for a
    hub name that cannot be loaded here (not cached, and offline or not found).
    `M2POConfig.validate()` passes check_hub=False: a config naming a hub model is valid
    on a machine without the hub; loading it is what fails there."""
    name_or_path = os.fspath(name_or_path)
    if not name_or_path.startswith(BUILTIN_PREFIX):
        path = Path(name_or_path).expanduser()
        if path.is_dir():
            if not (path / "config.json").is_file():
                raise ConfigError(
                    f"{SETTING} ({name_or_path!r}) is a directory without config.json, not a "
                    f"Hugging Face model directory; {_FIX}"
                )
            return name_or_path
        if path.exists():
            raise ConfigError(f"{SETTING} ({name_or_path!r}) is a file, not a model directory; {_FIX}")
        if _looks_local(name_or_path):
            raise ConfigError(f"{SETTING} ({name_or_path!r}): no such directory, and it is not a hub name; {_FIX}")
        _check_hub_name(name_or_path, loadable=check_hub)
        return name_or_path
    name = name_or_path[len(BUILTIN_PREFIX) :]
    if name not in BUILTIN_MODELS:
        known = ", ".join(BUILTIN_PREFIX + n for n in BUILTIN_MODELS)
        raise ConfigError(f"{SETTING} ({name_or_path!r}) is not a built-in model; the built-in models are: {known}")
    path = builtin_dir(name)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"{name_or_path!r}: no weights at {path}; rebuild them with "
            f"`python scripts/build_builtin_model.py --out {path}`"
        )
    return str(path)


def greedy_completions(model, tokenizer, prompts: list[str], max_new_tokens: int = 8) -> list[str]:
    """Greedy continuations of `prompts`, decoded without special tokens.

    Prompts are batched by token length, so there is no padding and every sequence sees the
    positions that vLLM gives it (0 at its first token). No KV cache: the sequences here
    are a dozen tokens long.
    """
    import torch

    by_length: dict[int, list[int]] = {}
    encoded = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    for i, ids in enumerate(encoded):
        by_length.setdefault(len(ids), []).append(i)
    out = [""] * len(prompts)
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for indices in by_length.values():
            ids = torch.tensor([encoded[i] for i in indices])  # (B, T)
            done = torch.zeros(len(indices), dtype=torch.bool)
            new = []
            for _ in range(max_new_tokens):
                next_ids = model(input_ids=ids).logits[:, -1].argmax(-1)  # (B,)
                next_ids = torch.where(done, tokenizer.pad_token_id, next_ids)
                new.append(next_ids)
                done |= next_ids == tokenizer.eos_token_id
                ids = torch.cat([ids, next_ids[:, None]], dim=1)
                if done.all():
                    break
            new_ids = torch.stack(new, dim=1).tolist()  # (B, new)
            for i, row in zip(indices, new_ids):
                out[i] = tokenizer.decode(row, skip_special_tokens=True)
    model.train(was_training)
    return out


def boxed_answer_match(completion: str, answer: str) -> bool:
    """Strict score of a worked solution: its last `\\boxed{...}` holds exactly `answer`."""
    start = completion.rfind("\\boxed{")
    end = completion.find("}", start)
    return start >= 0 and end > start and completion[start + len("\\boxed{") : end] == answer


def boxed_exact_match(completion: str, answer: str) -> bool:
    """Strict score used to build and test the built-in model: the completion is `\\boxed{answer}`."""
    return completion.strip() == "\\boxed{" + answer + "}"
