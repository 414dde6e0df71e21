"""Checkpoints -> the policy's RLModule, or a plain Hugging Face model directory."""

from __future__ import annotations

import os
from pathlib import Path

MODULE_SUBDIR = Path("learner_group") / "learner" / "rl_module" / "default_policy"


def find_checkpoint(path: str | os.PathLike) -> Path:
    """An algorithm checkpoint directory, given it or a run directory holding `checkpoint/`."""
    path = Path(path).expanduser().resolve()  # RLlib reads a relative path as a URI
    for candidate in (path, path / "checkpoint"):
        if (candidate / "rllib_checkpoint.json").exists():
            return candidate
    raise FileNotFoundError(
        f"no RLlib checkpoint at {path} (looked for rllib_checkpoint.json in it and in "
        f"{path / 'checkpoint'}); pass the run directory `m2po train` printed"
    )


def load_policy_module(checkpoint: str | os.PathLike):
    """The trained `HFCausalLMModule` of a checkpoint (weights restored, on CPU)."""
    from ray.rllib.core.rl_module.rl_module import RLModule

    module_dir = find_checkpoint(checkpoint) / MODULE_SUBDIR
    if not module_dir.exists():
        raise FileNotFoundError(f"{module_dir} is missing: not an M2PO checkpoint?")
    return RLModule.from_checkpoint(str(module_dir))


def export_checkpoint(checkpoint: str | os.PathLike, out: str | os.PathLike) -> str:
    """Writes the checkpoint's policy and tokenizer as a HF directory (transformers + vLLM)."""
    from transformers import AutoTokenizer

    module = load_policy_module(checkpoint)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    module.model.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(module.model_path).save_pretrained(out)
    return str(out)
