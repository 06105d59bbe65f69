#!/usr/bin/env bash
# Build the heavy-clients tier's own virtual environment (.venv-clients, gitignored): guidellm and
# lm-evaluation-harness, which pull datasets, transformers 5, scikit-learn... of their own, apart from
# the main .venv. The tier's tests run in the main .venv and call this environment's `guidellm` and
# `lm_eval` commands against a server on loopback.
#
#   1. torch==2.13.0 (the CPU wheel) first, so their dependencies do not pull another torch build;
#   2. guidellm==0.8.1 and lm-eval[api,hf]==0.4.13 (its API models need tenacity, its hf model
#      accelerate) with torch held at that version.
# Prints the wall time and the size of the environment at the end.
#
# Usage: scripts/setup_clients_env.sh [VENV_DIR]    (PYTHON=python3.11 to choose the interpreter)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-$ROOT/.venv-clients}"
PYTHON="${PYTHON:-python3}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
GUIDELLM_VERSION="${GUIDELLM_VERSION:-0.8.1}"
LM_EVAL_VERSION="${LM_EVAL_VERSION:-0.4.13}"

start=$(date +%s)
step() { echo "[setup_clients_env +$(( $(date +%s) - start ))s] $*"; }

if [[ -x "$VENV/bin/lm_eval" ]] && "$VENV/bin/guidellm" --version 2>/dev/null | grep -q "$GUIDELLM_VERSION"; then
  step "$VENV already has guidellm $GUIDELLM_VERSION and lm_eval"
else
  step "creating $VENV with $($PYTHON -V 2>&1)"
  "$PYTHON" -m venv "$VENV"
  step "installing torch==$TORCH_VERSION"
  "$VENV/bin/pip" install --quiet "torch==$TORCH_VERSION"
  step "installing guidellm==$GUIDELLM_VERSION and lm-eval==$LM_EVAL_VERSION"
  "$VENV/bin/pip" install --quiet "guidellm==$GUIDELLM_VERSION" "lm-eval[api,hf]==$LM_EVAL_VERSION" \
    "torch==$TORCH_VERSION"
fi
"$VENV/bin/guidellm" --version
step "done in $(( $(date +%s) - start ))s; size $(du -sh "$VENV" | cut -f1)"
