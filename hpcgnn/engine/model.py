"""The model and optimizer every engine builds from the configuration: identical initial
parameters on every rank (seeded, then broadcast from rank 0), Adam, and a parameter checksum
for tests."""
from __future__ import annotations

import hashlib

import torch

from hpcgnn.nn.optim import Adam
from hpcgnn.seeding import seed_torch


def build_model_from_config(cfg, in_dim: int, num_classes: int, rt=None,
                            device: torch.device | str = "cpu", **extra) -> torch.nn.Module:
    """The configured model; parameters seeded by cfg.train.seed and broadcast from rank 0.

    ``extra`` is passed to :func:`hpcgnn.nn.models.build_model` (e.g. GCN normalisation).
    The layers aggregate with ``train.kernels`` (:func:`kernel_backend`) and
    ``train.deterministic``.
    """
    from hpcgnn.nn.models import build_model
    from hpcgnn.nn.precision import set_precision

    m = cfg.model
    seed_torch(cfg.train.seed, -1)
    kwargs = dict(extra)
    kwargs.setdefault("backend", kernel_backend(cfg, device))
    kwargs.setdefault("deterministic", cfg.train.deterministic)
    if m.arch == "gat":
        kwargs.setdefault("gat_variant", m.gat_variant)
    model = build_model(m.arch, in_dim, m.hidden, num_classes, m.layers, m.heads, m.dropout, **kwargs)
    model = set_precision(model, cfg.train.precision).to(device)
    if rt is not None and rt.size > 1:
        broadcast_parameters(model, rt)
    return model


def kernel_backend(cfg, device: torch.device | str = "cpu") -> str:
    """The aggregation backend of ``train.kernels`` (:mod:`hpcgnn.nn.aggregate`: ``auto`` = the
    native kernels on the CPU, the torch path on CUDA) on compute ``device``. InputError for
    ``native`` on a non-CPU device."""
    from hpcgnn.errors import InputError

    kernels = cfg.train.kernels
    if kernels == "native" and torch.device(device).type != "cpu":
        raise InputError(f"train.kernels = 'native' runs on the CPU only, but train.device is "
                         f"{torch.device(device).type}: use 'auto' or 'torch'")
    return kernels


def broadcast_parameters(model: torch.nn.Module, rt) -> None:
    """Overwrite every rank's parameters and buffers with rank 0's (one flat float32 buffer,
    through the job's data plane ``rt.data_plane``; mpi4py on ``rt.comm`` before there is one)."""
    from hpcgnn.comm.communicator_mpi import MpiCommunicator

    tensors = [t for t in list(model.parameters()) + list(model.buffers()) if t.is_floating_point()]
    if not tensors:
        return
    comm = getattr(rt, "data_plane", None) or MpiCommunicator(rt.comm)
    flat = torch.cat([t.detach().reshape(-1).to("cpu", torch.float32) for t in tensors])
    comm.broadcast_(flat, root=0)
    off = 0
    with torch.no_grad():
        for t in tensors:
            n = t.numel()
            t.copy_(flat[off:off + n].view_as(t).to(t.device, t.dtype))
            off += n


def build_optimizer(cfg, model: torch.nn.Module) -> Adam:
    """Adam with cfg.train.lr and cfg.train.weight_decay (:class:`hpcgnn.nn.optim.Adam`:
    ``torch.optim.Adam``'s results and state format, without importing TorchDynamo)."""
    return Adam(model.parameters(), lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)


def parameter_checksum(model: torch.nn.Module) -> str:
    """sha256 (hex) of all parameters' bytes in order: equal iff parameters are bitwise equal."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()
