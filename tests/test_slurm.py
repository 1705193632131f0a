"""The SLURM scripts on a real single-node SLURM started for this session.

The ``slurm`` fixture installs Debian's slurm-wlm when it is missing (root only),
writes a slurm.conf for a machine without systemd or cgroups (see
/work/shared/notes/platform.md), and starts a private munged, slurmctld and
slurmd on free ports with every file in a temporary directory, so concurrent
sessions do not meet. Where that is impossible the tests are skipped with the
reason. Every command has a timeout; the daemons (and any job left) end with
the session.
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import pwd
import random
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import numpy as np
import pytest
from mpiutil import ROOT, clean_env

from hpcgnn.demos.hello import parse

pytestmark = pytest.mark.slurm

SBIN_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin", "/usr/bin"])
NODE_CPUS = 4          # declared (SlurmdParameters=config_overrides), more than the 2 real cores
# A job credential's lifetime (AuthInfo cred_expire, SLURM's default 120 s), which is also how long a
# requeued job waits before it may start again: slurmd refuses a credential created in or before the
# second its job was revoked ("Job N already killed, do not launch batch job"), so forcing an early
# start (scontrol update StartTime=now) races with the revocation of the first start
CRED_EXPIRE_S = 10
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
            "PREEMPTED", "BOOT_FAIL", "DEADLINE"}


def _which(name: str) -> str | None:
    return shutil.which(name, path=SBIN_PATH)


def _skip(reason: str):
    print(f"\ntest_slurm: skipped: {reason}", file=sys.stderr)
    pytest.skip(reason)


def _install_slurm() -> None:
    """apt-get install slurm-wlm (apt-get update first only if that fails); skip when impossible."""
    if os.geteuid() != 0:
        _skip("slurmctld is not installed and we are not root to apt-get install slurm-wlm")
    if _which("apt-get") is None:
        _skip("slurmctld is not installed and there is no apt-get")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    install = ["apt-get", "install", "-y", "-q", "slurm-wlm"]
    try:
        proc = subprocess.run(install, capture_output=True, text=True, timeout=300, env=env)
        if proc.returncode != 0:
            subprocess.run(["apt-get", "update", "-q"], capture_output=True, text=True, timeout=300, env=env)
            proc = subprocess.run(install, capture_output=True, text=True, timeout=300, env=env)
    except subprocess.TimeoutExpired:
        _skip("apt-get install slurm-wlm timed out")
    if proc.returncode != 0 or _which("slurmctld") is None:
        _skip(f"apt-get install slurm-wlm failed: {(proc.stdout + proc.stderr).strip()[-300:]}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _slurm_conf(base: Path, host: str, munge_socket: Path) -> str:
    """The configuration. Job IDs start at a random number: MPICH names its shared-memory
    segments after the PMI job ID, and a fresh cluster's job 1 would meet the segments an
    aborted job 1 of an earlier session left in /dev/shm (MPI_Init then fails or hangs)."""
    return f"""\
ClusterName=hpcgnntest
FirstJobId={random.SystemRandom().randrange(1_000_000, 60_000_000)}
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
SlurmUser=root
AuthType=auth/munge
AuthInfo=socket={munge_socket},cred_expire={CRED_EXPIRE_S}
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
MpiDefault=none
ReturnToService=2
KillWait=5
StateSaveLocation={base}/state
SlurmdSpoolDir={base}/spool
SlurmctldPidFile={base}/slurmctld.pid
SlurmdPidFile={base}/slurmd.pid
SlurmctldLogFile={base}/slurmctld.log
SlurmdLogFile={base}/slurmd.log
NodeName={host} NodeAddr=127.0.0.1 CPUs={NODE_CPUS} State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""


def _munge_key() -> Path:
    """The munge key, created (1 KiB random, munge-owned, 0400) when missing."""
    key = Path("/etc/munge/munge.key")
    if not key.exists():
        pw = pwd.getpwnam("munge")
        key.parent.mkdir(parents=True, exist_ok=True)
        key.write_bytes(os.urandom(1024))
        os.chown(key.parent, pw.pw_uid, pw.pw_gid)
        os.chmod(key.parent, 0o700)
        os.chown(key, pw.pw_uid, pw.pw_gid)
        os.chmod(key, 0o400)
    return key


