#!/usr/bin/env bash
# The test command on this machine as if its CPU had no AVX-512 and no AMX (an AMD EPYC before
# Zen 4, say): torch reports neither, vLLM loads its AVX2 kernel build, the CPU probe drops the
# flags (vllm_mtp_plugin/tools/cpu_features.py). A test that quietly needs AVX-512 fails here.
set -euo pipefail
cd "$(dirname "$0")/.."
bash .ci/install.sh
# The switch acts in tests/mrv2_harness/sitecustomize.py, first thing in every process.
export MTP_TEST_HIDE_AVX512=1 PYTHONPATH="$PWD/tests/mrv2_harness${PYTHONPATH:+:$PYTHONPATH}"
exec bash tests/run.sh "$@"
