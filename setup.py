"""Build and install hpcgnn.

The C++ kernels in ``native/`` are compiled with pybind11 and OpenMP into one
extension module per kernel family: ``native/<family>.cpp`` becomes
``hpcgnn._native_<family>`` (re-exported by :mod:`hpcgnn.native`). Separate
modules let ``make native`` rebuild only the family that changed. The build needs no torch or
numpy headers (arrays cross the boundary through the buffer protocol,
zero-copy), so build isolation can never pull in another torch.

Install with ``pip install --no-build-isolation -e .`` from the Makefile,
which first installs the pinned runtime dependencies. A failed compile fails
the install: there is no pure-Python fallback.

Target CPU: ``HPCGNN_NATIVE_ARCH`` (default: a portable baseline). On x86-64 the
default is ``-march=x86-64-v2`` (SSE4.2, POPCNT: every x86-64 server CPU since
2009), so a build made on a login node runs on any compute node; the aggregation
and dropout kernels are compiled a second time for AVX2+FMA and that copy is
chosen at run time on CPUs that have it (``native/isa.h``;
``hpcgnn.native.isa()``). ``HPCGNN_NATIVE_ARCH=native`` builds for the build
machine only (``-march=native``; ``-mcpu=native`` elsewhere), any other value
is passed as ``-march=VALUE``, ``none`` passes no flag. On other machines
(aarch64) the default is the compiler's own target. The flags are recorded in
``build/native-flags.txt``; a change rebuilds every module.
"""
import glob
import os
import platform
import re
import shutil
import sys

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

try:
    import pybind11
except ImportError:  # pragma: no cover - exercised only on a broken set-up
    sys.exit("hpcgnn: building native/ needs pybind11; run 'make install' "
             "(it installs pybind11 into .venv first)")


class BuildNative(build_ext):
    """build_ext that turns a compiler failure into one clear message."""

    def _accepts(self, flag: str) -> bool:
        """Whether the C++ compiler accepts ``flag`` (compiles an empty file with it)."""
        import tempfile

        from setuptools._distutils.ccompiler import new_compiler
        from setuptools._distutils.errors import CompileError
        from setuptools._distutils.sysconfig import customize_compiler

        cc = new_compiler(compiler=self.compiler if isinstance(self.compiler, str) else None)
        customize_compiler(cc)
        with tempfile.TemporaryDirectory() as tmp:
            src = os.path.join(tmp, "probe.cpp")
            with open(src, "w") as f:
                f.write("int main() { return 0; }\n")
            try:
                cc.compile([src], output_dir=tmp, extra_postargs=[flag])
            except CompileError:
                return False
        return True

    def copy_file(self, infile, outfile, *args, **kwargs):
        """Put a built module in place atomically (copy beside it, rename over it): a running
        process that has the old file mapped keeps it intact, where a copy into the same file
        would truncate it under that process. Skipped when the target is already newer."""
        if not str(outfile).endswith(".so") or self.dry_run:
            return super().copy_file(infile, outfile, *args, **kwargs)
        if not self.force and os.path.exists(outfile) and \
                os.path.getmtime(outfile) >= os.path.getmtime(infile):
            return outfile, 0
        tmp = f"{outfile}.{os.getpid()}.tmp"
        shutil.copy2(infile, tmp)
        os.replace(tmp, outfile)
        return outfile, 1

    def run(self):
        if ARCH == "x86-64-v2" and not self._accepts("-march=x86-64-v2"):
            for ext in self.extensions:      # GCC < 11: the same instruction sets, spelled out
                ext.extra_compile_args = [a for a in ext.extra_compile_args if a != "-march=x86-64-v2"]
                ext.extra_compile_args += X86_64_V2_FALLBACK
        if self.extensions:
            record_flags(self.extensions[0].extra_compile_args)
        try:
            super().run()
        except Exception as exc:  # noqa: BLE001 - re-raised as a clear exit
            sys.exit(f"hpcgnn: building the C++ extension in native/ failed ({exc}); "
                     "a C++17 compiler with OpenMP (g++ >= 9) is required")