def _processes_with_env(entry: str) -> list[int]:
    """PIDs (not ours) whose environment holds ``entry`` exactly, e.g. our private SLURM_CONF."""
    needle, pids = entry.encode(), []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            with contextlib.suppress(OSError):
                if needle in (d / "environ").read_bytes().split(b"\0"):
                    pids.append(int(d.name))
    return pids


def _wait_for(check, timeout: float, what: str, daemons: list) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for name, proc in daemons:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with code {proc.returncode} while waiting for {what}")
        if check():
            return
        time.sleep(0.1)
    raise RuntimeError(f"timed out after {timeout}s waiting for {what}")


def _quiet(cmd: list[str], env: dict, timeout: float = 10) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture(scope="session")
def slurm():
    """Environment (dict) for SLURM client commands talking to this session's cluster."""
    if _which("slurmctld") is None:
        _install_slurm()
    for tool in ("slurmctld", "slurmd", "munged", "munge", "srun", "sbatch", "sinfo", "scontrol",
                 "squeue", "scancel"):
        if _which(tool) is None:
            _skip(f"{tool} not found after installing slurm-wlm")
    if os.geteuid() != 0:
        _skip("a private slurmd/munged needs root (they run jobs and switch to user munge)")
    try:
        munge_user = pwd.getpwnam("munge")
    except KeyError:
        _skip("user 'munge' does not exist")

    started = time.monotonic()
    host = socket.gethostname().split(".")[0]
    base = Path(tempfile.mkdtemp(prefix="hpcgnn-slurm-", dir="/tmp"))
    os.chmod(base, 0o755)                            # munged (user munge) must reach its directory
    munge_dir = base / "munge"
    munge_dir.mkdir(mode=0o755)
    os.chown(munge_dir, munge_user.pw_uid, munge_user.pw_gid)
    for d in ("state", "spool"):
        (base / d).mkdir()
    munge_socket = munge_dir / "munge.socket"
    conf = base / "slurm.conf"
    conf.write_text(_slurm_conf(base, host, munge_socket))
    env = clean_env({"SLURM_CONF": str(conf), "PATH": SBIN_PATH})

    daemons: list[tuple[str, subprocess.Popen]] = []

    def start(name: str, cmd: list[str], **kwargs) -> None:
        log = open(base / f"{name}.stdout", "w")
        daemons.append((name, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                               start_new_session=True, **kwargs)))
        log.close()

    def stop() -> None:
        if any(name == "slurmctld" and proc.poll() is None for name, proc in daemons):
            _quiet(["scancel", "--user", "root", "--full"], env)   # any job a failed test left
            deadline = time.monotonic() + 10
            while _quiet(["squeue", "-h"], env).stdout.strip() and time.monotonic() < deadline:
                time.sleep(0.2)
        for name, proc in reversed(daemons):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=10)
        for pid in _processes_with_env(f"SLURM_CONF={conf}"):  # a slurmstepd or task left behind
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)

    try:
        start("munged", [_which("munged"), "--foreground", f"--socket={munge_socket}",
                         f"--key-file={_munge_key()}", f"--pid-file={munge_dir / 'munged.pid'}",
                         f"--log-file={munge_dir / 'munged.log'}",
                         f"--seed-file={munge_dir / 'munged.seed'}"],
              user=munge_user.pw_uid, group=munge_user.pw_gid, extra_groups=[])
        _wait_for(lambda: _quiet(["munge", "-n", "-S", str(munge_socket)], env).returncode == 0,
                  10, "munged", daemons)
        start("slurmctld", [_which("slurmctld"), "-D", "-i"])
        start("slurmd", [_which("slurmd"), "-D"])
        _wait_for(lambda: _quiet(["sinfo", "-h", "-n", host, "-o", "%t"], env).stdout.strip() == "idle",
                  30, "the node to be idle in sinfo", daemons)
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        logs = "".join(f"\n--- {p.name}\n{p.read_text(errors='replace')[-1500:]}"
                       for p in sorted(base.rglob("*.log")) + sorted(base.glob("*.stdout")))
        stop()
        shutil.rmtree(base, ignore_errors=True)
        _skip(f"could not start a single-node SLURM: {exc}{logs}")
    print(f"\ntest_slurm: SLURM up in {time.monotonic() - started:.1f} s ({base})", file=sys.stderr)
    try:
        yield env
    finally:
        stop()
        shutil.rmtree(base, ignore_errors=True)


