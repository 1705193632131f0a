"""runtime.mpi_library: one clean line for the record, whatever the MPI library's string holds."""
import h5py
from mpi4py import MPI

from hpcgnn.runtime import mpi_library


def test_open_mpi_string_with_a_nul_is_recorded_without_it(tmp_path, monkeypatch):
    # Open MPI 4.1.6 (Debian, seen on a GPU machine) ends its library version with a NUL, which
    # an HDF5 string attribute refuses ("VLEN strings do not support embedded NULLs").
    monkeypatch.setattr(MPI, "Get_library_version",
                        lambda: "Open MPI v4.1.6, package: Debian OpenMPI, ident: 4.1.6\x00")
    got = mpi_library()
    assert got.startswith("Open MPI v4.1.6, package: Debian OpenMPI, ident: 4.1.6 (mpi4py vendor ")
    assert "\x00" not in got
    with h5py.File(tmp_path / "f.h5", "w") as f:
        f.attrs["mpi_library"] = got
    with h5py.File(tmp_path / "f.h5", "r") as f:
        assert f.attrs["mpi_library"] == got


def test_only_the_first_line_with_its_whitespace_collapsed(monkeypatch):
    monkeypatch.setattr(MPI, "Get_library_version", lambda: "MPICH Version:  5.0.2\nMPICH Release date: x\n")
    assert mpi_library().startswith("MPICH Version: 5.0.2 (mpi4py vendor ")
