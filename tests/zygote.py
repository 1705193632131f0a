"""A fork server for the test suite's launches: a rank starts as a fork of an interpreter that
has already imported torch, numpy and h5py, instead of importing them again (about 3 s of CPU
per process on a 2-core machine, which was most of the suite's time).

It is the technique of multiprocessing's "forkserver" start method:

- ``python tests/zygote.py serve SOCKET`` (started once per test session by conftest.py, with
  the environment :func:`mpiutil.clean_env` gives every launch) imports :data:`PRELOAD` and the
  modules of :data:`PACKAGE` (:func:`preload_package`), never ``mpi4py.MPI`` (each rank
  initialises MPI itself), then waits on the Unix socket SOCKET.
- mpiutil launches ``mpiexec -n N python -S -I tests/zygote.py run SOCKET ARGS...`` where it
  would launch ``python ARGS...``. That client (the standard library only, about 50 ms) is the
  process the launcher manages. It sends the server its arguments, environment, working
  directory, signal state and its file descriptors: stdin, stdout, stderr and the PMI socket
  Hydra gave it (``PMI_FD``).
- The server forks. The child takes those descriptors, that environment and directory, becomes
  a session leader (as Hydra makes each rank), and runs ARGS as ``python ARGS`` would: a script,
  ``-m module`` or ``-c code``, as ``__main__``. It initialises MPI through the PMI socket, so
  it is a rank of the job like any other; it dies with the server (``PR_SET_PDEATHSIG``), and
  the server with the test session.
- The client forwards the signals a launcher or batch system sends, and exits as the child did
  (its exit code, or killed by the same signal), so the launcher sees what it would have seen.
  If the client dies (the launcher killed it), the server SIGKILLs the child.
- Whatever would make the child differ from a fresh interpreter makes the client exec a fresh
  one instead (:func:`differences`): an environment variable other than the launcher's and
  hpcgnn's run-time ones (:data:`RUN_TIME_PREFIXES`, :data:`RUN_TIME_NAMES`), an interpreter option, other credentials,
  capabilities, resource limits, CPU affinity, umask, nice value or cgroup; a ``sys.path[0]``
  (the script's directory, or the working directory for ``-m`` / ``-c``) that holds another
  copy of the package. So does a server that is not there.

What a forked rank shares with its siblings that fresh ones would not: Python's string hash
seed and numpy's legacy global random state (hpcgnn seeds its own generators). Set
``HPCGNN_TEST_ZYGOTE=0`` to start every launch as a fresh interpreter.
"""
from __future__ import annotations

import gc
import json
import os
import signal
import socket
import struct
import sys

PRELOAD = ("torch", "numpy", "h5py", "mpi4py")
# The package under test is preloaded too, every module but these (and any that imports
# mpi4py.MPI, whose import initialises MPI): drivers and demos, matplotlib's plotting.
PACKAGE = "hpcgnn"
PACKAGE_SKIP = ("hpcgnn.demos", "hpcgnn.__main__", "hpcgnn.run.plot")
NEVER_PRELOAD = "mpi4py.MPI"
# Environment variables a rank may have that the server did not, because nothing reads them
# while the preloaded modules are imported: the launcher's (Hydra's PMI, control and local-rank
# variables; MPICH reads MPIR_CVAR_* in MPI_Init), hpcgnn's (read at run time), torch's
# THP_MEM_ALLOC_ENABLE (read at its first CPU allocation) and TORCHINDUCTOR_* (read when
# compiling; torch.optim's import of dynamo sets the cache directory in pytest's process),
# cuBLAS's NVIDIA_TF32_OVERRIDE (read when CUDA starts), pytest's and a shell's bookkeeping.
RUN_TIME_PREFIXES = ("PMI_", "HYDI_", "MPIR_CVAR_", "HPCGNN_", "TORCHINDUCTOR_")
RUN_TIME_NAMES = {"MPI_LOCALNRANKS", "MPI_LOCALRANKID", "GFORTRAN_UNBUFFERED_PRECONNECTED", "THP_MEM_ALLOC_ENABLE",
                  "NVIDIA_TF32_OVERRIDE", "PYTEST_CURRENT_TEST", "SHLVL", "PWD", "OLDPWD", "_"}
# Variables naming a descriptor the launcher gave the rank: passed on with stdin/out/err.
FD_VARS = ("PMI_FD", "HYDI_CONTROL_FD")
FORWARDED = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGCONT")
STATUS_TRAITS = ("Umask", "Uid", "Gid", "Groups", "CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb",
                 "NoNewPrivs", "Seccomp", "Cpus_allowed_list", "Mems_allowed_list")
