#!/usr/bin/env bash
# The short GPU run (<= 10 minutes on one H100/H200), from the repo root of a bare machine:
#   bash bench/gpu_check.sh [--dry-run] [--learner-only]
# Installs the GPU extras unless vllm and ray already import, then writes under ${OUT:-bench/results/gpu}:
#   nvidia-smi.txt, vllm.json/.log (bench/gpu_vllm_check.py: a 1.5B-shaped model in vLLM, the
#   runner engine's tokens/s against raw vLLM generate, weight-sync seconds by the object store
#   and the native path: NCCL with 2+ GPUs, gloo with one), learner.json/.log
#   (bench/gpu_learner_check.py), train.json/.log (bench/gpu_train_check.py: the one-GPU config,
#   vLLM colocated with the learner, trained for ~1 minute on a random Qwen3-1.7B-layout model),
#   then prints one table and writes bench/results/gpu.json
#   (bench/gpu_summary.py). --dry-run prints the steps without running them. --learner-only
#   (or an install that fails: a machine that cannot fetch packages) runs the learner step
#   alone, which needs only torch and transformers; the vLLM and training steps need vLLM and Ray.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
OUT=${OUT:-bench/results/gpu}
DRY_RUN=0 ENGINE=1
for arg in "$@"; do
  case $arg in
    --dry-run) DRY_RUN=1 ;;
    --learner-only) ENGINE=0 ;;
    *) echo "bench/gpu_check.sh: unknown option '$arg' (options: --dry-run, --learner-only)" >&2; exit 2 ;;
  esac
done
if [[ -n ${PYTHON:-} ]]; then PY=$PYTHON
elif [[ -x .venv/bin/python ]]; then PY=.venv/bin/python
else PY=python3; fi
# Seconds per step; the whole run stays under 10 minutes even when every step hits its cap.
INSTALL_S=120 VLLM_S=220 LEARNER_S=90 TRAIN_S=160 SUMMARY_S=10

step() {  # step NAME SECONDS CMD...: runs CMD under a time cap, logs to $OUT/NAME.log
  local name=$1 seconds=$2; shift 2
  echo "[gpu_check] $name (at most ${seconds}s): $*"
  [[ $DRY_RUN == 1 ]] && return 0
  local t0=$SECONDS
  timeout --kill-after=10 "$seconds" "$@" 2>&1 | tee "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "[gpu_check] $name: exit $rc after $((SECONDS - t0))s"
  return "$rc"
}

mkdir -p "$OUT"
echo "[gpu_check] python: $PY, results: $OUT"
if [[ $DRY_RUN == 0 ]]; then
  nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || echo "[gpu_check] nvidia-smi failed (see $OUT/nvidia-smi.txt)"
fi
status=0
if [[ $ENGINE == 0 ]]; then
  echo "[gpu_check] --learner-only: the vLLM and training steps are skipped"
elif "$PY" -c "import vllm, ray" 2>/dev/null; then
  echo "[gpu_check] vllm and ray import: skipping the install"
else
  # --retries/--timeout: where no package index can be reached pip gives up early, not at the cap
  step install "$INSTALL_S" "$PY" -m pip install -q --retries 1 --timeout 10 -c constraints/gpu.txt -e ".[gpu]" \
    || { ENGINE=0 status=1; echo "[gpu_check] install failed (see $OUT/install.log): without vLLM and Ray only the learner step runs"; }
fi
if [[ $ENGINE == 1 ]]; then
  step vllm "$VLLM_S" "$PY" bench/gpu_vllm_check.py --out "$OUT/vllm.json" || status=1
fi
if [[ -f bench/gpu_learner_check.py ]]; then
  step learner "$LEARNER_S" "$PY" bench/gpu_learner_check.py --device cuda --out "$OUT/learner.json" || status=1
else
  echo "[gpu_check] bench/gpu_learner_check.py not present: skipped"
fi
if [[ $ENGINE == 1 ]]; then
  step train "$TRAIN_S" "$PY" bench/gpu_train_check.py --minutes 1.2 --out "$OUT/train.json" || status=1
fi
step summary "$SUMMARY_S" "$PY" bench/gpu_summary.py "$OUT" --out bench/results/gpu.json || status=1
echo "[gpu_check] done (status $status); results in $OUT and bench/results/gpu.json"
exit $status