def run_step(env: dict, args: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    """Run a blocking ``srun`` job step; fail the test (killing the step) after ``timeout`` s."""
    proc = subprocess.Popen(["srun", *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, cwd=ROOT, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"srun timed out after {timeout}s\n{out}\n{err}")
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


def run_batch(env: dict, script: str, options: list[str], args: list[str] = (),
              timeout: float = 180) -> tuple[str, str, str, dict]:
    """sbatch ``script`` from the repository root, poll until it ends.

    Returns (JobState, ExitCode, the job's output, every ``scontrol show job`` field).
    Polls ``scontrol show job`` every 0.2 s instead of ``sbatch --wait`` (which polls
    every ~30 s); the job is cancelled and the test fails after ``timeout`` s.
    """
    submit = subprocess.run(["sbatch", "--parsable", *options, script, *args], capture_output=True,
                            text=True, timeout=30, env=env, cwd=ROOT)
    assert submit.returncode == 0, submit.stderr
    job = submit.stdout.strip().split(";")[0]
    deadline = time.monotonic() + timeout
    state = exit_code = output = ""
    while time.monotonic() < deadline:
        show = _quiet(["scontrol", "show", "job", "-o", job], env).stdout
        fields = dict(re.findall(r"(\w+)=(\S*)", show))
        state, exit_code, output = fields.get("JobState", ""), fields.get("ExitCode", ""), \
            fields.get("StdOut", "")
        if state in TERMINAL:
            break
        time.sleep(0.2)
    else:
        _quiet(["scancel", job], env)
        raise AssertionError(f"job {job} still {state} after {timeout}s")
    text = Path(output).read_text(errors="replace") if output and Path(output).exists() else ""
    return state, exit_code, text, fields


def _venv_env(env: dict, **extra) -> dict:
    """The scripts run ROOT/.venv/bin/python; point VENV at this interpreter's env otherwise."""
    out = dict(env, **extra)
    if not (ROOT / ".venv" / "bin" / "python").exists():
        out["VENV"] = str(Path(sys.executable).parent.parent)
    return out


WORLD = "from mpi4py import MPI; c = MPI.COMM_WORLD; print('world', c.rank, c.size, c.allreduce(c.rank))"


def test_srun_pmi2_starts_one_world_and_mpi_none_is_refused(slurm):
    # (hpcgnn.demos.hello under srun --mpi=pmi2 runs in the train.sh test below; this
    # one-liner avoids a second torch import, the cost of every hello launch.)
    proc = run_step(slurm, ["--mpi=pmi2", "-n", "2", sys.executable, "-c", WORLD])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(proc.stdout.splitlines()) == ["world 0 2 1", "world 1 2 1"]
    # Without PMI every task is a singleton: the launcher guard stops each one (exit 2, one line).
    proc = run_step(slurm, ["--mpi=none", "-n", "2", sys.executable, "-m", "hpcgnn.demos.hello"])
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stdout == "" and "Traceback" not in proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("hpcgnn: error:")]
    assert len(errors) == 2 and all("SLURM_NTASKS=2 but MPI.COMM_WORLD has size 1" in e for e in errors)


def test_train_script_launch_path_with_the_hello_entry(slurm, tmp_path):
    env = _venv_env(slurm, HPCGNN_ENTRY="-m hpcgnn.demos.hello", CONFIG="cfg dir/run.toml",
                    PARTITIONS=str(tmp_path / "parts"), RUN_DIR=str(tmp_path / "run"))
    env.pop("HPCGNN_THREADS", None)
    state, exit_code, text, _ = run_batch(
        env, "slurm/train.sh",
        ["--ntasks-per-node=2", "--cpus-per-task=2", f"--output={tmp_path}/train-%j.out"], ["--force"])
    assert (state, exit_code) == ("COMPLETED", "0:0"), text
    lines = parse(text)
    assert [(h["rank"], h["size"]) for h in lines] == [(0, 2), (1, 2)], text
    for h in lines:   # threads from SLURM_CPUS_PER_TASK=2, not the default 2 cores // 2 ranks
        assert (h["threads"], h["torch_threads"], h["omp"]) == (2, 2, 2), h
    argv = shlex.split(re.search(r"^argv: (.*)$", text, re.MULTILINE).group(1))
    assert argv == ["--config", "cfg dir/run.toml", "--set", f"data.partitions={tmp_path / 'parts'}",
                    "--set", f"output.dir={tmp_path / 'run'}", "--force"]
    assert "train.sh: job " in text and "2 ranks x 2 threads" in text


def test_train_script_ends_the_job_when_a_rank_is_killed(slurm, tmp_path):
    """Without srun --kill-on-bad-exit the surviving ranks would wait in MPI_Barrier until --time."""
    env = _venv_env(slurm, HPCGNN_ENTRY=f"{ROOT}/tests/demos/fail.py --mode kill --rank 1 --delay 0.2")
    state, exit_code, text, fields = run_batch(
        env, "slurm/train.sh",
        ["--ntasks-per-node=2", "--cpus-per-task=1", f"--output={tmp_path}/kill-%j.out"], timeout=120)
    assert state == "FAILED" and exit_code != "0:0", (state, exit_code, text)
    killed_at = float(re.search(r"^rank 1 fails \(kill\) at ([0-9.]+)$", text, re.MULTILINE).group(1))
    ended = datetime.fromisoformat(fields["EndTime"]).timestamp()   # local time, 1 s resolution
    print(f"srun (train.sh): job ended {ended - killed_at:.1f} s after the SIGKILL")
    assert "finished" not in text and ended - killed_at < 30


def _missing_commands(*names: str) -> list[str]:
    return [n for n in names if importlib.util.find_spec(f"hpcgnn.commands.{n}") is None]


def test_partition_script_imports_and_partitions(slurm, tmp_path):
    missing = _missing_commands("prepare", "partition", "inspect")
    if missing:
        pytest.skip(f"hpcgnn command(s) {', '.join(missing)} do not exist yet")
    from hpcgnn.partition.store import read_meta

    graph, out = tmp_path / "graphs" / "cora.h5", tmp_path / "cora-2"
    env = _venv_env(slurm, GRAPH=str(graph), PARTS="2", OUT=str(out), DATA_ROOT=str(ROOT / "inputs" / "data"))
    state, exit_code, text, _ = run_batch(env, "slurm/partition.sh", [f"--output={tmp_path}/part-%j.out"])
    assert (state, exit_code) == ("COMPLETED", "0:0"), text
    assert "is missing: importing dataset 'cora'" in text
    assert graph.is_file()
    meta = read_meta(out)
    assert meta.num_parts == 2 and meta.method == "metis" and meta.part_offsets[-1] == meta.num_nodes


def test_train_script_trains_on_cora_partitions(slurm, tmp_path, request):
    missing = _missing_commands("train", "prepare", "partition")
    if missing:
        pytest.skip(f"hpcgnn command(s) {', '.join(missing)} do not exist yet: "
                    "train.sh's launch path is tested with the hello entry meanwhile")
    config = ROOT / "inputs" / "cora-sage.toml"
    if not config.is_file():
        pytest.skip(f"{config} does not exist yet")
    parts = request.getfixturevalue("cora_parts")(2)
    run_dir = tmp_path / "run"
    env = _venv_env(slurm, CONFIG=str(config), PARTITIONS=str(parts), RUN_DIR=str(run_dir))
    state, exit_code, text, _ = run_batch(
        env, "slurm/train.sh",
        ["--ntasks-per-node=2", "--cpus-per-task=1", f"--output={tmp_path}/train-%j.out"],
        ["--set", "train.epochs=2"], timeout=600)
    assert (state, exit_code) == ("COMPLETED", "0:0"), text
    from hpcgnn.run.runfile import read_run

    run = read_run(run_dir)
    assert run["attrs"]["num_ranks"] == 2, run["attrs"]
    loss = np.asarray(run["metrics"]["loss"])
    assert loss.shape[0] == 2 and np.isfinite(loss).all(), loss


def _show_job(env: dict, job: str) -> dict:
    return dict(re.findall(r"(\w+)=(\S*)", _quiet(["scontrol", "show", "job", "-o", job], env).stdout))


def test_train_script_stops_on_sigusr1_requeues_and_resumes_to_the_end(slurm, tmp_path, request):
    """``scancel --signal=USR1`` (what ``--signal=USR1@LEAD`` sends before the time limit, to the
    job's steps) while the run trains: the ranks stop after their epoch with its checkpoint (exit
    75), train.sh requeues the job (HPCGNN_REQUEUE=1), the restarted job resumes (``--force``
    dropped, ``--resume`` added) and finishes: one run file with every epoch once."""
    parts = request.getfixturevalue("cora_parts")(2)
    run_dir, epochs = tmp_path / "run", 60
    env = _venv_env(slurm, CONFIG=str(ROOT / "inputs" / "cora-sage.toml"), PARTITIONS=str(parts),
                    RUN_DIR=str(run_dir), HPCGNN_REQUEUE="1")
    out = tmp_path / "stop.out"
    submit = subprocess.run(["sbatch", "--parsable", "--ntasks-per-node=2", "--cpus-per-task=1", "--open-mode=append",
                             f"--output={out}", "slurm/train.sh", "--force", "--set", f"train.epochs={epochs}",
                             "--set", "train.eval_every=0", "--set", "minibatch.eval=sampled"],
                            capture_output=True, text=True, timeout=30, env=env, cwd=ROOT)
    assert submit.returncode == 0, submit.stderr
    job = submit.stdout.strip().split(";")[0]
    try:
        deadline = time.monotonic() + 180
        while not (out.exists() and re.search(rf"^epoch +2/{epochs} ", out.read_text(errors="replace"), re.M)):
            assert time.monotonic() < deadline, out.read_text(errors="replace") if out.exists() else "no output"
            time.sleep(0.1)
        signalled = _quiet(["scancel", "--signal=USR1", job], env)
        assert signalled.returncode == 0, signalled.stderr
        deadline = time.monotonic() + 300
        while (fields := _show_job(env, job)).get("JobState") not in TERMINAL or fields.get("Restarts") == "0":
            assert time.monotonic() < deadline, (fields, out.read_text(errors="replace")[-3000:])
            time.sleep(0.2)
    finally:
        _quiet(["scancel", job], env)
    text = out.read_text(errors="replace")
    base = Path(env["SLURM_CONF"]).parent
    logs = "".join(f"\n--- {n}\n" + (base / n).read_text(errors="replace")[-2500:] for n in ("slurmctld.log", "slurmd.log"))
    assert (fields["JobState"], fields["ExitCode"], fields["Restarts"]) == ("COMPLETED", "0:0", "1"), (fields, text[-3000:] + logs)
    # srun signals the tasks one after the other: an agreement between the two deliveries names one rank
    assert re.search(r"\(SIGUSR1 on (every rank|rank [01])\)", text) and "(exit status 75)" in text, text[-3000:]
    assert f"requeueing job {job}" in text and f"restart 1 of job {job}" in text, text[-3000:]
    from hpcgnn.run.checkpoint import list_checkpoints
    from hpcgnn.run.runfile import read_run

    run = read_run(run_dir)
    assert run["attrs"]["status"] == "finished", run["attrs"]
    assert list(run["metrics"]["epoch"]) == list(range(1, epochs + 1))
    assert list_checkpoints(run_dir)[-1][0] == epochs


@pytest.mark.parametrize("script", ["train.sh", "partition.sh"])
def test_scripts_refuse_a_missing_venv_or_checkout_with_exit_2(script, tmp_path):
    """No SLURM needed: the set-up errors come before srun or any Python runs."""
    path = str(Path(__file__).resolve().parents[1] / "slurm" / script)
    base = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    r = subprocess.run(["bash", path], capture_output=True, text=True, timeout=60,
                       env={**base, "VENV": str(tmp_path / "no-venv")})
    assert r.returncode == 2 and r.stderr.strip() == (
        f"{script}: error: no Python at {tmp_path / 'no-venv'}/bin/python (run 'make install' or set HPCGNN_ROOT / VENV)")
    r = subprocess.run(["bash", path], capture_output=True, text=True, timeout=60,
                       env={**base, "HPCGNN_ROOT": str(tmp_path)})
    assert r.returncode == 2
    assert r.stderr.strip() == f"{script}: error: {tmp_path} is not an hpcgnn checkout (set HPCGNN_ROOT)"
