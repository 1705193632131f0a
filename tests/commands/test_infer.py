"""`hpcgnn infer` on Cora under real mpiexec: for checkpoints of every engine (minibatch SAGE,
full-graph GCN, tensor-parallel decoupled and coupled GCN, each trained 2 epochs on 2 ranks) the file written
from 1 process (no launcher), 2 and 4 ranks (stores of 1, 2 and 4 parts) is the same to 1e-5;
predictions are the argmax of the logits; accuracies recomputed from the file equal the run
file's last evaluation; embeddings equal a single-process reference of the checkpoint's model;
bad input stops every rank with one line and exit 2 and writes nothing.

Commands run through ``tests/commands/infer_driver.py`` (many cases per MPI job: three jobs in
all, shared by every test through module-scoped fixtures).
"""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mpiutil import ROOT, clean_env, run_mpi  # noqa: E402

DRIVER = Path(__file__).resolve().parent / "infer_driver.py"
ENV = {"HPCGNN_THREADS": "1", "HPCGNN_SUPERVISE": "0"}
ENGINES = {
    "minibatch": (ROOT / "inputs" / "cora-sage.toml", []),
    "fullgraph": (ROOT / "inputs" / "cora-gcn-fullgraph.toml", []),
    "tensor": (ROOT / "inputs" / "cora-tensor.toml", ["--set", "tensor.k=4"]),
    "tensor-coupled": (ROOT / "inputs" / "cora-tensor.toml",
                       ["--set", "tensor.mode=coupled", "--set", "tensor.k=0", "--set", "tensor.alpha=0",
                        "--set", "tensor.gamma=1"]),
}
WHATS = ("logits", "predictions", "embeddings")
RANKS = (1, 2, 4)
TIMEOUT = 240
# name -> (args after `infer RUN`, text the one error line must contain)
BAD = {
    "no_checkpoint": ([], "has no checkpoint"),
    "layer_out_of_range": (["--what", "embeddings", "--layer", "3"], "--layer 3"),
    "layer_with_logits": (["--layer", "1"], "--layer 1"),
    "unknown_what": (["--what", "probabilities"], "--what"),
    "model_shape": (["--checkpoint", "{shape_ckpt}"], "does not fit the run's model"),
    "rank_count": (["--partitions", "{p4}"], "has 4 partitions but the job has 2 ranks"),
    "other_engine": (["--checkpoint", "{fg_ckpt}"], "engine 'fullgraph'"),
    "other_graph": (["--partitions", "{other}"], "the run was trained on"),
    "output_exists": ([], "already exists"),
    "moved_store": ([], "partition directory not found (the run's store"),
    "fanouts_per_layer": (["--method", "sampled", "--fanouts", "5,5,5"], "3 fanouts for a model of 2 layers"),
    "fanouts_not_integers": (["--method", "sampled", "--fanouts", "5,x"], "--fanouts '5,x'"),
    "fanouts_without_sampled": (["--fanouts", "5,5"], "only --method sampled"),
    "sampled_tensor": (["--method", "sampled", "--checkpoint", "{tensor_ckpt}"], "engine 'tensor'"),
}


def _drive(n: int | None, cases: list[dict], work: Path, tag: str) -> dict:
    """Run the cases on ``n`` ranks under mpiexec (``None``: one process without a launcher)."""
    cases_file, results = work / f"cases-{tag}.json", work / f"results-{tag}.json"
    cases_file.write_text(json.dumps(cases))
    if n is None:
        proc = subprocess.run([sys.executable, str(DRIVER), str(cases_file), str(results)],
                              capture_output=True, text=True, timeout=TIMEOUT, env=clean_env(ENV))
    else:
        proc = run_mpi(n, [DRIVER, cases_file, results], timeout=TIMEOUT, env=ENV)
    assert proc.returncode == 0 and results.exists(), proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(results.read_text())


def _infer_cases(runs: dict, store, out_dir: Path, tag: str) -> list[dict]:
    cases = []
    for engine, run in runs.items():
        for what in WHATS:
            args = ["infer", str(run), "--out", str(out_dir / f"{engine}-{what}-{tag}.h5"), "--what", what,
                    "--block-bytes", "8KiB"]   # many blocks: the assembly is exercised
            if store is not None:
                args += ["--partitions", str(store)]
            cases.append({"name": f"{engine}-{what}", "args": args})
    return cases