HEADER = struct.Struct("!I")


def client_command(socket_path: str | os.PathLike, python: str = sys.executable) -> list[str]:
    """The command that runs ``python ARGS`` through the server listening on ``socket_path``
    (append ARGS): this file's client, on an interpreter started without site packages."""
    return [python, "-S", "-I", os.path.abspath(__file__), "run", os.fspath(socket_path)]


def server_command(socket_path: str | os.PathLike, python: str = sys.executable) -> list[str]:
    """The command that starts a server listening on ``socket_path``."""
    return [python, os.path.abspath(__file__), "serve", os.fspath(socket_path)]


def process_traits() -> dict:
    """What the kernel holds for this process that a fork would not take from its client:
    credentials, capabilities, umask and affinity (/proc/self/status), resource limits, cgroup
    and nice value."""
    traits = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in STATUS_TRAITS:
                traits[key] = value.strip()
    with open("/proc/self/limits") as f:
        traits["limits"] = f.read()
    with open("/proc/self/cgroup") as f:
        traits["cgroup"] = f.read()
    traits["nice"] = os.getpriority(os.PRIO_PROCESS, 0)
    return traits


def preload_package(name: str = PACKAGE, skip: tuple[str, ...] = PACKAGE_SKIP) -> tuple[str | None, list[str]]:
    """Import every module of package ``name`` except ``skip`` and those that import
    :data:`NEVER_PRELOAD` (they fail to import here, and stay out): (the package's directory,
    the modules left out). A module's import runs no code of a launch: no hpcgnn module reads
    the environment or starts a thread at import (they do it in functions)."""
    import importlib
    import pkgutil

    class Refuse:
        def find_spec(self, fullname, path=None, target=None):
            if fullname == NEVER_PRELOAD:
                raise ImportError(f"{NEVER_PRELOAD} is never preloaded")
            return None

    try:
        package = importlib.import_module(name)
    except ImportError:
        return None, [name]
    left_out = []
    sys.meta_path.insert(0, Refuse())
    try:
        for info in pkgutil.walk_packages(package.__path__, name + ".", onerror=lambda _: None):
            if info.name.startswith(skip):
                continue
            try:
                importlib.import_module(info.name)
            except ImportError:
                left_out.append(info.name)
    finally:
        sys.meta_path.pop(0)
    return os.path.realpath(package.__path__[0]), left_out


def _path0(request: dict) -> str:
    """The ``sys.path[0]`` of the requested ``python ARGS``: the script's directory, else the
    working directory."""
    args = request["args"]
    if args[0] in ("-m", "-c"):
        return request["cwd"]
    return os.path.dirname(os.path.realpath(os.path.join(request["cwd"], args[0])))


def _run_time(name: str) -> bool:
    return name.startswith(RUN_TIME_PREFIXES) or name in RUN_TIME_NAMES


def differences(request: dict, env: dict, traits: dict, reserved: set[int],
                package: str | None = None) -> str | None:
    """Why a fork of this server would not be the fresh ``python ARGS`` the request stands for
    (None: it would be). ``package``: the directory of the preloaded package."""
    args = request["args"]
    if not args:
        return "no arguments (an interactive interpreter)"
    if args[0].startswith("-") and args[0] not in ("-m", "-c"):
        return f"interpreter option {args[0]}"
    if args[0] in ("-m", "-c") and len(args) < 2:
        return f"{args[0]} without its argument"
    theirs = {k: v for k, v in request["env"].items() if not _run_time(k)}
    ours = {k: v for k, v in env.items() if not _run_time(k)}
    if theirs != ours:
        names = sorted(k for k in set(theirs) | set(ours) if theirs.get(k) != ours.get(k))
        return "environment differs in " + ", ".join(names)
    for key, value in traits.items():
        if request["traits"].get(key) != value:
            return f"process differs in {key}"
    if package is not None:
        shadow = os.path.join(_path0(request), os.path.basename(package))
        if os.path.isdir(shadow) and os.path.realpath(shadow) != package:
            return f"{shadow} would be imported, not the preloaded {package}"
    taken = reserved.intersection(request["fds"])
    if taken:
        return f"descriptors {sorted(taken)} are the server's"
    return None


# --------------------------------------------------------------------------- the client


def _send(sock: socket.socket, payload: dict, fds: list[int]) -> None:
    data = json.dumps(payload).encode()
    data = HEADER.pack(len(data)) + data
    sent = socket.send_fds(sock, [data], fds)
    sock.sendall(data[sent:])


