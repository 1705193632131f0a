#!/usr/bin/env python3
"""Wheels for `make check-gpu PYTHON=...` on a machine without a package registry (docs/gpu.md).

Two steps, on two machines:

``python3 tools/gpu_wheels.py download [--dest .whl] [--python-version 3.12] [--dry-run]``
    where PyPI is reachable: ``pip download`` of every package below, binary wheels only, for the
    target's Python (CPython, manylinux x86-64 by default), each pinned to the version this
    project's ``.venv`` has (``--freeze-from``: the interpreter whose ``pip freeze`` gives the
    pins; the running one when that venv is absent). One ``pip download`` per package.

``VENV/bin/python tools/gpu_wheels.py link --base-python PYTHON``
    in a ``--system-site-packages`` venv of ``PYTHON`` (``make check-gpu PYTHON=...``): a ``.pth``
    file in the venv that puts this checkout and every site-packages folder of ``PYTHON`` on the
    venv's path (after the venv's own), so ``PYTHON``'s torch is seen even where ``PYTHON`` is
    itself a venv (whose packages ``--system-site-packages`` would not show), and ``import
    hpcgnn`` reads this checkout (native/ built in place: no install of hpcgnn is needed).

``PYTHON tools/gpu_wheels.py install [--wheels .whl] [--dry-run]``
    on the target, with the interpreter that will run hpcgnn (``make check-gpu`` uses a
    ``--system-site-packages`` venv of ``PYTHON``): installs, from ``--wheels`` only
    (``pip install --no-index --no-deps --ignore-installed``), each group whose probe fails
    there; what the interpreter already has (torch, numpy, h5py ...) is never replaced.

``--dry-run`` prints the pip commands (one per line) instead of running them. Exit 0 when all
went well, 1 when a pip command failed, 2 on a bad argument or a missing wheel (one line).
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# (probe run in the target interpreter, distributions installed together when it fails).
# mpi4py and the MPICH wheel go together: a PyPI mpi4py loads whichever libmpi it finds at
# run time, so an mpi4py that imports MPI fine (a site build, or one with its MPI) is kept.
GROUPS: list[tuple[str, list[str]]] = [
    ("import numpy", ["numpy"]),
    ("import h5py", ["h5py"]),
    ("import setuptools", ["setuptools"]),
    ("import pybind11", ["pybind11"]),
    ("import pymetis", ["pymetis"]),
    ("from importlib.metadata import distribution as d; d('cmeel-metis')",
     ["cmeel", "cmeel-gklib", "cmeel-metis"]),
    ("from mpi4py import MPI; MPI.Get_library_version()", ["mpi4py", "mpich"]),
]
PACKAGES = [name for _, names in GROUPS for name in names]
PLATFORMS = {"x86_64": ["manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"],
             "aarch64": ["manylinux_2_28_aarch64", "manylinux_2_17_aarch64", "manylinux2014_aarch64"]}


def _norm(name: str) -> str:
    """A distribution name in PEP 503 form (``cmeel_metis`` -> ``cmeel-metis``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(freeze_from: str) -> dict[str, str]:
    """{normalised name: version} from ``FREEZE_FROM -m pip freeze`` (editable and URL lines skipped)."""
    out = subprocess.run([freeze_from, "-m", "pip", "freeze", "--all"], capture_output=True, text=True,
                         check=True, timeout=120).stdout
    found = {}
    for line in out.splitlines():
        m = re.fullmatch(r"([A-Za-z0-9_.-]+)==([^\s;]+)", line.strip())
        if m:
            found[_norm(m.group(1))] = m.group(2).split("+")[0]
    return found


def download_commands(versions: dict[str, str], dest: str, python_version: str, arch: str,
                      downloader: str) -> list[list[str]]:
    """One ``pip download`` command per package, pinned to ``versions`` (SystemExit naming a
    package the pins lack)."""
    missing = [p for p in PACKAGES if _norm(p) not in versions]
    if missing:
        raise SystemExit(f"gpu_wheels: no pinned version for {', '.join(missing)} in the pip freeze "
                         "(install them into .venv first: make install)")
    plat = [a for p in PLATFORMS[arch] for a in ("--platform", p)]
    return [[downloader, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--no-deps",
             "--only-binary=:all:", "--python-version", python_version, "--implementation", "cp",
             *plat, "-d", dest, f"{p}=={versions[_norm(p)]}"] for p in PACKAGES]


def _probe(python: str, code: str) -> bool:
    """Whether ``code`` runs without error in ``python`` (a subprocess: a broken MPI library
    may abort the interpreter)."""
    try:
        return subprocess.run([python, "-c", code], capture_output=True, timeout=120).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def wheel_files(wheels: Path, names: list[str]) -> list[Path]:
    """The wheel of each distribution in ``names`` found in ``wheels`` (SystemExit for a missing one)."""
    have = {}
    for f in sorted(wheels.glob("*.whl")):
        have.setdefault(_norm(f.name.split("-")[0]), f)
    absent = [n for n in names if _norm(n) not in have]
    if absent:
        raise SystemExit(f"gpu_wheels: {wheels}: no wheel for {', '.join(absent)} (run "
                         "'python3 tools/gpu_wheels.py download' where PyPI is reachable and copy the folder)")
    return [have[_norm(n)] for n in names]


def install_command(python: str, wheels: Path, probe=_probe) -> list[str] | None:
    """The ``pip install`` of every group whose probe fails in ``python``; None when none does."""
    names = [n for code, group in GROUPS if not probe(python, code) for n in group]
    if not names:
        return None
    return [python, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-index", "--no-deps",
            "--ignore-installed", *map(str, wheel_files(wheels, names))]


def link(base_python: str) -> Path:
    """Write the running venv's ``hpcgnn-base.pth`` (see the module text); its path."""
    import sysconfig

    code = ("import site, sys; print('\\n'.join([*site.getsitepackages(), "
            "*([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])]))")
    dirs = subprocess.run([base_python, "-c", code], capture_output=True, text=True, check=True,
                          timeout=120).stdout.splitlines()
    if sys.prefix == sys.base_prefix:
        raise SystemExit(f"gpu_wheels: link runs in a venv (python -m venv --system-site-packages), "
                         f"not in {sys.executable}")
    pth = Path(sysconfig.get_paths()["purelib"]) / "hpcgnn-base.pth"
    pth.write_text("".join(f"{d}\n" for d in [str(ROOT), *dirs]))
    return pth


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tools/gpu_wheels.py", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="step", required=True)
    d = sub.add_parser("download", help="pip download the wheels for the target Python")
    d.add_argument("--dest", default=".whl")
    d.add_argument("--python-version", default="3.12")
    d.add_argument("--arch", default="x86_64", choices=sorted(PLATFORMS))
    default_freeze = ROOT / ".venv" / "bin" / "python"
    d.add_argument("--freeze-from", default=str(default_freeze) if default_freeze.exists() else sys.executable,
                   help="interpreter whose pip freeze pins the versions (default: .venv's)")
    d.add_argument("--dry-run", action="store_true")
    k = sub.add_parser("link", help="put this checkout and PYTHON's packages on the running venv's path")
    k.add_argument("--base-python", required=True)
    i = sub.add_parser("install", help="install what the running interpreter lacks from the wheels")
    i.add_argument("--wheels", default=".whl")
    i.add_argument("--dry-run", action="store_true")
    args = p.parse_args(argv)
    if args.step == "link":
        print(f"gpu_wheels: wrote {link(args.base_python)}")
        return 0
    if args.step == "download":
        if not re.fullmatch(r"3\.\d+", args.python_version):
            p.error(f"--python-version {args.python_version!r}: expected 3.N, e.g. 3.12")
        cmds = download_commands(pins(args.freeze_from), args.dest, args.python_version, args.arch,
                                 sys.executable)
    else:
        cmd = install_command(sys.executable, Path(args.wheels))
        cmds = [cmd] if cmd else []
        if not cmds:
            print(f"gpu_wheels: {sys.executable} has every package; nothing to install")
    for cmd in cmds:
        if args.dry_run:
            print(" ".join(cmd))
            continue
        if subprocess.run(cmd).returncode != 0:
            print(f"gpu_wheels: failed: {' '.join(cmd)}", file=sys.stderr)
            return 1
    if args.step == "download" and not args.dry_run:
        print(f"gpu_wheels: {len(cmds)} wheels in {args.dest} for CPython {args.python_version} {args.arch}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
