"""bench/gpu_learner_check.py, the script for the first GPU run, in its CPU mode."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_cpu_tiny_mode_runs_updates_and_writes_its_figures(tmp_path):
    out = tmp_path / "check.json"
    proc = subprocess.run(
        [sys.executable, "bench/gpu_learner_check.py", "--device", "cpu", "--tiny", "--steps", "1",
         "--threads", "1", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    for path in ("chunked", "full_logits"):
        r = result[path]
        assert r["tokens_per_s"] > 0 and r["seconds_per_update"] > 0
        assert r["peak_memory_gib"] >= r["memory_before_updates_gib"] > 0
    # bf16 weights: the two paths differ by bf16 rounding only
    assert 0 < result["grad_max_rel_diff_chunked_vs_full"] < 5e-2
    assert result["settings"]["dtype"] == "bfloat16" and result["model"]["parameters"] > 0
    assert "tokens/s" in proc.stdout and "plan estimate" in proc.stdout