X86_64 = platform.machine().lower() in ("x86_64", "amd64")
# The x86-64-v2 instruction sets for compilers older than GCC 11 (no -march=x86-64-v2).
X86_64_V2_FALLBACK = ["-march=x86-64", "-mssse3", "-msse4.1", "-msse4.2", "-mpopcnt", "-mcx16", "-msahf"]


def arch_flags() -> tuple[str, list[str]]:
    """(name recorded in the modules, compiler flags) from HPCGNN_NATIVE_ARCH; see the docstring."""
    arch = os.environ.get("HPCGNN_NATIVE_ARCH", "").strip()
    if not re.fullmatch(r"[A-Za-z0-9._+-]*", arch):
        sys.exit(f"hpcgnn: HPCGNN_NATIVE_ARCH={arch!r}: expected a -march value such as "
                 "x86-64-v2, x86-64-v3 or native (or none)")
    if arch in ("", "default"):
        arch = "x86-64-v2" if X86_64 else "none"
    if arch == "none":
        return "default", []
    if arch == "native" and not X86_64:
        return arch, ["-mcpu=native"]
    return arch, [f"-march={arch}"]


ARCH, ARCH_FLAGS = arch_flags()
# -fno-wrapv undoes the -fwrapv that Python's own CFLAGS put first: with signed overflow defined,
# GCC kept the SpMM's accumulators for partial chunks (47- and 100-wide rows) in memory, and a
# 47-wide gather took 1.5-2x as long (docs/benchmarks.md). The native code does not rely on
# signed wrap-around (its hashes are unsigned).
extra_compile = ["-O3", "-std=c++17", "-fno-wrapv", "-fopenmp", "-Wall", "-Wno-unused-function", *ARCH_FLAGS]
FLAGS_FILE = os.path.join("build", "native-flags.txt")


def record_flags(flags: list[str]) -> None:
    """Rewrite FLAGS_FILE when the flags differ from the last build's: every module depends on
    it, so build_ext recompiles them all after a change (and only then)."""
    text = " ".join(flags) + "\n"
    try:
        with open(FLAGS_FILE) as f:
            if f.read() == text:
                return
    except OSError:
        pass
    os.makedirs(os.path.dirname(FLAGS_FILE), exist_ok=True)
    with open(FLAGS_FILE, "w") as f:
        f.write(text)

native_modules = [
    Extension(
        f"hpcgnn._native_{os.path.splitext(os.path.basename(src))[0]}",
        sources=[src],
        include_dirs=[pybind11.get_include(), "native"],
        depends=sorted(glob.glob("native/*.h")) + [FLAGS_FILE],
        define_macros=[("HPCGNN_BUILD_ARCH", f'"{ARCH}"')],
        language="c++",
        extra_compile_args=extra_compile,
        extra_link_args=["-fopenmp"],
    )
    for src in sorted(glob.glob("native/*.cpp"))
]
# `make` builds the modules in place first (incrementally) and then installs
# the package in editable mode with HPCGNN_PREBUILT=1 so nothing compiles twice.
if os.environ.get("HPCGNN_PREBUILT") == "1":
    native_modules = []

setup(
    name="hpcgnn",
    version="0.1.0",
    description="Distributed GNN training on partitioned HDF5 graphs (MPI, SLURM)",
    packages=find_packages(include=["hpcgnn", "hpcgnn.*"]),
    python_requires=">=3.10",
    install_requires=[
        os.environ.get("HPCGNN_PT_REQUIREMENT", "torch==2.13.0"),
        "numpy",
        "h5py",
        "pymetis",
        "mpi4py",
        "mpich",
        "matplotlib",
        "kaminpar",
        "tensorboard",
    ],
    extras_require={"test": ["pytest"], "bench": ["torch_geometric"], "metis32": ["cmeel-metis"]},
    ext_modules=native_modules,
    cmdclass={"build_ext": BuildNative},
    entry_points={"console_scripts": ["hpcgnn = hpcgnn.cli:main"]},
)
