"""prefer_huge_pages: torch's large CPU tensors land on transparent huge pages unless opted out."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from hpcgnn.runtime import prefer_huge_pages

THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")

PROBE = """
import os, sys
from hpcgnn.runtime import prefer_huge_pages
print(prefer_huge_pages())
import torch
x = torch.empty(64 << 18)  # 64 MiB of float32
x.fill_(1.0)
kb = [int(l.split()[1]) for l in open('/proc/self/smaps_rollup') if l.startswith('AnonHugePages')]
print(kb[0] if kb else -1)
"""


def test_sets_the_variable_unless_the_user_did(monkeypatch):
    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)
    assert prefer_huge_pages() is True
    import os

    assert os.environ["THP_MEM_ALLOC_ENABLE"] == "1"
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "0")
    assert prefer_huge_pages() is False
    assert os.environ["THP_MEM_ALLOC_ENABLE"] == "0"


def _probe(env_value):
    import os

    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    if env_value is not None:
        env["THP_MEM_ALLOC_ENABLE"] = env_value
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    requested, huge_kb = out.stdout.split()
    return requested == "True", int(huge_kb)


@pytest.mark.skipif(not THP_MODE.exists() or "[never]" in THP_MODE.read_text() or
                    not Path("/proc/self/smaps_rollup").exists(),
                    reason="transparent huge pages are unavailable on this kernel")
def test_torch_tensors_get_huge_pages_and_opt_out_works():
    requested, huge_kb = _probe(None)
    assert requested and huge_kb >= 32 << 10  # at least half of the 64 MiB tensor
    requested, huge_kb = _probe("0")
    if "[always]" not in THP_MODE.read_text():  # in "always" mode the kernel gives them anyway
        assert not requested and huge_kb < 32 << 10
