"""The test suite's fork server (tests/zygote.py): a run through it is the run a fresh
``python ARGS`` would be (arguments, paths, streams, exit status, signals, MPI), and whatever
would differ starts a fresh interpreter instead."""
from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import zygote
from mpiutil import MPIEXEC, clean_env

# What the probe prints: everything a launched program sees of how it was started.
PROBE = """\
import json, os, sys
print(json.dumps({"argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(), "name": __name__,
                  "file": globals().get("__file__"), "stdin": sys.stdin.read(),
                  "streams": [(s.name, s.mode, s.line_buffering, s.write_through, type(s.buffer).__name__) for s in (sys.stdin, sys.stdout, sys.stderr)],
                  "sid_is_pid": os.getsid(0) == os.getpid()}))
print(json.dumps({"preloaded": "torch" in sys.modules, "ppid": os.getppid()}))
sys.exit(3)
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A fork server of this module's own: (socket path, server pid, log path)."""
    d = tmp_path_factory.mktemp("zyg")
    sock, log = d / "s", d / "log"
    with open(log, "w") as f:
        proc = subprocess.Popen(zygote.server_command(sock), env=clean_env(),
                                stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 120
    while not sock.exists():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.05)
    yield sock, proc.pid, log
    proc.terminate()
    proc.wait(timeout=30)


def through(server, args, env=None, **kw) -> subprocess.Popen | subprocess.CompletedProcess:
    """``python ARGS`` through the server (``popen=True``: the running client)."""
    cmd = [*zygote.client_command(server[0]), *map(str, args)]
    if kw.pop("popen", False):
        return subprocess.Popen(cmd, env=clean_env(env), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, **kw)
    return subprocess.run(cmd, env=clean_env(env), capture_output=True, text=True, timeout=60, **kw)


def fresh(args, env=None, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *map(str, args)], env=clean_env(env), capture_output=True,
                          text=True, timeout=60, **kw)


def first_line(proc: subprocess.Popen, timeout: float = 60) -> str:
    """The running client's first line of output; kills it and fails after ``timeout`` s."""
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    if not ready:
        proc.kill()
        pytest.fail(f"no output within {timeout} s: {proc.args}")
    return proc.stdout.readline()


def seen(proc) -> tuple[dict, dict]:
    lines = proc.stdout.splitlines()
    return json.loads(lines[0]), json.loads(lines[1])


@pytest.mark.parametrize("form", ["script", "module", "code"])
def test_a_forked_run_sees_what_a_fresh_one_sees(server, tmp_path, form):
    (tmp_path / "probe.py").write_text(PROBE)
    args = {"script": [tmp_path / "probe.py", "a", "-b"], "module": ["-m", "probe", "a", "-b"],
            "code": ["-c", PROBE, "a", "-b"]}[form]
    kw = dict(cwd=tmp_path, input="from stdin\n")
    forked, ref = through(server, args, **kw), fresh(args, **kw)
    assert (forked.returncode, ref.returncode) == (3, 3), forked.stderr + ref.stderr
    assert seen(forked)[0] == {**seen(ref)[0], "sid_is_pid": True}
    assert seen(forked)[1] == {"preloaded": True, "ppid": server[1]}   # a fork of the server
    assert seen(ref)[1]["preloaded"] is False
    assert forked.stderr == ref.stderr == ""


