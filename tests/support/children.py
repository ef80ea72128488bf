"""Python code run in a child process that prints its facts as JSON on its last line."""

import json
import subprocess
import sys


def python_json(code: str, env: dict, timeout: float = 300) -> dict:
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
