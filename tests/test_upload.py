"""hpcgnn.upload: a host tensor on the device without waiting for it. On the CPU the tensor
itself; on a GPU (``pytest -m cuda``) the copy is exact whatever the caller does to its host
tensor afterwards, and a chain of copies issues no device synchronisation."""
from __future__ import annotations

import pytest
import torch

from hpcgnn.upload import upload


def test_cpu_target_is_the_tensor_itself():
    t = torch.arange(5)
    assert upload(t, "cpu") is t
    assert upload(t, torch.device("cpu")) is t


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_upload_is_exact_after_the_source_changes():
    """The host tensor is overwritten right after each upload, while a long kernel queue is
    still ahead of the copies on the stream: every device copy still holds what was sent."""
    dev = torch.device("cuda")
    busy = torch.randn(4096, 4096, device=dev)
    host = torch.zeros(10_000, dtype=torch.int64)
    sent = []
    for i in range(20):
        busy = busy @ busy / 4096.0          # keeps the stream busy: the copies run later
        host.fill_(i)
        sent.append(upload(host, dev))
        host.fill_(-1)                       # the caller reuses its buffer at once
    for i, d in enumerate(sent):
        assert d.device.type == "cuda" and bool((d == i).all()), i
    mask = torch.zeros(7, dtype=torch.bool)
    mask[[1, 3]] = True
    assert torch.equal(upload(mask, dev).cpu(), mask)
