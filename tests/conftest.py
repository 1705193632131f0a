"""Shared fixtures: small graphs and their partition stores, built once per session."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import zygote  # noqa: E402
from mpiutil import ROOT, ZYGOTE_VAR, clean_env  # noqa: E402

CORA_ROOT = ROOT / "inputs" / "data"


# The test tiers (pyproject.toml's markers; `make test-fast`, `make test`, `make test-slurm`):
# a module that launches MPI jobs is `mpi` throughout, tests/bench/ is `bench`; `slurm` and `slow`
# are set in the modules themselves.
_MPI_LAUNCHES = ("run_mpi(", "run_jobs(", "MPIEXEC", "mpiexec")


def _launches_mpi(path: Path, tests: Path, seen: dict) -> bool:
    """Whether the test module ``path``, or a helper module of tests/ that it imports (at any
    depth), launches an MPI job."""
    import ast

    if path in seen:
        return seen[path]
    seen[path] = False   # a circle of helpers reads each module once
    text = path.read_text()
    found = any(word in text for word in _MPI_LAUNCHES)
    if not found:
        for node in ast.walk(ast.parse(text, str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                for base in (path.parent, tests):
                    helper = base / (name.replace(".", "/") + ".py")
                    if helper.is_file() and _launches_mpi(helper.resolve(), tests, seen):
                        found = True
    seen[path] = found
    return found


def pytest_collection_modifyitems(config, items):
    tests = Path(__file__).resolve().parent
    launches: dict = {}
    for item in items:
        path = Path(str(item.fspath)).resolve()
        if _launches_mpi(path, tests, launches):
            item.add_marker(pytest.mark.mpi)
        if tests / "bench" in path.parents:
            item.add_marker(pytest.mark.bench)


@pytest.fixture(scope="session", autouse=True)
def fork_server(tmp_path_factory):
    """The session's fork server (tests/zygote.py), its socket exported in HPCGNN_TEST_ZYGOTE
    for mpiutil's launches and its client in HPCGNN_BENCH_PYTHON for the bench drivers'
    (benchmarks.launch.python_command); none when HPCGNN_TEST_ZYGOTE=0. Its log is
    ``zygote.log`` next to the socket: what it preloaded, one line per launch that needed a
    fresh interpreter (and why), and at the end the count of forks and fresh launches."""
    import os
    import shlex
    import subprocess

    from benchmarks.launch import PYTHON_VAR

    if os.environ.get(ZYGOTE_VAR, "") == "0":
        yield None
        return
    d = tmp_path_factory.mktemp("zygote")
    socket = d / "s"
    with open(d / "zygote.log", "w") as log:
        server = subprocess.Popen(zygote.server_command(socket), env=clean_env(),
                                  stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                  start_new_session=True)
    os.environ[ZYGOTE_VAR] = str(socket)   # until it is ready, launches start fresh interpreters
    saved = os.environ.get(PYTHON_VAR)
    os.environ[PYTHON_VAR] = shlex.join(zygote.client_command(socket))
    try:
        yield socket
    finally:
        os.environ.pop(ZYGOTE_VAR, None)
        if saved is None:
            os.environ.pop(PYTHON_VAR, None)
        else:
            os.environ[PYTHON_VAR] = saved
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


@pytest.fixture(scope="session")
def cora_graph(tmp_path_factory) -> Path:
    """Path of Cora imported with `hpcgnn prepare` (the shipped Planetoid files)."""
    from hpcgnn.cli import main

    out = tmp_path_factory.mktemp("cora") / "cora.h5"
    assert main(["prepare", "--dataset", "cora", "--root", str(CORA_ROOT), "--out", str(out)]) == 0
    return out


def _partition(graph: Path, parts: int, out: Path, method: str = "metis", seed: int = 0) -> Path:
    from hpcgnn.cli import main

    rc = main(["partition", str(graph), "--parts", str(parts), "--method", method,
               "--seed", str(seed), "--out", str(out)])
    assert rc == 0
    return out


@pytest.fixture(scope="session")
def cora_parts(cora_graph, tmp_path_factory):
    """Factory: ``cora_parts(k)`` is the path of Cora partitioned into k parts with METIS (cached)."""
    cache: dict = {}

    def get(parts: int, method: str = "metis") -> Path:
        key = (parts, method)
        if key not in cache:
            cache[key] = _partition(cora_graph, parts, tmp_path_factory.mktemp(f"cora{parts}{method}") / "p",
                                    method)
        return cache[key]

    return get


@pytest.fixture
def deterministic_flags(monkeypatch) -> list:
    """The ``deterministic`` flag of every torch-path operator scope entered from now on
    (``hpcgnn.nn.aggregate``: one entry per operator run, forward or backward), in order."""
    from hpcgnn.nn import aggregate as agg

    flags: list = []
    scope = agg._det_scope

    def recording(deterministic):
        flags.append(deterministic)
        return scope(deterministic)

    monkeypatch.setattr(agg, "_det_scope", recording)
    return flags


@pytest.fixture
def small_tmpfs(tmp_path):
    """Factory: ``small_tmpfs("2m")`` mounts a tmpfs of that size in tmp_path and returns its path
    (unmounted at the end of the test); the test is skipped where mounting is not allowed (the
    disk-full cases need root with CAP_SYS_ADMIN, as on the project's machines and CI)."""
    import subprocess

    mounted = []

    def mount(size: str) -> Path:
        mnt = tmp_path / f"small{len(mounted)}"
        mnt.mkdir()
        got = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)],
                             capture_output=True, text=True)
        if got.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs for a disk-full case ({got.stderr.strip() or 'not root'})")
        mounted.append(mnt)
        return mnt

    yield mount
    for mnt in mounted:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
