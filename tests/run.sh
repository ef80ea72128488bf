#!/usr/bin/env bash
# The test command: installs what it needs, then runs the whole suite on the real vLLM CPU engine.
set -euo pipefail
cd "$(dirname "$0")/.."
bash .ci/install.sh
export VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_KVCACHE_SPACE=1
export VLLM_CACHE_ROOT="${VLLM_CACHE_ROOT:-$(mktemp -d)}"
# Arguments go to pytest; without a tests/... path among them the whole suite runs.
case " $* " in *" tests"*) ;; *) set -- tests "$@" ;; esac
# Two pytest workers (MTP_TEST_WORKERS), one test file each at a time: most of an engine's start is
# one busy core (imports, tracing, C++ builds), so two files share the machine's two cores well.
# Files go out slowest first by tests/durations.json, which every run of the whole suite rewrites
# (tests/support/durations.py).
exec "${PYTHON:-python3}" -m pytest -q -rs --durations=25 -p no:cacheprovider \
    -n "${MTP_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder "$@"
