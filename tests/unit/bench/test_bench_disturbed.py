"""A disturbed measurement is run again, not pooled: the interference meter sees a real busy
process the test starts, and the offline bench replaces that engine process's figures."""

import subprocess
import sys
import time

from vllm_mtp_plugin.tools.bench import offline_mode
from vllm_mtp_plugin.tools.engine.interference import BUSY_SHARE, Meter, disturbed
from vllm_mtp_plugin.tools.bench.sweep import Config, Sweep

BURN_S = 2.0
BURNER = f"import time\nend = time.time() + {BURN_S}\nwhile time.time() < end: pass\n"


def _burner() -> subprocess.Popen:
    """A process of its own session that spins one core for BURN_S seconds (not this process's
    waited-for child while measured, so its CPU time counts as other work)."""
    return subprocess.Popen([sys.executable, "-c", BURNER], start_new_session=True)


def test_the_meter_sees_a_busy_process_and_a_quiet_wait_is_not_disturbed():
    with Meter() as quiet:
        time.sleep(1.0)
    burner = _burner()
    try:
        with Meter() as busy:
            time.sleep(BURN_S)
    finally:
        burner.wait()
    assert busy.result()["other_cpu_s"] >= 0.5 * BURN_S, busy.result()
    assert disturbed(busy.result())
    # quiet: whatever else this machine runs, far less than a spinning core
    assert quiet.result()["other_cpu_s"] < busy.result()["other_cpu_s"]
    assert not disturbed({"other_cpu_s": 0.0, "wall_s": 1.0}, cpus=2)
    assert disturbed({"other_cpu_s": 2 * BUSY_SHARE * 1.0 * 2 + 0.01, "wall_s": 1.0}, cpus=2)


def test_a_disturbed_engine_process_is_run_again(monkeypatch, tmp_path):
    attempts, burners = [], []

    def run_config(config, timeout, log_path, env):  # the engine's place: one busy, then quiet
        attempts.append(config)
        if len(attempts) == 1:
            burners.append(_burner())
            time.sleep(BURN_S)
        return {"runs": [], "attempt": len(attempts)}

    monkeypatch.setattr(offline_mode, "run_config", run_config)
    monkeypatch.setattr(offline_mode, "offline_config", lambda *args: "config")
    try:
        result = offline_mode.run_process(Sweep(disturbed_retries=2), None,
                                          Config("tiny", "plugin", 1, 1, "on"), [], tmp_path / "l")
    finally:
        for burner in burners:
            burner.wait()
    assert result["attempt"] >= 2 and len(result["discarded_disturbed"]) == result["attempt"] - 1
    assert result["discarded_disturbed"][0]["other_cpu_s"] >= 0.5 * BURN_S
