"""The rank's memory meter (hpcgnn.run.memory.DeviceMemoryMeter) keeps the process's peak
resident memory across the per-epoch resets of the kernel's high-water mark, and a meter for
device accounting only (``rss=False``) never resets that mark."""
from __future__ import annotations

import numpy as np
import pytest

from hpcgnn.run.memory import DeviceMemoryMeter, peak_rss_bytes, reset_peak_rss, rss_bytes

BIG = 256 << 20


def _touch_and_free() -> int:
    """Raise the high-water mark by about BIG bytes and free them; returns the mark."""
    a = np.ones(BIG // 8)
    a[::512] = 2.0
    del a
    return peak_rss_bytes()


def test_the_process_peak_survives_the_epoch_resets():
    if not reset_peak_rss():
        pytest.skip("this kernel does not let a process reset its high-water mark")
    meter = DeviceMemoryMeter("cpu")
    setup = _touch_and_free()                   # set-up's peak, before the first epoch
    assert setup >= rss_bytes() + BIG // 2
    meter.start()                               # epoch 1: the kernel's mark is reset
    assert peak_rss_bytes() < setup - BIG // 2
    meter.after("forward")
    r = meter.result()
    assert r["peak_rss_bytes"] < setup - BIG // 2              # the epoch's own peak
    assert r["peak_process_rss_bytes"] >= setup                  # the process's, set-up included
    meter.start()                               # epoch 2: still kept
    assert meter.result()["peak_process_rss_bytes"] >= setup


def test_a_device_accounting_meter_leaves_the_mark_alone():
    if not reset_peak_rss():
        pytest.skip("this kernel does not let a process reset its high-water mark")
    mark = _touch_and_free()
    other = DeviceMemoryMeter("cpu", rss=False)
    other.start()
    assert peak_rss_bytes() >= mark and not other.resettable
    other.hold(100)
    assert other.peak_bytes == 100


def test_the_process_device_peak_keeps_the_set_up_across_epochs():
    """The device's peak with set-up (``peak_process_device_bytes``) survives the epoch resets,
    which restart ``peak_device_bytes`` from what is held."""
    meter = DeviceMemoryMeter("cpu", rss=False)
    meter.hold(1000)                            # set-up: a transient of 1000 bytes ...
    meter.release(1000)
    meter.hold(300)                             # ... and 300 kept for the run
    meter.start()                               # epoch 1
    meter.hold(200)
    meter.release(200)
    meter.after("forward")
    r = meter.result()
    assert r["peak_device_bytes"] == 500 and r["peak_process_device_bytes"] == 1000
    meter.start()                               # epoch 2: above the set-up's peak
    meter.hold(900)
    meter.after("forward")
    r = meter.result()
    assert r["peak_device_bytes"] == 1200 and r["peak_process_device_bytes"] == 1200


@pytest.mark.cuda
def test_the_process_device_peak_on_cuda_counts_what_came_before_the_first_epoch():
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    dev = torch.device("cuda")
    meter = DeviceMemoryMeter(dev, rss=False)
    base = torch.cuda.memory_allocated(dev)
    x = torch.empty(64 << 20, dtype=torch.uint8, device=dev)          # set-up: 64 MiB, freed
    del x
    meter.start()
    r = meter.result()
    assert r["peak_device_bytes"] < base + (64 << 20)
    assert r["peak_process_device_bytes"] >= base + (64 << 20)


def test_library_workspaces_are_none_off_cuda():
    from hpcgnn.run.memory import cuda_library_bytes

    assert cuda_library_bytes("cpu") is None


LIBRARY_SCRIPT = r"""
import torch
from hpcgnn.run.memory import cuda_library_bytes
torch.cuda.init()
torch.cuda.synchronize()
before = torch.cuda.memory_allocated()
first = cuda_library_bytes("cuda")
print("LIBS", first, torch.cuda.memory_allocated() - before, cuda_library_bytes("cuda"))
"""


@pytest.mark.cuda
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a GPU")
def test_library_workspaces_are_measured_once_and_stay_allocated():
    """On a GPU, in a fresh process: the first measurement is the workspaces the libraries keep
    (positive, below 1 GiB), the allocator holds them afterwards (memory_allocated grew by
    exactly that) and a second measurement finds nothing new."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", LIBRARY_SCRIPT], capture_output=True, text=True, timeout=120,
                          cwd=root)
    assert proc.returncode == 0, proc.stderr[-2000:]
    first, held, again = (int(v) for v in proc.stdout.split("LIBS")[1].split())
    assert 0 < first < (1 << 30) and held == first and again == 0, (first, held, again)