@pytest.fixture(scope="module")
def world(cora_graph, cora_parts, tmp_path_factory):
    """Trained runs of every engine and the files `infer` wrote from 1, 2 and 4 ranks, plus the
    results of the bad-input cases (all ranks' exit codes and stderr)."""
    from hpcgnn.cli import main

    work = tmp_path_factory.mktemp("infer")
    stores = {k: cora_parts(k) for k in RANKS}
    other_graph = work / "cora-rownorm.h5"   # another graph file (features normalised)
    assert main(["prepare", "--dataset", "cora", "--root", str(ROOT / "inputs" / "data"),
                 "--normalize-features", "row", "--out", str(other_graph)]) == 0
    assert main(["partition", str(other_graph), "--parts", "2", "--out", str(work / "other-p2")]) == 0
    runs = {e: work / f"run-{e}" for e in ENGINES}
    cases = []
    for engine, (config, extra) in ENGINES.items():
        cases.append({"name": f"train-{engine}", "args": [
            "train", "--config", str(config), "--set", f"data.partitions={stores[2]}",
            "--set", f"output.dir={runs[engine]}", "--set", "train.epochs=2", "--set", "train.eval_every=1",
            "--set", "train.checkpoint_every=1", "--set", "output.keep_checkpoints=2", "--force", *extra]})
    shape_run = work / "run-shape"   # the minibatch run's settings with another hidden width
    cases.append({"name": "train-shape", "args": [
        "train", "--config", str(ENGINES["minibatch"][0]), "--set", f"data.partitions={stores[2]}",
        "--set", f"output.dir={shape_run}", "--set", "train.epochs=1", "--set", "model.hidden=16",
        "--force"]})
    sampled_run = work / "run-sampled"   # sampled evaluation: what infer --method sampled repeats
    cases.append({"name": "train-sampled", "args": [
        "train", "--config", str(ENGINES["minibatch"][0]), "--set", f"data.partitions={stores[2]}",
        "--set", f"output.dir={sampled_run}", "--set", "train.epochs=2", "--set", "minibatch.eval=sampled",
        "--set", "minibatch.eval_batch_size=7", "--force"]})
    settings_run = work / "run-settings"   # per-rank runtime.threads and retained host memory
    cases.append({"name": "train-settings", "args": [
        "train", "--config", str(ENGINES["minibatch"][0]), "--set", f"data.partitions={stores[2]}",
        "--set", f"output.dir={settings_run}", "--set", "train.epochs=1", "--set", "runtime.threads=[1, 1]",
        "--set", "runtime.host_memory=retain", "--force"]})
    out = {n: work / f"out{n}" for n in RANKS}
    for d in out.values():
        d.mkdir()
    cases += _infer_cases(runs, None, out[2], "2")
    cases.append({"name": "epoch1", "args": [
        "infer", str(runs["minibatch"]), "--out", str(out[2] / "epoch1.h5"),
        "--checkpoint", str(runs["minibatch"] / "checkpoints" / "ckpt-000001.pt")]})
    cases.append({"name": "settings", "args": ["infer", str(settings_run), "--out", str(out[2] / "settings.h5")]})
    for split in ("val", "test"):
        cases.append({"name": f"sampled-{split}", "args": [
            "infer", str(sampled_run), "--out", str(out[2] / f"sampled-{split}.h5"), "--what", "predictions",
            "--vertices", split, "--method", "sampled"]})
    cases.append({"name": "sampled-logits", "args": [
        "infer", str(sampled_run), "--out", str(out[2] / "sampled-logits.h5"), "--vertices", "val",
        "--method", "sampled"]})
    cases.append({"name": "sampled-embeddings", "args": [
        "infer", str(sampled_run), "--out", str(out[2] / "sampled-embeddings.h5"), "--what", "embeddings",
        "--method", "sampled", "--fanouts", "4,25"]})
    cases.append({"name": "full-embeddings", "args": [
        "infer", str(sampled_run), "--out", str(out[2] / "full-embeddings.h5"), "--what", "embeddings"]})
    # bad input
    bad_dir, exists_dir = work / "bad", work / "exists"
    bad_dir.mkdir()
    exists_dir.mkdir()
    (exists_dir / "taken.h5").write_bytes(b"not ours")
    moved = work / "run-moved"   # a run whose recorded store is gone
    moved.mkdir()
    with h5py.File(moved / "run.h5", "w") as f:
        f.attrs["format"] = "hpcgnn-run"
        f.attrs["config"] = json.dumps({"data": {"partitions": str(work / "gone")}})
        f.attrs["engine"] = "minibatch"
        f.attrs["partition_dir"] = str(work / "gone")
        f.attrs["partition_hash"] = "0" * 64
    nockpt = work / "run-nockpt"
    cases.append({"name": "copy-run", "copy": [str(runs["minibatch"] / "run.h5"), str(nockpt / "run.h5")]})
    subst = {"shape_ckpt": str(shape_run / "checkpoints" / "ckpt-000001.pt"), "p4": str(stores[4]),
             "fg_ckpt": str(runs["fullgraph"] / "checkpoints" / "ckpt-000002.pt"),
             "other": str(work / "other-p2"),
             "tensor_ckpt": str(runs["tensor"] / "checkpoints" / "ckpt-000002.pt")}
    for name, (extra, _) in BAD.items():
        run = {"no_checkpoint": nockpt, "moved_store": moved}.get(name, runs["minibatch"])
        target = exists_dir / "taken.h5" if name == "output_exists" else bad_dir / f"{name}.h5"
        cases.append({"name": f"bad-{name}", "args": ["infer", str(run), "--out", str(target),
                                                      *[a.format(**subst) for a in extra]]})
    results = {2: _drive(2, cases, work, "2")}
    results[1] = _drive(None, _infer_cases(runs, stores[1], out[1], "1"), work, "1")
    results[4] = _drive(4, _infer_cases(runs, stores[4], out[4], "4"), work, "4")
    return {"work": work, "runs": runs, "out": out, "results": results, "graph": cora_graph,
            "bad_dir": bad_dir, "exists_dir": exists_dir}


