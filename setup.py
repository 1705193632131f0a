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
"""
import glob
import os
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

    def run(self):
        try:
            super().run()
        except Exception as exc:  # noqa: BLE001 - re-raised as a clear exit
            sys.exit(f"hpcgnn: building the C++ extension in native/ failed ({exc}); "
                     "a C++17 compiler with OpenMP (g++ >= 9) is required")


extra_compile = ["-O3", "-std=c++17", "-fopenmp", "-Wall", "-Wno-unused-function"]
if os.environ.get("HPCGNN_NATIVE_MARCH", "native") != "none":
    # Vectorise for the build machine by default; HPCGNN_NATIVE_MARCH=none
    # gives a portable build for heterogeneous clusters.
    extra_compile.append("-march=" + os.environ.get("HPCGNN_NATIVE_MARCH", "native"))

native_modules = [
    Extension(
        f"hpcgnn._native_{os.path.splitext(os.path.basename(src))[0]}",
        sources=[src],
        include_dirs=[pybind11.get_include(), "native"],
        depends=sorted(glob.glob("native/*.h")),
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
        os.environ.get("HPCGNN_TORCH", "torch==2.13.0"),
        "numpy",
        "h5py",
        "pymetis",
        "mpi4py",
        "mpich",
    ],
    extras_require={"test": ["pytest"], "bench": ["torch_geometric"]},
    ext_modules=native_modules,
    cmdclass={"build_ext": BuildNative},
    entry_points={"console_scripts": ["hpcgnn = hpcgnn.cli:main"]},
)
