"""Divergence and non-finite settings (issue 23, class 5).

* A nan or +-inf float setting (every float key of every section, engine sections included) is
  refused at load with one line naming the dotted key; under mpiexec -n 2 every rank exits 2
  before a run file exists.
* A non-finite loss or gradient stops training at the step where it appears, on every rank, with
  one line naming the epoch and step (GradientAllreduce's flag, before the optimizer step): exit
  2 everywhere, run.h5 ``status = "failed"`` with that line, and no checkpoint holds a non-finite
  tensor. Real mpiexec, 2 ranks, Cora, for the minibatch, fullgraph and tensor engines.
* The reducer on 1 rank (no allreduce) and the loop's pre-checkpoint check, as units.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

import mb_support as mb  # noqa: E402

from hpcgnn.comm.allreduce import GradientAllreduce  #noqa: E402
from hpcgnn.engine.loop import require_finite_state  # noqa: E402
from hpcgnn.errors import InputError, TrainingDiverged  # noqa: E402
from hpcgnn.run.config import load_config, schema  # noqa: E402
from hpcgnn.run.runfile import read_run  # noqa: E402

DIVERGED = re.compile(r"hpcgnn: error: (training diverged at epoch (\d+), step (\d+) of (\d+): the loss or a "
                      r"gradient is not finite \((nan|inf)\); no checkpoint was written for it \(lower "
                      r"train\.lr, check the input features\))$")

# lr 1e30 is finite but makes Adam's first update ~1e30 per weight: the next forward overflows.
MINIBATCH = ("[model]\nhidden = 16\nlayers = 2\n[train]\nepochs = 3\nlr = 1e30\ncheckpoint_every = 1\n"
             "[minibatch]\nbatch_size = 32\nfanouts = [5, 5]\n")
FULLGRAPH = "[model]\narch = \"gcn\"\nhidden = 16\nlayers = 2\n[train]\nengine = \"{engine}\"\nepochs = 3\n" \
            "lr = 1e30\ncheckpoint_every = 1\n"


# ---- settings ------------------------------------------------------------------------------
def _float_keys():
    return [f"{section}.{name}" for section, keys in schema().items() for name, key in keys.items()
            if key.type is float or (isinstance(key.type, tuple) and float in key.type)]


def test_the_float_keys_include_the_engine_sections():
    keys = _float_keys()
    assert {"train.lr", "train.weight_decay", "model.dropout", "tensor.alpha", "tensor.gamma",
            "tensor.device_memory", "store.device_memory"} <= set(keys)


@pytest.mark.parametrize("value", ["inf", "-inf", "nan"])
@pytest.mark.parametrize("name", _float_keys())
def test_a_non_finite_float_setting_is_refused_naming_the_key(name, value):
    with pytest.raises(InputError) as exc:
        load_config(None, ["data.partitions=x", f"{name}={value}"])
    assert str(exc.value) == f"config: {name} = {float(value)!r}, expected a finite number"


def test_a_non_finite_float_in_a_toml_file_is_refused(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text("[train]\nweight_decay = -inf\n[tensor]\ngamma = nan\n")
    with pytest.raises(InputError, match=r"c\.toml: train\.weight_decay = -inf, expected a finite number"):
        load_config(p, ["data.partitions=x"])


def test_finite_float_settings_are_still_accepted():
    cfg = load_config(None, ["data.partitions=x", "train.lr=1e30", "train.weight_decay=5e-4", "tensor.alpha=0.1"])
    assert (cfg.train.lr, cfg.train.weight_decay, cfg.tensor.alpha) == (1e30, 5e-4, 0.1)


@pytest.fixture(scope="module")
def cora2(cora_parts):
    return cora_parts(2)


@pytest.mark.parametrize("setting", ["train.lr=inf", "train.weight_decay=nan"])
def test_a_non_finite_setting_exits_2_on_every_rank_before_any_run_file(tmp_path, cora2, setting):
    cfg = mb.write_config(tmp_path / "run.toml", MINIBATCH)
    run = tmp_path / "run"
    proc, codes = mb.train_each_rank_exit(2, ["train", "--config", str(cfg), "--set", f"data.partitions={cora2}",
                                               "--set", f"output.dir={run}", "--set", setting])
    assert codes == {0: 2, 1: 2}, proc.stdout + proc.stderr
    name, value = setting.split("=")
    assert proc.stderr.strip().splitlines() == [
        f"hpcgnn: error: {cfg}: {name} = {value}, expected a finite number"], proc.stderr
    assert not run.exists()


# ---- divergence under mpiexec ------------------------------------------------------------------
def _checkpoint_tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _checkpoint_tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _checkpoint_tensors(v)


def _assert_diverged(proc, codes, run: Path) -> tuple[int, int]:
    """Exit 2 on both ranks, one divergence line, run.h5 failed with it, every checkpoint finite;
    returns (epoch, step) of the line."""
    assert codes == {0: 2, 1: 2}, proc.stdout + proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("hpcgnn:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    m = DIVERGED.match(errors[0])
    assert m, errors[0]
    epoch, step, steps = int(m[2]), int(m[3]), int(m[4])
    assert 1 <= step <= steps
    r = read_run(run)
    assert r["attrs"]["status"] == "failed" and r["attrs"]["error"] == m[1]
    logged = r["metrics"]["epoch"].tolist() if "epoch" in r["metrics"] else []
    assert logged == list(range(1, epoch))          # the diverged epoch is not logged
    ckpts = sorted((run / "checkpoints").glob("*.pt"))
    assert len(ckpts) == epoch - 1                   # checkpoint_every = 1: every earlier epoch, not this one
    for path in ckpts:
        state = torch.load(path, weights_only=True)
        tensors = list(_checkpoint_tensors(state))
        assert tensors and all(bool(torch.isfinite(t).all()) for t in tensors if t.is_floating_point()), path
    return epoch, step


@pytest.mark.parametrize("backend", ["mpi4py", "gloo"])
def test_minibatch_divergence_stops_every_rank_at_the_step(tmp_path, cora2, backend):
    cfg = mb.write_config(tmp_path / "run.toml", MINIBATCH)
    run = tmp_path / "run"
    proc, codes = mb.train_each_rank_exit(2, ["train", "--config", str(cfg), "--set", f"data.partitions={cora2}",
                                               "--set", f"output.dir={run}",
                                               "--set", f"runtime.backend={backend}"], timeout=180)
    epoch, step = _assert_diverged(proc, codes, run)
    assert (epoch, step) == (1, 2)   # Adam's first update (step 1) is finite; step 2's forward overflows


@pytest.mark.parametrize("engine", ["fullgraph", "tensor"])
def test_full_batch_divergence_stops_every_rank_after_finite_checkpoints(tmp_path, cora2, engine):
    cfg = mb.write_config(tmp_path / "run.toml", FULLGRAPH.format(engine=engine))
    run = tmp_path / "run"
    proc, codes = mb.train_each_rank_exit(2, ["train", "--config", str(cfg), "--set", f"data.partitions={cora2}",
                                               "--set", f"output.dir={run}"], timeout=180)
    epoch, step = _assert_diverged(proc, codes, run)
    assert (epoch, step) == (2, 1)   # one step per epoch: epoch 1's update is finite and checkpointed


# ---- units: the reducer on one rank, the loop's check ------------------------------------------
ONE_RANK = SimpleNamespace(size=1, rank=0, comm=None)


def _model_with_grads():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    loss = model(torch.randn(5, 4)).square().mean()
    loss.backward()
    return model, loss


def test_reducer_passes_finite_gradients_and_loss_unchanged():
    model, loss = _model_with_grads()
    before = [p.grad.clone() for p in model.parameters()]
    red = GradientAllreduce(model, ONE_RANK)
    red(loss, epoch=1, step=0, steps=3)
    red(float(loss.detach()), epoch=1, step=1, steps=3)
    red(None, epoch=1, step=2, steps=3)
    assert all(torch.equal(a, p.grad) for a, p in zip(before, model.parameters()))
    # float32 gradients and the float64 [loss, samples] tail
    assert red.bytes_per_call == sum(p.numel() for p in model.parameters()) * 4 + 3 * 8


def test_reducer_accepts_huge_finite_gradients_whose_sum_overflows():
    model, loss = _model_with_grads()
    for p in model.parameters():
        p.grad.fill_(3e38)                       # finite, but their sum is inf in float32
    GradientAllreduce(model, ONE_RANK)(loss, epoch=1)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_reducer_raises_on_a_non_finite_gradient_before_writing_it_back(bad):
    model, loss = _model_with_grads()
    last = list(model.parameters())[-1]
    last.grad[0] = bad
    first = list(model.parameters())[0]
    first.grad.fill_(7.0)
    red = GradientAllreduce(model, ONE_RANK)
    with pytest.raises(TrainingDiverged) as exc:
        red(loss, epoch=4, step=2, steps=9)
    kind = "nan" if bad != bad else "inf"
    assert str(exc.value) == (f"training diverged at epoch 4, step 3 of 9: the loss or a gradient is not finite "
                              f"({kind}); no checkpoint was written for it (lower train.lr, check the input features)")
    assert isinstance(exc.value, InputError)     # the runtime's one-line exit 2


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("as_tensor", [True, False])
def test_reducer_raises_on_a_non_finite_loss_with_finite_gradients(bad, as_tensor):
    model, _ = _model_with_grads()
    red = GradientAllreduce(model, ONE_RANK)
    loss = torch.tensor(bad) if as_tensor else bad
    kind = "nan" if bad != bad else "inf"
    with pytest.raises(TrainingDiverged, match=rf"at epoch 2, step 1 of 1: .* not finite \({kind}\)"):
        red(loss, epoch=2)
    red(torch.tensor(1.5), epoch=2)              # the flag is rewritten each call


def test_loop_refuses_to_checkpoint_non_finite_parameters_or_optimizer_state():
    model, loss = _model_with_grads()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    opt.step()
    engine = SimpleNamespace(model=model, optimizer=opt)
    require_finite_state(engine, ONE_RANK, 1)
    state = next(iter(opt.state.values()))
    state["exp_avg_sq"].view(-1)[0] = float("inf")
    with pytest.raises(TrainingDiverged, match=r"^training diverged at epoch 3: a parameter or optimizer state"):
        require_finite_state(engine, ONE_RANK, 3)
    state["exp_avg_sq"].view(-1)[0] = 1.0
    with torch.no_grad():
        list(model.parameters())[0].view(-1)[0] = float("nan")
    with pytest.raises(TrainingDiverged):
        require_finite_state(engine, ONE_RANK, 3)


@pytest.mark.parametrize("setting,expect", [("train.lr=4e37", "train.lr = 4e+37, expected > 0 and <= 1e30"),
                                            ("train.weight_decay=1e39", "train.weight_decay = 1e+39, expected >= 0 and <= 1e30")])
def test_settings_adam_cannot_hold_in_float32_are_refused(setting, expect):
    with pytest.raises(InputError, match=re.escape(expect)):
        load_config(None, ["data.partitions=x", setting])