def _file(world, n: int, engine: str, what: str) -> Path:
    res = world["results"][n][f"{engine}-{what}"]
    assert res["rc"] == [0] * n, res
    return world["out"][n] / f"{engine}-{what}-{n}.h5"


def _read(path: Path) -> tuple[dict, dict]:
    with h5py.File(path, "r") as f:
        return ({k: (v.decode() if isinstance(v, bytes) else v) for k, v in f.attrs.items()},
                {k: f[k][()] for k in f})


def _latest(run: Path) -> Path:
    return sorted((run / "checkpoints").glob("ckpt-*.pt"))[-1]


@pytest.mark.parametrize("engine", list(ENGINES))
def test_training_runs_finished(world, engine):
    res = world["results"][2][f"train-{engine}"]
    assert res["rc"] == [0, 0], res["stderr"][0][-3000:]


@pytest.mark.parametrize("engine", list(ENGINES))
def test_same_file_from_1_2_and_4_ranks(world, engine):
    ckpt = _latest(world["runs"][engine])
    sha = hashlib.sha256(ckpt.read_bytes()).hexdigest()
    for what in WHATS:
        files = {n: _read(_file(world, n, engine, what)) for n in RANKS}
        ref_attrs, ref = files[1]
        num_nodes = ref[what].shape[0]
        assert num_nodes == 2708
        for n, (attrs, data) in files.items():
            assert np.array_equal(data["vertex_ids"], np.arange(num_nodes))
            assert attrs["format"] == "hpcgnn-infer" and attrs["what"] == what
            assert attrs["engine"] == engine.split("-")[0]
            assert attrs["num_ranks"] == n and len(attrs["peak_rss_bytes"]) == n
            assert attrs["checkpoint_epoch"] == 2 and attrs["checkpoint_sha256"] == sha
            assert Path(attrs["checkpoint"]) == ckpt
            assert attrs["layer"] == (1 if what == "embeddings" else 2) and attrs["num_layers"] == 2
            assert data[what].shape == ref[what].shape and data[what].dtype == ref[what].dtype
            if what == "predictions":
                continue
            assert np.all(np.isfinite(data[what]))
            np.testing.assert_allclose(data[what], ref[what], rtol=0, atol=1e-5, err_msg=f"{what} {n} ranks")
        if what == "predictions":
            # equal wherever the logits' top two are further apart than the rank counts' difference
            logits = np.sort(_read(_file(world, 1, engine, "logits"))[1]["logits"], axis=1)
            clear = logits[:, -1] - logits[:, -2] > 1e-5
            assert clear.mean() > 0.99
            for n in RANKS:
                assert np.array_equal(files[n][1][what][clear], ref[what][clear])