def test_the_package_is_preloaded_but_never_mpi(server, tmp_path):
    """A fork starts with hpcgnn's modules imported, except those that import mpi4py.MPI (its
    import initialises MPI: a rank does that itself) and the drivers."""
    names = ["hpcgnn.cli", "hpcgnn.engine.fullgraph", "hpcgnn.runtime", "hpcgnn.comm.alltoall", "mpi4py.MPI",
             "benchmarks.launch", "hpcgnn.run.plot"]
    code = f"import json, sys; print(json.dumps([m in sys.modules for m in {names!r}]))"
    proc = through(server, ["-c", code], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == [True, True, True, False, False, False, False]
    log = server[2].read_text()
    assert "zygote: preloaded torch, numpy, h5py, mpi4py and hpcgnn from " in log
    assert "(left out: hpcgnn.comm.alltoall)" in log


def test_another_copy_of_the_package_on_the_path_runs_fresh(server, tmp_path):
    (tmp_path / "hpcgnn").mkdir()
    (tmp_path / "hpcgnn" / "__init__.py").write_text("WHICH = 'the copy'\n")
    (tmp_path / "probe.py").write_text("import sys, hpcgnn\nprint(getattr(hpcgnn, 'WHICH', 'preloaded'), "
                                       "'torch' in sys.modules)\n")
    proc = through(server, [tmp_path / "probe.py"])
    assert (proc.returncode, proc.stdout.split()) == (0, ["the", "copy", "False"]), proc.stderr
    assert f"{tmp_path / 'hpcgnn'} would be imported, not the preloaded" in server[2].read_text()


def test_exit_status_and_signals_pass_through(server):
    err = through(server, ["-c", "raise ValueError('boom')"])
    assert err.returncode == 1 and err.stderr.rstrip().endswith("ValueError: boom"), err.stderr
    killed = through(server, ["-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"])
    assert killed.returncode == -signal.SIGKILL
    # a signal sent to the client (as a launcher or batch system does) reaches the program
    proc = through(server, ["-c", "import signal, sys, time\n"
                            "signal.signal(signal.SIGTERM, lambda *a: sys.exit(5))\n"
                            "print('ready', flush=True)\n"
                            "for _ in range(600):\n    time.sleep(0.1)"], popen=True)  # see test_supervisor.SLEEP_60_S
    assert first_line(proc) == "ready\n"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 5


def test_a_killed_client_takes_its_program_with_it(server):
    proc = through(server, ["-c", "import os, time; print(os.getpid(), flush=True); time.sleep(60)"], popen=True)
    pid = int(first_line(proc))
    proc.kill()
    proc.wait(timeout=30)
    deadline = time.monotonic() + 30
    while Path(f"/proc/{pid}").exists():         # the server reaps it: no zombie stays either
        assert time.monotonic() < deadline, f"pid {pid} outlived its client"
        time.sleep(0.05)


@pytest.mark.parametrize("change,why", [
    ({"env": {"SOME_LIBRARY_SETTING": "1"}}, "environment differs in SOME_LIBRARY_SETTING"),
    ({"env": {"OMP_NUM_THREADS": "2"}}, "environment differs in OMP_NUM_THREADS"),
    ({"preexec_fn": lambda: os.umask(0o077)}, "process differs in Umask"),
    ({"args": ["-u"]}, "interpreter option -u"),
])
def test_what_would_differ_runs_in_a_fresh_interpreter(server, change, why):
    code = "import sys, os; print('torch' in sys.modules, os.environ.get('OMP_NUM_THREADS'))"
    proc = through(server, [*change.get("args", []), "-c", code], env=change.get("env"),
                   preexec_fn=change.get("preexec_fn"))
    assert proc.returncode == 0, proc.stderr
    threads = change.get("env", {}).get("OMP_NUM_THREADS", "1")
    assert proc.stdout.split() == ["False", threads]          # not preloaded: a fresh interpreter
    assert why in server[2].read_text()


def test_mpi_ranks_are_forks_that_reach_each_other(server):
    code = ("import json, os, sys\nfrom mpi4py import MPI\nc = MPI.COMM_WORLD\n"
            "seen = c.gather((c.rank, c.allreduce(c.rank + 1), 'torch' in sys.modules, os.getppid()))\n"
            "if c.rank == 0:\n"
            "    print(json.dumps(seen), flush=True)\n"
            "if c.rank == 1 and len(sys.argv) > 1:\n"
            "    import signal; os.kill(os.getpid(), signal.SIGKILL)\n"
            "c.barrier()\n")
    cmd = [str(MPIEXEC), "-n", "2", *zygote.client_command(server[0]), "-c", code]
    ok = subprocess.run(cmd, env=clean_env(), capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout) == [[0, 3, True, server[1]], [1, 3, True, server[1]]]   # forks of the server
    # a rank killed by a signal: the launcher sees it killed and ends the job
    dead = subprocess.run(cmd + ["kill"], env=clean_env(), capture_output=True, text=True, timeout=120)
    assert dead.returncode != 0
    assert "Killed (signal 9)" in dead.stdout + dead.stderr, dead.stdout + dead.stderr
