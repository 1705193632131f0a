"""The halo cache's admission and its sender/receiver protocol, without MPI: K simulated ranks
exchange messages (rows + positions) delivered in a random order, late within the pipeline's
window; every assembled halo block equals the block built independently from (rows sent) U
(rows cached), every row's value is its owner's value of epoch t - age, and age <= S."""
from __future__ import annotations

import numpy as np
import pytest

from hpcgnn.cache.halo import TIER_DEVICE, TIER_HOST, TIER_NONE, ReceiverCache, admission
from hpcgnn.comm.halo_cached import SenderState


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
    receivers, senders, offsets = {}, {}, {}
    cacheable = {}
    for r in range(k):
        owners = [q for q in range(k) if q != r]
        counts = [halo[(r, q)].size for q in owners]
        offsets[r] = dict(zip(owners, np.concatenate([[0], np.cumsum(counts)])[:-1]))
        hdup = np.concatenate([dup[q][halo[(r, q)]] for q in owners])
        tier, slot = admission(hdup, row_bytes=4 * sum(widths), budget_bytes=budget_rows * 4 * sum(widths),
                               device_bytes=(budget_rows // 2) * 4 * sum(widths))
        receivers[r] = ReceiverCache(tier, slot, widths)
        for q in owners:
            o = offsets[r][q]
            cacheable[(q, r)] = tier[o:o + halo[(r, q)].size] != TIER_NONE
    for q in range(k):   # the owner's send list: receivers in rank order
        dests = [r for r in range(k) if r != q]
        senders[q] = (dests, SenderState(np.concatenate([cacheable[(q, r)] for r in dests]), layers))
    history = {}   # (q, layer, epoch) -> owner rows
    ref_cache = {(r, l): {} for r in range(k) for l in range(layers)}   # independent reference
    queue = {}     # (r, layer, epoch used) -> list of (source, positions, rows, epoch sent)
    checked = 0
    for t in range(1, epochs + 1):
        for l in range(layers):
            const = constant_layer0 and l == 0
            for q in range(k):
                history[(q, l, t)] = (history[(q, l, 1)] if const and t > 1
                                      else rng.standard_normal((n_solid[q], widths[l])).astype(np.float32))
            first = t == 1 or const
            this_lag = 0 if first else lag
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
                positions = np.concatenate([offsets[r][q] + pos for q, pos, _, _ in msgs]).astype(np.int64) \
                    if msgs else np.zeros(0, np.int64)
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
    st = SenderState(np.array([True, False]), 1)
    sent = [st.select(0, t, staleness=2, lag=0, constant=False).tolist() for t in range(1, 8)]
    assert sent == [[True, True], [False, True], [False, True], [True, True], [False, True],
                    [False, True], [True, True]]
    st = SenderState(np.array([True, False]), 1)
    sent = [st.select(0, t, staleness=2, lag=1, constant=False).tolist() for t in range(1, 6)]
    assert sent == [[True, True], [False, True], [True, True], [False, True], [True, True]]
    st = SenderState(np.array([True, False]), 1)
    sent = [st.select(0, t, staleness=0, lag=0, constant=True).tolist() for t in range(1, 4)]
    assert sent == [[True, True], [False, True], [False, True]]