@pytest.mark.parametrize("engine", list(ENGINES))
def test_predictions_are_argmax_and_accuracy_is_the_runs(world, engine):
    from hpcgnn.run.runfile import read_run

    metrics = read_run(world["runs"][engine])["metrics"]
    with h5py.File(world["graph"], "r") as g:
        labels = g["labels"][()]
        masks = {s: g[f"{s}_mask"][()] for s in ("train", "val", "test")}
    for n in RANKS:
        logits = _read(_file(world, n, engine, "logits"))[1]["logits"]
        pred = _read(_file(world, n, engine, "predictions"))[1]["predictions"]
        assert pred.dtype == np.int64
        assert np.array_equal(pred, logits.argmax(1))
        for split, mask in masks.items():
            acc = float((pred[mask] == labels[mask]).mean())
            assert acc == pytest.approx(float(metrics[f"{split}_acc"][-1]), abs=1e-12), (n, split)


def test_embeddings_and_logits_equal_a_single_process_reference(world):
    """The minibatch SAGE checkpoint run over the whole graph in one block: layer 1 (the
    default embeddings) and the logits; the decoupled tensor run's layer 1 is its MLP's first
    layer, the coupled one's a GCN layer (computed here with numpy)."""
    from hpcgnn.engine.model import build_model_from_config
    from hpcgnn.commands.infer import run_config
    from hpcgnn.run.runfile import read_run
    from hpcgnn.sampling.block import Block

    with h5py.File(world["graph"], "r") as g:
        indptr, indices = g["indptr"][()].astype(np.int64), g["indices"][()].astype(np.int64)
        x = torch.from_numpy(g["features"][()].astype(np.float32))
    v = x.shape[0]
    run = world["runs"]["minibatch"]
    cfg = run_config(read_run(run)["attrs"]["config"], "run")
    model = build_model_from_config(cfg, x.shape[1], 7)
    model.load_state_dict(torch.load(_latest(run), weights_only=True)["model"])
    model.eval()
    blk = Block(v, v, torch.from_numpy(indptr), torch.from_numpy(indices))
    with torch.no_grad():
        h1 = model.layer_forward(0, blk, x)
        logits = model.layer_forward(1, blk, h1)
    for n in RANKS:
        emb = _read(_file(world, n, "minibatch", "embeddings"))[1]["embeddings"]
        np.testing.assert_allclose(emb, h1.numpy(), rtol=0, atol=1e-4)
        out = _read(_file(world, n, "minibatch", "logits"))[1]["logits"]
        np.testing.assert_allclose(out, logits.numpy(), rtol=0, atol=1e-4)
    state = torch.load(_latest(world["runs"]["tensor"]), weights_only=True)["model"]
    ref = torch.relu(x @ state["lins.0.weight"].T + state["lins.0.bias"]).numpy()
    for n in RANKS:
        emb = _read(_file(world, n, "tensor", "embeddings"))[1]["embeddings"]
        np.testing.assert_allclose(emb, ref, rtol=0, atol=1e-4)
    # coupled GCN layer 1: relu(D~^-1/2 (A + I) D~^-1/2 x W^T + b), in float64
    state = torch.load(_latest(world["runs"]["tensor-coupled"]), weights_only=True)["model"]
    z = x.double().numpy() @ state["lins.0.weight"].double().numpy().T
    scale = 1.0 / np.sqrt(np.diff(indptr) + 1.0)
    zs = z * scale[:, None]
    agg = np.zeros_like(zs)
    dst = np.repeat(np.arange(v), np.diff(indptr))
    np.add.at(agg, dst, zs[indices])
    ref = np.maximum((agg + zs) * scale[:, None] + state["biases.0"].double().numpy(), 0.0)
    for n in RANKS:
        emb = _read(_file(world, n, "tensor-coupled", "embeddings"))[1]["embeddings"]
        np.testing.assert_allclose(emb, ref, rtol=0, atol=1e-4)