def client(path: str, args: list[str]) -> None:
    """Run ``python ARGS`` through the server at ``path``; exit as it did (never returns)."""
    def fresh():
        os.execv(sys.executable, [sys.executable, *args])

    fds = [0, 1, 2]
    for var in FD_VARS:
        value = os.environ.get(var, "")
        if value.isdigit() and int(value) not in fds:
            fds.append(int(value))
    try:
        for fd in fds:
            os.fstat(fd)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(path)
        ignored = [int(s) for s in signal.Signals if signal.getsignal(s) is signal.SIG_IGN
                   and s.name not in ("SIGPIPE", "SIGXFSZ")]      # Python itself ignores these two
        blocked = [int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])]
        _send(sock, {"args": args, "env": dict(os.environ), "cwd": os.getcwd(), "fds": fds,
                     "traits": process_traits(), "ignored": ignored, "blocked": blocked}, fds)
        replies = sock.makefile("rb")
        reply = replies.readline().split()
    except OSError:
        fresh()
    if not reply or reply[0] != b"P":
        sock.close()
        fresh()
    pid = int(reply[1])

    def forward(signum, _frame):
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    for name in FORWARDED:
        signal.signal(getattr(signal, name), forward)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [getattr(signal, n) for n in FORWARDED])
    reply = replies.readline().split()
    if not reply or reply[0] != b"X":          # the server died: so did the child
        os._exit(1)
    code = os.waitstatus_to_exitcode(int(reply[1]))
    if code < 0:
        import resource

        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if -code not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(-code, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [-code])
        os.kill(os.getpid(), -code)
    os._exit(code & 0xFF)


# --------------------------------------------------------------------------- the server


def _receive(conn: socket.socket) -> tuple[dict, list[int]] | None:
    conn.settimeout(10)
    try:
        data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 8)
        if len(data) < HEADER.size:
            raise OSError("short request")
        size = HEADER.unpack_from(data)[0]
        data = data[HEADER.size:]
        while len(data) < size:
            more = conn.recv(size - len(data))
            if not more:
                raise OSError("truncated request")
            data += more
        request = json.loads(data)
        if len(fds) != len(request["fds"]):
            raise OSError("descriptors missing")
        return request, fds
    except (OSError, ValueError, KeyError):
        return None


def serve(path: str) -> tuple[dict, list[int]]:
    """Preload, then fork a child per request. Returns only in a child: its request and the
    received descriptors."""
    import selectors

    from hpcgnn.supervisor import die_with_parent

    die_with_parent(os.getppid(), signal.SIGTERM)   # a test session that dies takes the server along
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
    env = dict(os.environ)
    for name in PRELOAD:
        __import__(name)
    package, left_out = preload_package()
    print(f"zygote: preloaded {', '.join(PRELOAD)} and {PACKAGE} from {package} "
          f"(left out: {', '.join(left_out) or 'none'})", flush=True)
    # What the preloading made stays out of every collection, the fork's too: a fork's garbage
    # collector then walks only what its program made (its exit's collections walked torch's
    # whole object graph: about 1 s of CPU per rank, and a copy of every page they touched).
    gc.collect()
    gc.freeze()
    traits = process_traits()
    # descriptors the preloaded libraries hold: a rank's PMI socket must not land on one
    reserved = {fd for fd in map(int, os.listdir("/proc/self/fd")) if fd > 2 and _is_open(fd)}
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *a: None)
    listener.bind(path + ".tmp")
    listener.listen(64)
    os.rename(path + ".tmp", path)          # the socket appears when the server is ready
    server = os.getpid()
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ)
    sel.register(wake_r, selectors.EVENT_READ)
    children: dict[int, socket.socket] = {}   # pid -> its client's connection
    watched: set[socket.socket] = set()         # connections the selector still watches
    forks = fresh = 0
    try:
        while True:
            for key, _ in sel.select(timeout=1.0):
                if key.fileobj is listener:
                    conn, _ = listener.accept()
                    got = _receive(conn)
                    if got is None:
                        conn.close()
                        continue
                    request, fds = got
                    why = differences(request, env, traits, reserved, package)
                    if why is not None:
                        print(f"zygote: fresh interpreter for {request['args'][:2]}: {why}", flush=True)
                        fresh += 1
                        for fd in fds:
                            os.close(fd)
                        conn.sendall(b"F\n")
                        conn.close()
                        continue
                    pid = os.fork()
                    if pid == 0:
                        sel.close()
                        listener.close()
                        for other in (conn, *children.values()):
                            other.close()
                        signal.set_wakeup_fd(-1)
                        os.close(wake_r)
                        os.close(wake_w)
                        die_with_parent(server)
                        return request, fds
                    forks += 1
                    for fd in fds:
                        os.close(fd)
                    conn.sendall(b"P %d\n" % pid)
                    children[pid] = conn
                    watched.add(conn)
                    sel.register(conn, selectors.EVENT_READ, pid)
                elif key.fileobj == wake_r:
                    os.read(wake_r, 4096)
                else:
                    try:
                        gone = not key.fileobj.recv(64)
                    except OSError:
                        gone = True
                    if gone:                        # the client is gone: its rank goes too
                        try:
                            os.kill(key.data, signal.SIGKILL)
                        except ProcessLookupError:
                            pass
                        sel.unregister(key.fileobj)
                        watched.discard(key.fileobj)
            while children:
                try:
                    pid, status = os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    break
                if pid == 0:
                    break
                conn = children.pop(pid, None)
                if conn is not None:
                    try:
                        conn.sendall(b"X %d\n" % status)
                    except OSError:
                        pass
                    if conn in watched:
                        sel.unregister(conn)
                        watched.discard(conn)
                    conn.close()
    finally:
        if os.getpid() == server:
            print(f"zygote: {forks} runs forked, {fresh} sent to a fresh interpreter", flush=True)
            for pid in children:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                os.unlink(path)
            except OSError:
                pass


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


