"""The source check of ``tests/versions/check_vllm_sources.py`` against the installed vLLM: every
vLLM name the package imports resolves, and every contract holds or is handled. (Other releases:
run the script itself; it downloads their sources once.)"""

import subprocess
import sys
from support import paths

SCRIPT = paths.TESTS / "versions" / "check_vllm_sources.py"


def test_installed_vllm_meets_every_contract_the_plugin_relies_on():
    out = subprocess.run([sys.executable, str(SCRIPT), "--versions", "installed"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "FAILS" not in out.stdout
    assert "imports (plugin part)" in out.stdout and "all relied-on contracts hold" in out.stdout
