"""The real `m2po` CLI on a tiny config: what it writes, resume, eval, export, Ctrl-C."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]


def _overrides(model_dir: str) -> list[str]:
    return [
        f"rl_module.model_config.model={model_dir}",
        "environment.env_config.digits=2",
        "env_runners.max_new_tokens=4",
        "training.prompts_per_step=4",
        "training.group_size=4",
        "training.minibatch_prompts=2",
        "training.staleness=2",
        "evaluation.evaluation_interval=2",
        "evaluation.evaluation_duration=8",
    ]


def _m2po(*args, cwd=REPO, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "m2po_rllib.cli", *args], cwd=cwd, capture_output=True, text=True, timeout=600, **kw
    )



def test_help_lists_subcommands():
    out = _m2po("--help")
    assert out.returncode == 0
    for cmd in ("train", "eval", "export"):
        assert cmd in out.stdout


def test_bad_override_is_a_clear_error(tmp_path):
    out = _m2po("train", "--output", str(tmp_path / "r"), "lr=1e-5")
    assert out.returncode == 2
    assert "needs a section" in out.stderr and "training.lr=1e-5" in out.stderr


def test_train_resume_eval_export(tiny_model_dir, tmp_path):
    run = tmp_path / "run"
    # weight decay moves the weights even when every reward of the random model is 0
    args = [*_overrides(tiny_model_dir), "training.weight_decay=0.1", "training.lr=1e-2"]
    # a relative --output (run from tmp_path), with a checkpoint inside the loop
    out = _m2po(
        "train", "--stop-iters", "2", "--checkpoint-every", "1", "--output", "run", "--no-progress", *args,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["iterations"] == 2 and summary["policy_version"] == 2  # step 1 fills the queue
    assert 0.0 <= summary["start_heldout_accuracy"] <= 1.0
    assert "end_heldout_accuracy" in summary and "held-out accuracy (end)" in out.stdout
    assert (run / "checkpoint" / "rllib_checkpoint.json").exists()
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    history = json.loads((run / "history.json").read_text())
    assert [h["iteration"] for h in history] == [1, 2]

    out = _m2po("train", "--resume", str(run), "--stop-iters", "3", "--no-progress")
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["iterations"] == 3 and summary["policy_version"] == 4
    assert [h["iteration"] for h in json.loads((run / "history.json").read_text())] == [1, 2, 3]

    out = _m2po("eval", "--checkpoint", str(run), "--num", "6")
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout[out.stdout.index("{") :])
    assert result["problems"] == 6 and 0.0 <= result["greedy_accuracy"] <= 1.0

    hf_dir = tmp_path / "hf"
    out = _m2po("export", "--checkpoint", str(run), "--out", str(hf_dir))
    assert out.returncode == 0, out.stderr[-3000:]
    import torch
    from transformers import AutoModelForCausalLM

    from m2po_rllib.export import load_policy_module

    exported = AutoModelForCausalLM.from_pretrained(hf_dir).state_dict()
    trained = load_policy_module(run).model.state_dict()
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    assert all(torch.equal(exported[k], trained[k]) for k in trained)
    assert any(not torch.equal(exported[k], base[k]) for k in base), "export holds the base weights"


def test_ctrl_c_saves_a_checkpoint_and_exits_cleanly(tiny_model_dir, tmp_path):
    run = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "m2po_rllib.cli", "train", "--stop-iters", "1000", "--output", str(run),
         "--no-progress", *_overrides(tiny_model_dir)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    deadline = time.time() + 300
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("iter 2:") or time.time() > deadline:
            break
    proc.send_signal(signal.SIGINT)
    rest, _ = proc.communicate(timeout=300)
    output = "".join(lines) + rest
    assert proc.returncode == 130, output[-3000:]
    assert "checkpoint saved" in output and "--resume" in output
    assert (run / "checkpoint" / "rllib_checkpoint.json").exists()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["interrupted"] is True and 2 <= summary["iterations"] < 1000
