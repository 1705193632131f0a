"""``GradientAllreduce(accumulations="learn")`` (the full-pass engines' reducer, issue 26): the
first step counts each gradient's accumulations and starts nothing during backward; later steps
start a bucket during backward once its gradients had that many; a gradient that grows after its
bucket left (here: one rank backwards one extra pass in step 3) makes every rank reduce the step
again, so the result is still the plain sum, and overlap stops. Real ``mpiexec -n 2``, mpi4py
and gloo."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mpiutil import run_mpi  # noqa: E402

DRIVER = r'''
import json, sys
import torch
from hpcgnn.runtime import Runtime
from hpcgnn.comm.data_plane import make_communicator
from hpcgnn.comm.allreduce import GradientAllreduce

backend, out = sys.argv[1], sys.argv[2]
rt = Runtime.start(threads=1)
comm = make_communicator(rt, backend, "cpu").duplicate()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
red = GradientAllreduce(model, comm, op="sum", bucket_bytes=16, accumulations="learn")
x = torch.arange(8.0).view(2, 4) + rt.rank
report = []
for step in range(4):
    model.zero_grad(set_to_none=True)
    red.begin()
    passes = 2 + (1 if (step == 2 and rt.rank == 1) else 0)    # rank 1: one pass more in step 3
    for _ in range(passes):
        model(x * (1 + _)).sum().backward()
    local = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).clone()
    started = red.started_in_backward
    red(None, step)
    total = local.clone()
    comm.allreduce_(total)   # the plain sum of the final local gradients, for comparison
    got = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    report.append({"started": started, "overlap": red.overlap,
                   "diff": float((got - total).abs().max())})
if rt.rank == 0:
    json.dump(report, open(out, "w"))
rt.finish()
'''


@pytest.mark.parametrize("backend", ["mpi4py", "gloo"])
def test_learned_counts_overlap_and_a_late_gradient_is_reduced_again(tmp_path, backend):
    (tmp_path / "driver.py").write_text(DRIVER)
    out = tmp_path / "report.json"
    proc = run_mpi(2, [tmp_path / "driver.py", backend, out], timeout=120, env={"HPCGNN_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rep = json.loads(out.read_text())
    assert all(r["diff"] == 0.0 for r in rep), rep            # always the plain sum
    assert rep[0]["started"] == 0 and rep[0]["overlap"]       # step 1 counts
    assert rep[1]["started"] >= 1 and rep[1]["overlap"]       # step 2 starts during backward
    assert not rep[2]["overlap"]                              # step 3: a late gradient: redo, stop
    assert rep[3]["started"] == 0 and not rep[3]["overlap"]
