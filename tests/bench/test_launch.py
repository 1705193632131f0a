"""benchmarks.launch: the environment of a bench's MPI children (a fresh world,
tests/runtime/test_child_launch.py; this checkout on PYTHONPATH); its logged and checked child
runs."""
import sys

import pytest

from benchmarks import launch
from hpcgnn.runtime import fresh_world_env


def test_child_env_starts_a_fresh_world_with_this_checkout_first(monkeypatch):
    monkeypatch.setenv("PMI_RANK", "3")
    monkeypatch.setenv("SLURM_STEP_ID", "7")
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "1")
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    env = launch.child_env(NVIDIA_TF32_OVERRIDE="0")
    assert not any(k.startswith(("PMI_", "SLURM_", "OMPI_COMM")) for k in env)
    assert env["PYTHONPATH"].split(":") == [str(launch.ROOT), "/elsewhere"]
    assert env["HPCGNN_PROGRESS"] == "0" and env["NVIDIA_TF32_OVERRIDE"] == "0"


def test_child_env_is_a_fresh_world_env(monkeypatch):
    monkeypatch.setenv("OMPI_MCA_plm_rsh_agent", "/opt/site/rsh")
    env = launch.child_env()
    assert {k: v for k, v in env.items() if k not in ("PYTHONPATH", "HPCGNN_PROGRESS")} == \
        {k: v for k, v in fresh_world_env().items() if k != "PYTHONPATH"}


def test_child_env_of_a_child_env_names_the_checkout_once(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    monkeypatch.setattr(launch.os, "environ", launch.child_env())   # a driver started by a driver
    assert launch.child_env()["PYTHONPATH"].split(":") == [str(launch.ROOT), "/elsewhere"]


def test_ranks_start_with_this_interpreter_or_the_wrapper_named(monkeypatch, tmp_path):
    import subprocess
    import sys

    monkeypatch.delenv(launch.PYTHON_VAR, raising=False)
    assert launch.rank_command(2, ["-m", "hpcgnn", "train"], "/opt/mpiexec") == \
        ["/opt/mpiexec", "-n", "2", sys.executable, "-m", "hpcgnn", "train"]
    # a wrapper in front of the interpreter, split as a shell would, runs the rank's arguments
    record = tmp_path / "wrapped"
    wrapper = tmp_path / "wrap me.sh"
    wrapper.write_text(f'#!/bin/sh\necho "$@" > "{record}"\nexec "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv(launch.PYTHON_VAR, f"'{wrapper}' {sys.executable}")
    cmd = launch.rank_command(1, ["-c", "print(6 * 7)"])
    assert cmd[1:5] == ["-n", "1", str(wrapper), sys.executable]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=launch.child_env())
    assert proc.returncode == 0 and proc.stdout.split() == ["42"], proc.stderr
    assert record.read_text().split() == [sys.executable, "-c", "print(6", "*", "7)"]


def test_run_logged_and_run_checked_keep_the_log_and_stop_on_failure(tmp_path):
    ok = [sys.executable, "-c", "print('made it')"]
    rc, wall = launch.run_logged(ok, tmp_path / "ok.log", timeout=60)
    assert rc == 0 and wall > 0
    assert (tmp_path / "ok.log").read_text().splitlines() == [" ".join(ok), "made it"]
    assert launch.run_checked(ok, tmp_path / "ok2.log", 60, "bench") > 0

    bad = [sys.executable, "-c", "import sys; print('no input'); sys.exit(3)"]
    with pytest.raises(SystemExit) as e:
        launch.run_checked(bad, tmp_path / "bad.log", 60, "benchmarks.x")
    first, *rest = str(e.value.code).splitlines()
    assert first == f"benchmarks.x: {' '.join(bad)} failed (exit 3)" and "no input" in rest

    slow = [sys.executable, "-c", "import time; time.sleep(60)"]
    rc, wall = launch.run_logged(slow, tmp_path / "slow.log", timeout=0.5)
    assert rc is None and wall < 30                # killed with its process group
    with pytest.raises(SystemExit, match=r"timed out after 0\.5 s"):
        launch.run_checked(slow, tmp_path / "slow2.log", 0.5, "bench")


def test_a_timed_out_child_takes_what_it_started_in_other_sessions_along(tmp_path):
    """A bench driver starts each mpiexec in a session of its own: when the driver outlives its
    timeout, those grandchildren die with it instead of holding the GPU and the cores."""
    import os
    import time

    pidfile = tmp_path / "grandchild.pid"
    driver = (f"import subprocess, sys, time\n"
              f"p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], "
              f"start_new_session=True)\n"
              f"open({str(pidfile)!r}, 'w').write(str(p.pid))\n"
              f"time.sleep(120)\n")
    rc, wall = launch.run_logged([sys.executable, "-c", driver], tmp_path / "driver.log", timeout=3)
    assert rc is None and wall < 60
    grandchild = int(pidfile.read_text())
    for _ in range(100):                   # reaped by init once killed
        try:
            os.kill(grandchild, 0)
        except ProcessLookupError:
            break
        with open(f"/proc/{grandchild}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                break                      # killed, not yet reaped
        time.sleep(0.1)
    else:
        raise AssertionError(f"grandchild {grandchild} still runs after its driver timed out")
