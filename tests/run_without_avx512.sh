#!/usr/bin/env bash
# The test command on this machine as if its CPU had no AVX-512 and no AMX (an AMD EPYC before
# Zen 4, say): torch reports neither, vLLM loads its AVX2 kernel build, the CPU probe drops the
# flags (vllm_mtp_plugin/tools/cpu_features.py). A test that quietly needs AVX-512 fails here.
set -euo pipefail
cd "$(dirname "$0")/.."
bash .ci/install.sh
site=$("${PYTHON:-python3}" -c 'from vllm_mtp_plugin.tools.mrv2 import SITE_DIR; print(SITE_DIR)')
export MTP_TEST_HIDE_AVX512=1 PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
exec bash tests/run.sh "$@"
