"""The halo cache's admission and its sender/receiver protocol, without MPI: K simulated ranks
exchange messages delivered in a random order, late within the pipeline's window, the
receiver taking the rows' positions from its mirror of the owners' schedule (the owner sends
rows only); every assembled halo block equals the block built independently from (rows sent) U
(rows cached), every row's value is its owner's value of epoch t - age, and age <= S.
The device path (``assemble_tensor``, ``CachedHalo.fetch_tensor``) builds the same blocks as the
host path, with the device tier's rows never crossing to the host (counted by side: on a CPU run
the device tier is a separately budgeted host buffer), also on 2 real MPI ranks."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mpiutil import run_mpi  # noqa: E402

from hpcgnn.cache.halo import TIER_DEVICE, TIER_HOST, TIER_NONE, ReceiverCache, admission  # noqa: E402
from hpcgnn.comm.halo_cached import RefreshSchedule  # noqa: E402


def test_admission_by_duplication_count_with_tier_budgets():
    dup = np.array([1, 3, 2, 3, 1, 2, 4])
    tier, slot = admission(dup, row_bytes=10, budget_bytes=45, device_bytes=20)
    # order by dup desc, ties by position (global ID): 6, 1, 3, 2, 5, 0, 4; capacity 4 rows, 2 on device
    assert tier.tolist() == [TIER_NONE, TIER_DEVICE, TIER_HOST, TIER_HOST, TIER_NONE, TIER_NONE, TIER_DEVICE]
    assert slot[[6, 1]].tolist() == [0, 1] and slot[[3, 2]].tolist() == [0, 1]
    assert (slot[tier == TIER_NONE] == -1).all()
    tier, _ = admission(dup, row_bytes=10, budget_bytes=None, device_bytes=None)
    assert (tier == TIER_DEVICE).all()
    tier, _ = admission(dup, row_bytes=10, budget_bytes=0, device_bytes=None)
    assert (tier == TIER_NONE).all()
    tier, _ = admission(dup, row_bytes=10, budget_bytes=None, device_bytes=0)
    assert (tier == TIER_HOST).all()


def _simulate(k, staleness, lag, budget_rows, epochs, layers, seed):
    rng = np.random.default_rng(seed)
    n_solid = rng.integers(5, 30, k)
    # halo of receiver r from owner q: sorted random subset of q's rows
    halo = {(r, q): np.sort(rng.choice(n_solid[q], rng.integers(0, n_solid[q] + 1), replace=False))
            for r in range(k) for q in range(k) if q != r}
    widths = [3, 2][:layers]
    constant_layer0 = layers > 1
    dup = {q: np.zeros(n_solid[q], np.int64) for q in range(k)}
    for (r, q), rows in halo.items():
        dup[q][rows] += 1
    receivers, senders, offsets, mirrors = {}, {}, {}, {}
    cacheable = {}
    for r in range(k):
        owners = [q for q in range(k) if q != r]
        counts = [halo[(r, q)].size for q in owners]
        offsets[r] = dict(zip(owners, np.concatenate([[0], np.cumsum(counts)])[:-1]))
        hdup = np.concatenate([dup[q][halo[(r, q)]] for q in owners])
        tier, slot = admission(hdup, row_bytes=4 * sum(widths), budget_bytes=budget_rows * 4 * sum(widths),
                               device_bytes=(budget_rows // 2) * 4 * sum(widths))
        receivers[r] = ReceiverCache(tier, slot, widths)
        mirrors[r] = RefreshSchedule(tier != TIER_NONE, layers)    # the receiver's copy of the schedule
        for q in owners:
            o = offsets[r][q]
            cacheable[(q, r)] = tier[o:o + halo[(r, q)].size] != TIER_NONE
    for q in range(k):   # the owner's send list: receivers in rank order
        dests = [r for r in range(k) if r != q]
        senders[q] = (dests, RefreshSchedule(np.concatenate([cacheable[(q, r)] for r in dests]), layers))
    history = {}   # (q, layer, epoch) -> owner rows
    ref_cache = {(r, l): {} for r in range(k) for l in range(layers)}   # independent reference
    queue = {}     # (r, layer, epoch used) -> list of (source, positions, rows, epoch sent)
    expect = {}    # (r, layer, epoch used) -> halo positions the receiver's schedule expects
    checked = 0
    for t in range(1, epochs + 1):
        for l in range(layers):
            const = constant_layer0 and l == 0
            for q in range(k):
                history[(q, l, t)] = (history[(q, l, 1)] if const and t > 1
                                      else rng.standard_normal((n_solid[q], widths[l])).astype(np.float32))
            first = t == 1 or const
            this_lag = 0 if first else lag
            for r in range(k):
                expect[(r, l, t + this_lag)] = np.flatnonzero(mirrors[r].select(l, t, staleness, this_lag, const))
                if first and lag == 1 and not const:
                    expect[(r, l, t + 1)] = np.flatnonzero(mirrors[r].select(l, t, staleness, 1, False))
            for q in range(k):
                dests, st = senders[q]
                mask = st.select(l, t, staleness, this_lag, const)
                off = 0
                for r in dests:
                    n = halo[(r, q)].size
                    m = mask[off:off + n]
                    pos = np.flatnonzero(m)
                    rows = history[(q, l, t)][halo[(r, q)][pos]]
                    queue.setdefault((r, l, t + this_lag), []).append((q, pos, rows, t))
                    off += n
                if first and lag == 1 and not const:     # the pipeline starts after the blocking fetch
                    mask = st.select(l, t, staleness, 1, False)
                    off = 0
                    for r in dests:
                        n = halo[(r, q)].size
                        pos = np.flatnonzero(mask[off:off + n])
                        queue.setdefault((r, l, t + 1), []).append(
                            (q, pos, history[(q, l, t)][halo[(r, q)][pos]], t))
                        off += n
            for r in range(k):
                msgs = queue.pop((r, l, t), [])
                rng.shuffle(msgs)            # peers' messages complete in any order
                sent_epochs = {m[3] for m in msgs}
                assert len(sent_epochs) <= 1
                t_sent = sent_epochs.pop() if sent_epochs else t - this_lag
                sent_pos = np.concatenate([offsets[r][q] + pos for q, pos, _, _ in msgs]).astype(np.int64) \
                    if msgs else np.zeros(0, np.int64)
                # the rows alone travel; the receiver's schedule names their positions (rows
                # arrive ordered by owner, as the capped exchange delivers them)
                positions = expect.pop((r, l, t))
                assert np.array_equal(np.sort(sent_pos), positions)
                msgs.sort(key=lambda m: m[0])
                rows = np.concatenate([rw for _, _, rw, _ in msgs]) if msgs else np.zeros((0, widths[l]), np.float32)
                perm = rng.permutation(positions.size)   # and rows of a message in any order
                positions, rows = positions[perm], rows[perm]
                block, ages, _, _ = receivers[r].assemble(l, t, t_sent, positions, rows,
                                                          staleness, constant=const)
                # reference: fresh rows where sent, else the last value received for the row
                rc = ref_cache[(r, l)]
                ref = np.full_like(block, np.nan)
                ref[positions] = rows
                for p in np.setdiff1d(np.arange(block.shape[0]), positions):
                    ref[p] = rc[p][0]       # KeyError: a row neither sent nor cached was used
                for p, row in zip(positions, rows):
                    if receivers[r].tier[p] != TIER_NONE:
                        rc[p] = (row, t_sent)
                    else:
                        rc.pop(p, None)
                assert np.array_equal(block, ref)
                # every row is its owner's value of epoch t - age, and age <= S
                assert ages.size == 0 or ages.max() <= (0 if const else staleness)
                for q in (q for q in range(k) if q != r):
                    o, hr = offsets[r][q], halo[(r, q)]
                    a_q = ages[o:o + hr.size]
                    for age in np.unique(a_q):
                        sel = np.flatnonzero(a_q == age)
                        src_epoch = t if const else t - int(age)
                        assert np.array_equal(block[o + sel], history[(q, l, src_epoch)][hr[sel]])
                    checked += hr.size
    return checked, receivers


@pytest.mark.parametrize("staleness,lag", [(0, 0), (1, 0), (2, 0), (4, 0), (1, 1), (2, 1), (4, 1)])
def test_protocol_reconstructs_sent_union_cached_under_delays(staleness, lag):
    checked, receivers = _simulate(k=4, staleness=staleness, lag=lag, budget_rows=25, epochs=9,
                                   layers=2, seed=11 + staleness + 10 * lag)
    assert checked > 500
    # the cache was used: some hidden-layer rows were read from it (S >= 1)
    if staleness >= 1:
        assert any((r.written[1] != np.iinfo(np.int64).min // 4).any() for r in receivers.values())


def test_receiver_refuses_a_row_neither_sent_nor_cached_and_a_row_too_old():
    rc = ReceiverCache(np.array([TIER_DEVICE, TIER_NONE], np.int8), np.array([0, -1]), [2])
    with pytest.raises(RuntimeError, match="neither received nor cached"):
        rc.assemble(0, 1, 1, np.array([1]), np.ones((1, 2), np.float32), staleness=1)
    rc.assemble(0, 1, 1, np.array([0, 1]), np.ones((2, 2), np.float32), staleness=1)
    rc.assemble(0, 2, 2, np.array([1]), np.ones((1, 2), np.float32), staleness=1)
    with pytest.raises(RuntimeError, match="staleness bound 1"):
        rc.assemble(0, 3, 3, np.array([1]), np.ones((1, 2), np.float32), staleness=1)


def test_sender_resends_exactly_when_the_copy_would_be_too_old():
    st = RefreshSchedule(np.array([True, False]), 1)
    sent = [st.select(0, t, staleness=2, lag=0, constant=False).tolist() for t in range(1, 8)]
    assert sent == [[True, True], [False, True], [False, True], [True, True], [False, True],
                    [False, True], [True, True]]
    st = RefreshSchedule(np.array([True, False]), 1)
    sent = [st.select(0, t, staleness=2, lag=1, constant=False).tolist() for t in range(1, 6)]
    assert sent == [[True, True], [False, True], [True, True], [False, True], [True, True]]
    st = RefreshSchedule(np.array([True, False]), 1)
    sent = [st.select(0, t, staleness=0, lag=0, constant=True).tolist() for t in range(1, 4)]
    assert sent == [[True, True], [False, True], [False, True]]


def test_device_assembly_equals_host_and_keeps_device_tier_rows_on_the_device():
    # 10 halo rows: 3 device tier, 3 host tier, 4 never cached; width 3 (12 bytes a row)
    tier = np.array([1, 2, 0, 1, 2, 0, 1, 2, 0, 0], np.int8)
    slot = np.array([0, 0, -1, 1, 1, -1, 2, 2, -1, -1])
    rb, w = 12, 3
    rng = np.random.default_rng(5)
    caches = {name: ReceiverCache(tier, slot, [w]) for name in ("host", "dev-hostplane", "dev-deviceplane")}
    n_dev, n_host, n_none = 3, 3, 4
    for t in (1, 2, 3):
        # epoch 1 sends every row, later epochs the uncached rows and one device-tier row (6)
        positions = np.arange(10) if t == 1 else np.array([8, 2, 6, 5, 9])
        rows = rng.standard_normal((positions.size, w)).astype(np.float32)
        ref, ages, hd, hh = caches["host"].assemble(0, t, t, positions, rows, staleness=2)
        assert hd + hh + positions.size == 10
        for name, rows_host in (("dev-hostplane", True), ("dev-deviceplane", False)):
            before = dict(caches[name].transfers)
            block, a2, hd2, hh2 = caches[name].assemble_tensor(
                0, t, t, positions, torch.from_numpy(rows), staleness=2, on_device=True, rows_host=rows_host)
            moved = {k: v - before[k] for k, v in caches[name].transfers.items()}
            assert torch.equal(block, torch.from_numpy(ref)) and np.array_equal(a2, ages)
            assert (hd2, hh2) == (hd, hh)
            fresh_host = int((tier[positions] == TIER_HOST).sum())
            if rows_host:    # mpi4py / gloo: fresh rows and host-tier hits are uploaded, nothing else
                assert moved == {"h2d": (positions.size + hh) * rb, "d2h": 0}
            else:            # nccl: only host-tier hits come up; fresh host-tier rows go down
                assert moved == {"h2d": hh * rb, "d2h": fresh_host * rb}
            if t > 1:
                assert hd == n_dev - 1 and hh == n_host   # device-tier hits really happened
    # the host path reads the device tier back instead
    c = ReceiverCache(tier, slot, [w])
    c.assemble(0, 1, 1, np.arange(10), np.ones((10, w), np.float32), staleness=1)
    assert c.transfers == {"h2d": n_dev * rb, "d2h": 0}     # the fresh device-tier rows went up
    _, _, hd, hh = c.assemble(0, 2, 2, np.array([2, 5, 8, 9]), np.zeros((n_none, w), np.float32), staleness=1)
    assert (hd, hh) == (n_dev, n_host) and c.transfers == {"h2d": n_dev * rb, "d2h": n_dev * rb}
    assert torch.equal(c.dev[0], torch.ones((n_dev, w)))


DEVICE_PATH_SCRIPT = r'''
import json, sys
import numpy as np, torch
from mpi4py import MPI
sys.path.insert(0, sys.argv[2])
from planes import close_planes, data_plane
from hpcgnn.comm.halo import HaloPlan
from hpcgnn.comm.halo_cached import CacheSettings, CachedHalo

world = MPI.COMM_WORLD
r, k = world.Get_rank(), world.Get_size()
torch.set_num_threads(1)
rng = np.random.default_rng(7)                 # the same plan on every rank
n_solid = [40, 31]
sends = {(q, p): np.sort(rng.choice(n_solid[q], 8 + 5 * q + 3 * p, replace=False))
         for q in range(k) for p in range(k) if p != q}
send_index = np.concatenate([sends[(r, p)] for p in range(k) if p != r]).astype(np.int64)
send_counts = np.array([0 if p == r else sends[(r, p)].size for p in range(k)], np.int64)
recv_counts = np.array([0 if q == r else sends[(q, r)].size for q in range(k)], np.int64)
plan = HaloPlan(n_solid[r], int(recv_counts.sum()), send_index, send_counts, recv_counts)
widths = [5, 4]
res = {}
for backend in ("mpi4py", "gloo"):
    comm = data_plane(backend)
    for name, st in {"S2-pipe": CacheSettings(True, 2, True, budget_bytes=(plan.num_halo * 2 // 3) * 4 * 9,
                                              device_bytes=(plan.num_halo // 3) * 4 * 9),
                     "S1-bf16": CacheSettings(True, 1, False, budget_bytes=(plan.num_halo // 2) * 4 * 9,
                                              device_bytes=(plan.num_halo // 4) * 4 * 9, precision="bf16")}.items():
        host, dev = CachedHalo(comm, plan, st, widths), CachedHalo(comm, plan, st, widths)
        same, reps, grads_same = True, [], True
        for t in range(1, 6):
            host.begin_epoch(t)
            dev.begin_epoch(t)
            for layer, w in enumerate(widths):
                x = np.random.default_rng(100 * t + layer + 10 * r).standard_normal((plan.num_solid, w)).astype(np.float32)
                if layer == 0:
                    x = np.random.default_rng(10 * r).standard_normal((plan.num_solid, w)).astype(np.float32)
                a = host.fetch(layer, x)
                b = dev.fetch_tensor(layer, torch.from_numpy(x))
                same = same and a.tobytes() == b.numpy().tobytes()
                g = np.random.default_rng(7 * t + layer).standard_normal((plan.num_halo, w)).astype(np.float32)
                grads_same = grads_same and host.adjoint(layer, g).tobytes() == \
                    dev.adjoint_tensor(layer, torch.from_numpy(g)).numpy().tobytes()
            reps.append([{kk: {n: (v.tolist() if hasattr(v, "tolist") else v) for n, v in rep.items()}
                          for kk, rep in zip(("counters", "per_layer"), p.epoch_report())} for p in (host, dev)])
        with host.exact_mode(), dev.exact_mode():
            ev = host.fetch(1, x[:, :4]).tobytes() == dev.fetch_tensor(1, torch.from_numpy(x[:, :4])).numpy().tobytes()
        host.close()
        dev.close()
        res[f"{backend}/{name}"] = dict(same=same, grads_same=grads_same, eval_same=ev, reps=reps)
close_planes()
res = world.gather(res, root=0)
if r == 0:
    json.dump(res, open(sys.argv[1], "w"))
'''


def test_fetch_tensor_equals_fetch_and_uploads_only_host_tier_and_fresh_rows(tmp_path):
    script = tmp_path / "devpath.py"
    script.write_text(DEVICE_PATH_SCRIPT)
    out = tmp_path / "out.json"
    proc = run_mpi(2, [script, out, Path(__file__).resolve().parent], timeout=180)
    assert proc.returncode == 0, proc.stderr
    res = json.loads(out.read_text())
    hits_dev = 0
    for per_rank in res:
        assert len(per_rank) == 4
        for case, r in per_rank.items():
            assert r["same"] and r["grads_same"] and r["eval_same"], case
            for h, d in r["reps"]:
                hc, hp, dc, dp = h["counters"], h["per_layer"], d["counters"], d["per_layer"]
                assert hp == dp, case                                 # ages, hits, rows, bytes: identical
                assert {n: v for n, v in hc.items() if n not in ("halo_h2d_bytes", "halo_d2h_bytes")} == \
                    {n: v for n, v in dc.items() if n not in ("halo_h2d_bytes", "halo_d2h_bytes")}, case
                row_bytes = 4 * np.array([5, 4])
                used = np.array(dp["halo_rows_received"]) + np.array(dp["halo_hits_host"])
                # the device path uploads the fresh rows (host data plane) and the host-tier hits
                # only: device-tier hits never cross; it downloads just the rows it sends
                assert dc["halo_h2d_bytes"] == float((used * row_bytes).sum()), case
                payload = np.array(dp["halo_fwd_bytes"])                # rows only: no positions
                assert dc["halo_d2h_bytes"] == float(payload.sum()), case
                # the host path reads every device-tier hit back
                assert hc["halo_d2h_bytes"] == float((np.array(hp["halo_hits_device"]) * row_bytes).sum()), case
                hits_dev += sum(dp["halo_hits_device"])
        assert per_rank["mpi4py/S2-pipe"] == per_rank["gloo/S2-pipe"]
        assert per_rank["mpi4py/S1-bf16"] == per_rank["gloo/S1-bf16"]
    assert hits_dev > 0        # the device tier was used
