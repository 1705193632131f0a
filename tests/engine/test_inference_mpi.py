"""The minibatch engine's full-neighbour evaluation gives the same logits on 1, 2 and 4 real MPI
ranks, whatever its destination chunks and halo rounds (SAGE, GCN, GAT)."""
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))

from mb_support import tiny_graph, tiny_store, write_config  # noqa: E402
from mpiutil import ROOT, run_mpi  # noqa: E402

CONFIG = """
[model]
arch = "sage"
hidden = 8
layers = 3
heads = 2
dropout = 0.5
[train]
engine = "minibatch"
epochs = 1
seed = 3
[minibatch]
batch_size = 16
fanouts = [2, 2, 2]
"""


def test_full_inference_equal_across_ranks(tmp_path):
    graph = tiny_graph(num_nodes=300, num_features=12)
    cfg = write_config(tmp_path / "c.toml", CONFIG)
    driver = ROOT / "tests" / "engine" / "inference_driver.py"
    archs = ("sage", "gcn", "gat")
    results = {}
    # ranks -> (eval_rows, eval_halo_rounds) settings, all of one rank count in one launch
    for n, settings in ((1, [(0, 0)]), (2, [(7, 3)]), (4, [(0, 0), (11, 2)])):
        parts = tmp_path / f"p{n}"
        tiny_store(parts, graph, n)
        specs = [f"{tmp_path / f'logits-{n}-{rows}-{rounds}'}|minibatch.eval_rows={rows}|"
                 f"minibatch.eval_halo_rounds={rounds}" for rows, rounds in settings]
        proc = run_mpi(n, [driver, parts, cfg, ",".join(archs), *specs],
                       timeout=150, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr[-3000:]
        for rows, rounds in settings:
            for arch in archs:
                results[(arch, n, rows, rounds)] = np.load(f"{tmp_path / f'logits-{n}-{rows}-{rounds}'}-{arch}.npy")
    for arch in archs:
        ref = results[(arch, 1, 0, 0)]
        assert np.abs(ref).max() > 0
        for (a, *key), got in results.items():
            if a != arch:
                continue
            assert np.array_equal(got.argmax(1), ref.argmax(1)), (arch, key)
            assert np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max(), (arch, key)
