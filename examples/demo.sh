#!/usr/bin/env bash
# The main job on a fresh CPU machine: install, then serve a tiny DeepSeek checkpoint with MTP over
# the OpenAI API and print its acceptance. Extra arguments go to `vllm-mtp demo` (see --help).
set -euo pipefail
cd "$(dirname "$0")/.."
bash .ci/install.sh
exec vllm-mtp demo "$@"
