"""bench/gpu_check.sh, the prepared GPU run, on this CPU machine: its steps and their caps
(--dry-run), and the end-to-end training step in its CPU form (a tiny Qwen3, the HF engine)."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BUDGET_S = 600  # the whole check: 10 minutes of a lent GPU


def test_the_dry_run_lists_every_step_and_the_caps_fit_ten_minutes(tmp_path):
    proc = subprocess.run(["bash", "bench/gpu_check.sh", "--dry-run"], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "OUT": str(tmp_path / "gpu")})
    assert proc.returncode == 0, proc.stderr[-2000:]
    steps = dict(re.findall(r"^\[gpu_check\] (\w+) \(at most (\d+)s\)", proc.stdout, flags=re.M))
    assert {"vllm", "learner", "train", "summary"} <= set(steps), proc.stdout
    assert "bench/gpu_train_check.py" in proc.stdout
    script = (REPO / "bench" / "gpu_check.sh").read_text()
    install = int(re.search(r"INSTALL_S=(\d+)", script).group(1))  # skipped where vllm imports, as here
    assert install + sum(int(s) for s in steps.values()) <= BUDGET_S
    assert not (tmp_path / "gpu" / "train.json").exists()  # a dry run runs nothing


def test_learner_only_runs_the_learner_step_alone_and_a_bad_option_is_refused(tmp_path):
    """--learner-only (what runs where vLLM and Ray cannot be installed) lists the learner
    and summary steps, neither the install nor the vLLM and training steps."""
    env = {**os.environ, "OUT": str(tmp_path / "gpu")}
    proc = subprocess.run(["bash", "bench/gpu_check.sh", "--dry-run", "--learner-only"], cwd=REPO,
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert re.findall(r"^\[gpu_check\] (\w+) \(at most", proc.stdout, flags=re.M) == ["learner", "summary"]
    bad = subprocess.run(["bash", "bench/gpu_check.sh", "--learner"], cwd=REPO, capture_output=True, text=True,
                         timeout=120, env={**os.environ, "OUT": str(tmp_path / "bad")})
    assert bad.returncode == 2 and "unknown option '--learner'" in bad.stderr
    assert not (tmp_path / "bad").exists()  # refused before anything is written


@pytest.mark.slow
def test_the_training_step_trains_the_one_gpu_config_and_the_summary_shows_it(tmp_path, ray_session, monkeypatch,
                                                                               caplog):
    """The CPU form of gpu_train_check.py: the one-GPU config (colocated) through the RLlib API
    on a tiny model of Qwen3-1.7B's layout, 3 iterations; then the summary's table. The script
    runs in this process, on the test session's Ray (on the device it starts its own)."""
    import runpy

    out = tmp_path / "gpu"
    script = REPO / "bench" / "gpu_train_check.py"
    monkeypatch.setattr(sys, "argv", [str(script), "--dry-run", "--out", str(out / "train.json")])
    with caplog.at_level(logging.WARNING), pytest.raises(SystemExit) as exited:
        runpy.run_path(str(script), run_name="__main__")
    assert exited.value.code == 0
    report = json.loads((out / "train.json").read_text())
    assert report["mode"] == "dry-run" and report["config"] == "configs/qwen3_1.7b_1gpu_colocated.yaml"
    assert report["model"]["layout"].startswith("Qwen3-1.7B-Base")
    records, summary = report["records"], report["summary"]
    # staleness 2 = 1 step of lag at 2 updates a step: the queue fills, then every step trains
    assert [r["policy_version"] for r in records] == [0, 2, 4] and summary["updates"] == 4
    assert summary["updates_per_s"] > 0 and summary["rollout_tokens_per_s"] > 0 and summary["learner_tokens_per_s"] > 0
    # colocated: the sleep and wake are timed around each update (skipped on CPU, said in the log)
    assert [r["rollout/engine_sleep_s"] is not None for r in records] == [False, True, True]
    assert "the sleep step is skipped" in caplog.text
    assert report["peak_gpu_memory_gib"] is None and "mfu" not in summary  # no GPU here
    summary_proc = subprocess.run([sys.executable, "bench/gpu_summary.py", str(out), "--out", str(tmp_path / "g.json")],
                                  cwd=REPO, capture_output=True, text=True, timeout=60)
    assert re.search(r"^train: iterations, updates +3, 4$", summary_proc.stdout, flags=re.M), summary_proc.stdout
    assert json.loads((tmp_path / "g.json").read_text())["train"]["summary"] == summary