def test_explicit_checkpoint_is_recorded(world):
    res = world["results"][2]["epoch1"]
    assert res["rc"] == [0, 0], res
    attrs, data = _read(world["out"][2] / "epoch1.h5")
    ckpt = world["runs"]["minibatch"] / "checkpoints" / "ckpt-000001.pt"
    assert attrs["checkpoint_epoch"] == 1
    assert attrs["checkpoint_sha256"] == hashlib.sha256(ckpt.read_bytes()).hexdigest()
    latest = _read(_file(world, 2, "minibatch", "logits"))[1]["logits"]
    assert not np.allclose(data["logits"], latest)   # another epoch's parameters


def test_runtime_settings_of_the_run_apply(world):
    """A run trained with per-rank ``runtime.threads`` and ``runtime.host_memory = "retain"``:
    infer applies its [runtime] section as train does (a thread list once broke it)."""
    res = world["results"][2]["settings"]
    assert world["results"][2]["train-settings"]["rc"] == [0, 0]
    assert res["rc"] == [0, 0], res
    attrs, data = _read(world["out"][2] / "settings.h5")
    assert data["logits"].shape == _read(_file(world, 2, "minibatch", "logits"))[1]["logits"].shape


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_exit_2_on_every_rank_and_nothing_written(world, name):
    res = world["results"][2][f"bad-{name}"]
    assert res["rc"] == [2, 2], res
    lines = [ln for ln in res["stderr"][0].splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("hpcgnn: error:"), lines
    assert BAD[name][1] in lines[0], lines[0]
    assert "Traceback" not in "".join(res["stderr"])
    assert sorted(p.name for p in world["bad_dir"].iterdir()) == []
    assert sorted(p.name for p in world["exists_dir"].iterdir()) == ["taken.h5"]
    assert (world["exists_dir"] / "taken.h5").read_bytes() == b"not ours"


def test_sampled_inference_repeats_the_runs_sampled_evaluation(world):
    """``--method sampled --vertices val|test``: the minibatch engine's sampled evaluation
    (another batch size: the rows do not depend on it), so the accuracies from the file are the
    run's last evaluation; the logits' argmax are those predictions; the file records the
    method and fanouts."""
    from hpcgnn.run.runfile import read_run

    assert world["results"][2]["train-sampled"]["rc"] == [0, 0]
    metrics = read_run(world["work"] / "run-sampled")["metrics"]
    with h5py.File(world["graph"], "r") as g:
        labels = g["labels"][()]
        masks = {s: g[f"{s}_mask"][()] for s in ("val", "test")}
    for split, mask in masks.items():
        res = world["results"][2][f"sampled-{split}"]
        assert res["rc"] == [0, 0], res
        attrs, data = _read(world["out"][2] / f"sampled-{split}.h5")
        assert attrs["method"] == "sampled" and json.loads(attrs["fanouts"]) == [10, 10]
        assert np.array_equal(data["vertex_ids"], np.flatnonzero(mask))
        acc = float((data["predictions"] == labels[mask]).mean())
        assert acc == pytest.approx(float(metrics[f"{split}_acc"][-1]), abs=1e-12), split
    logits = _read(world["out"][2] / "sampled-logits.h5")[1]["logits"]
    pred = _read(world["out"][2] / "sampled-val.h5")[1]["predictions"]
    assert np.array_equal(logits.argmax(1), pred)
    full = _read(_file(world, 2, "minibatch", "logits"))[1]["logits"]
    assert logits.shape == (int(masks["val"].sum()), full.shape[1])


def test_sampled_embeddings_run_the_first_layers_with_the_given_fanouts(world):
    """``--what embeddings --method sampled --fanouts 4,25``: every vertex's layer-1 rows,
    sampled with the input-most fanout 4: a vertex of in-degree <= 4 keeps all its neighbours,
    so its row is the full inference's; most others differ."""
    res = world["results"][2]["sampled-embeddings"]
    assert res["rc"] == [0, 0], res
    attrs, data = _read(world["out"][2] / "sampled-embeddings.h5")
    assert json.loads(attrs["fanouts"]) == [4] and attrs["layer"] == 1
    emb = data["embeddings"]
    full = _read(world["out"][2] / "full-embeddings.h5")[1]["embeddings"]
    assert emb.shape == full.shape == (2708, 64)
    with h5py.File(world["graph"], "r") as g:
        degree = np.diff(g["indptr"][()])
    low = degree <= 4
    np.testing.assert_allclose(emb[low], full[low], rtol=0, atol=1e-5)
    differs = np.abs(emb[~low] - full[~low]).max(axis=1) > 1e-4
    assert differs.mean() > 0.5, differs.mean()
