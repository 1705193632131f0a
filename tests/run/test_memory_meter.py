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