def _stdio(fd: int, like):
    """A standard stream on ``fd`` as CPython's start-up makes one (create_stdio): encoding and
    errors from ``like``; with ``-u`` / PYTHONUNBUFFERED unbuffered and written through,
    otherwise buffered and line-buffered on a terminal, and always for stderr."""
    import io

    raw = io.FileIO(fd, "rb" if fd == 0 else "wb", closefd=False)
    raw.name = ("<stdin>", "<stdout>", "<stderr>")[fd]
    unbuffered = isinstance(sys.__stdout__.buffer, io.FileIO)      # how this interpreter started
    if fd == 0:
        buffer = io.BufferedReader(raw)
    else:
        buffer = raw if unbuffered else io.BufferedWriter(raw)
    stream = io.TextIOWrapper(buffer, encoding=like.encoding, errors=like.errors,
                              line_buffering=not unbuffered and (raw.isatty() or fd == 2),
                              write_through=unbuffered)
    stream.mode = "r" if fd == 0 else "w"
    return stream


def become(request: dict, fds: list[int]) -> None:
    """Turn this forked child into the process the client would have exec'd, then run its
    ARGS as ``__main__`` (exceptions and SystemExit end the interpreter as they would there)."""
    import builtins
    import fcntl
    import runpy
    import types

    os.setsid()
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 256) for fd in fds]
    for fd in fds:
        os.close(fd)
    for src, target in zip(high, request["fds"]):
        os.dup2(src, target)
        os.close(src)
    ignored = set(request["ignored"])
    for sig in signal.Signals:
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            continue
        if sig == signal.SIGINT and sig not in ignored:
            signal.signal(sig, signal.default_int_handler)
        elif sig in (signal.SIGPIPE, signal.SIGXFSZ) or sig in ignored:
            signal.signal(sig, signal.SIG_IGN)
        else:
            signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, request["blocked"])
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    sys.stdin, sys.stdout, sys.stderr = (_stdio(0, sys.__stdin__), _stdio(1, sys.__stdout__),
                                         _stdio(2, sys.__stderr__))
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = sys.stdin, sys.stdout, sys.stderr
    args = request["args"]
    if args[0] == "-m":
        sys.argv = ["-m", *args[2:]]
        sys.path[0] = os.getcwd()
        runpy._run_module_as_main(args[1], alter_argv=True)   # what `python -m` itself calls
        return
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = builtins
    if args[0] == "-c":
        sys.argv = ["-c", *args[2:]]
        sys.path[0] = ""
        code = compile(args[1], "<string>", "exec")
    else:
        sys.argv = list(args)
        sys.path[0] = os.path.dirname(os.path.realpath(args[0]))
        with open(args[0], "rb") as f:
            code = compile(f.read(), args[0], "exec")
        main.__file__ = args[0]
        main.__cached__ = None
    sys.modules["__main__"] = main
    exec(code, main.__dict__)


def main() -> None:
    role, path, args = sys.argv[1], sys.argv[2], sys.argv[3:]
    if role == "run":
        client(path, args)
    request, fds = serve(path)
    become(request, fds)


if __name__ == "__main__":
    main()
