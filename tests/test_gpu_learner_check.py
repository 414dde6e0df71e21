"""bench/gpu_learner_check.py, the script for the first GPU run, in its CPU mode."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_cpu_tiny_mode_runs_updates_and_writes_its_figures_without_ray_or_vllm(tmp_path):
    """Run as on the lent GPU machines, which have torch and transformers but neither Ray nor
    vLLM nor this package installed (and nothing to install them from): Ray and vLLM made
    unimportable in the script's process, the package's editable install hidden, the
    script's own folder first on the path as `python bench/gpu_learner_check.py` has it."""
    out = tmp_path / "check.json"
    argv = ["bench/gpu_learner_check.py", "--device", "cpu", "--tiny", "--steps", "1", "--threads", "1",
            "--out", str(out)]
    code = ("import runpy, sys; sys.modules['ray'] = sys.modules['vllm'] = None; "
            "sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in f.__module__]; "
            f"sys.path[0] = {str(REPO / 'bench')!r}; "
            f"sys.argv = {argv!r}; runpy.run_path(sys.argv[0], run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
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
