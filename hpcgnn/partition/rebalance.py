"""Repair pass: bring every balance constraint of an assignment within its limit by moving vertices.

A partitioner that balances one vertex weight (KaMinPar) leaves the other constraints wherever
the cut puts them. This pass moves vertices out of every part that is over a limit in some
constraint, in rounds, each round:

1. part weights ``W[c, p]``; a part is *over* when ``W[c, p] > limit[c]`` for some ``c``;
2. for the vertices of over parts (read in contiguous row blocks of at most ``block_edges``
   edges: never the whole CSR at once), their edges to their own part and the other part they
   have most edges to (ties: the lower part ID); a vertex without edges elsewhere targets the
   part with the most room;
3. candidates are the vertices whose weight is positive in a constraint their part is over;
   ``gain`` = edges to the target - edges to the own part (the cut shrinks by ``gain``);
4. per (source, target) pair, candidates in order of gain (then vertex ID) move while the
   target stays within every limit, until the source is down to halfway between the mean and
   its limit in each constraint it is over in (leaving room for what others must send it);
5. a part still over (every part with room is over in another constraint: what one combined
   weight leaves behind) exchanges vertices with a part that has room in its constraint
   (:func:`_swap`), chosen by weight, not by the cut.

A part within its limits only receives vertices up to its room, so a constraint that is within
its limit stays within it. Exchanges ignore the cut, so the pass suits what a partitioner leaves
over, not a start from scratch. It is deterministic: the same input gives the same output. It
stops when no part is over (or a round moves nothing, or after ``max_rounds``).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class RebalanceResult:
    part: np.ndarray        # int64 [N], the repaired assignment
    moved: int              # vertices moved
    rounds: int             # rounds run
    over: list              # constraint names still over their limit afterwards (empty: all within)


def balance_limits(totals: np.ndarray, max_weights: np.ndarray, num_parts: int, eps: float) -> np.ndarray:
    """int64 [ncon] largest allowed part weight of each constraint: ``(1 + eps) * total / K``,
    but at least ``ceil(total / K) + largest vertex weight`` (a bound every constraint can meet
    one vertex at a time)."""
    totals = np.asarray(totals, dtype=np.float64)
    mean = totals / num_parts
    return np.maximum(np.floor((1.0 + eps) * mean),
                      np.ceil(mean) + np.asarray(max_weights, dtype=np.float64)).astype(np.int64)


def _connectivity(indptr, indices, part, rows_mask, k, block_edges):
    """For the vertices where ``rows_mask`` is True: (vertex IDs, own-part edges, best other part
    or -1, edges to it), scanning contiguous row ranges of at most ``block_edges`` edges."""
    n = indptr.shape[0] - 1
    ids_out, own_out, best_out, cnt_out = [], [], [], []
    a = 0
    while a < n:
        b = int(np.searchsorted(indptr, indptr[a] + block_edges, side="right")) - 1
        b = min(max(b, a + 1), n)
        sel = np.flatnonzero(rows_mask[a:b]) + a
        if sel.size:
            e0, e1 = int(indptr[a]), int(indptr[b])
            nbr = np.asarray(indices[e0:e1], dtype=np.int64)
            deg = np.diff(indptr[a:b + 1])
            row = np.repeat(np.arange(a, b, dtype=np.int64), deg)
            keep = rows_mask[row]
            row, pu = row[keep], part[nbr[keep]]
            del nbr
            key = np.unique((row - a) * k + pu, return_counts=True)
            v, q, c = key[0] // k + a, key[0] % k, key[1]
            mine = q == part[v]
            own = np.zeros(b - a, dtype=np.int64)
            own[v[mine] - a] = c[mine]
            v, q, c = v[~mine], q[~mine], c[~mine]
            order = np.lexsort((q, -c, v))          # per vertex: most edges first, then lowest part
            v, q, c = v[order], q[order], c[order]
            first = np.ones(v.shape[0], dtype=bool)
            first[1:] = v[1:] != v[:-1]
            best = np.full(b - a, -1, dtype=np.int64)
            bcnt = np.zeros(b - a, dtype=np.int64)
            best[v[first] - a] = q[first]
            bcnt[v[first] - a] = c[first]
            ids_out.append(sel)
            own_out.append(own[sel - a])
            best_out.append(best[sel - a])
            cnt_out.append(bcnt[sel - a])
        a = b
    if not ids_out:
        z = np.zeros(0, dtype=np.int64)
        return z, z, z, z
    return tuple(np.concatenate(x) for x in (ids_out, own_out, best_out, cnt_out))


def _move(sel: np.ndarray, p: int, q: int, part, weights, W, limits, shed_to, tries: int = 8) -> int:
    """Move a prefix of the candidates ``sel`` (in order of preference) from part ``p`` to ``q``
    while ``q`` stays within ``limits``, until ``p`` is down to ``shed_to`` in each constraint it
    is over in; candidates that alone would not fit ``q`` are skipped. Updates ``part`` and ``W``
    in place; returns the count moved."""
    moved = 0
    over = W[:, p] > limits
    for _ in range(tries):
        need = np.where(over, W[:, p] - shed_to, 0)
        room = limits - W[:, q]
        if sel.size == 0 or not (need > 0).any():
            break
        w = weights[sel]
        helps = (w[:, need > 0] > 0).any(axis=1) & ((w == 0) | (w <= room[None, :])).all(axis=1)
        sel, w = sel[helps], w[helps]
        if sel.size == 0:
            break
        cum = np.cumsum(w, axis=0)
        fits = ((cum == 0) | (cum <= room[None, :])).all(axis=1)
        take = sel.size if fits.all() else int(np.argmin(fits))
        done = (cum[:take] >= need[None, :]).all(axis=1)
        if done.any():
            take = int(np.argmax(done)) + 1
        if take == 0:
            sel = sel[1:]
            continue
        part[sel[:take]] = q
        W[:, p] -= cum[take - 1]
        W[:, q] += cum[take - 1]
        moved += take
        sel = sel[take:]
    return moved


def _swap(p: int, q: int, c: int, part, weights, W, limits, shed_to) -> int:
    """Exchange vertices between ``p`` (over in constraint ``c``) and ``q``: a prefix of ``p``'s
    vertices heaviest in ``c`` (then in ID order) goes to ``q``, and a prefix of ``q``'s
    lightest in ``c`` comes back, as long as it carries the same weight in the other
    constraint ``p`` has least room in. The longest such exchange that lowers ``p``'s
    weight in ``c`` and leaves both parts within every limit they were within is made (the
    shortest that brings ``p`` down to ``shed_to[c]`` if there is one). Updates ``part`` and
    ``W``; returns the count of vertices moved."""
    vp = np.flatnonzero(part == p)
    vq = np.flatnonzero(part == q)
    if vp.size == 0 or vq.size == 0:
        return 0
    vp = vp[np.lexsort((vp, -weights[vp, c]))]     # heaviest in c first, then in ID order:
    vq = vq[np.lexsort((vq, weights[vq, c]))]      # typical weights in the other constraints
    cum_p = np.cumsum(weights[vp], axis=0)
    cum_q = np.cumsum(weights[vq], axis=0)
    others = [b for b in range(weights.shape[1]) if b != c]
    if others:
        room = (limits - W[:, p]) / np.maximum(limits, 1)
        b = min(others, key=lambda x: room[x])
        j = np.minimum(np.searchsorted(cum_q[:, b], cum_p[:, b], side="left"), vq.size - 1)
        back = np.where((cum_p[:, b] > 0)[:, None], cum_q[j], 0)
        j = np.where(cum_p[:, b] > 0, j + 1, 0)
    else:
        back, j = np.zeros_like(cum_p), np.zeros(vp.size, dtype=np.int64)
    D = back - cum_p                                   # change of p's weights per prefix of p
    cap_p = np.maximum(limits, W[:, p])                # never worse than now
    cap_q = np.maximum(limits, W[:, q])
    feasible = ((D[:, c] < 0) & (W[:, p] + D <= cap_p).all(axis=1) & (W[:, q] - D <= cap_q).all(axis=1))
    if not feasible.any():
        return 0
    reached = feasible & (W[c, p] + D[:, c] <= shed_to[c])
    i = int(np.argmax(reached)) if reached.any() else int(np.argmin(np.where(feasible, D[:, c], 0)))
    part[vp[:i + 1]] = q
    part[vq[:int(j[i])]] = p
    W[:, p] += D[i]
    W[:, q] -= D[i]
    return i + 1 + int(j[i])


def rebalance(indptr: np.ndarray, indices, part: np.ndarray, num_parts: int, weights: np.ndarray,
              limits: np.ndarray, names=None, max_rounds: int = 30,
              block_edges: int = 1 << 24) -> RebalanceResult:
    """Move vertices until no part's weight exceeds ``limits`` (see the module docstring).

    ``indptr`` int64 [N+1] and ``indices`` (an array or anything sliced like one: a memory map,
    an h5py dataset) are the symmetric CSR; ``weights`` int64 [N, ncon] the constraint weights;
    ``limits`` int64 [ncon] (:func:`balance_limits`); ``names`` the constraints' names (for
    :attr:`RebalanceResult.over`). ``part`` is not modified.
    """
    k = int(num_parts)
    part = np.array(part, dtype=np.int64, copy=True)
    weights = np.asarray(weights, dtype=np.int64)
    ncon = weights.shape[1]
    limits = np.asarray(limits, dtype=np.int64)
    names = list(names) if names is not None else [str(c) for c in range(ncon)]
    # a part over a limit sheds down to halfway between the mean and the limit, leaving room
    # for what other parts over other constraints must send it
    totals = weights.sum(axis=0)
    shed_to = np.minimum(limits, (limits + -(-totals // k)) // 2)
    moved, rounds = 0, 0
    for rounds in range(1, max_rounds + 1):
        W = np.stack([np.bincount(part, weights=weights[:, c], minlength=k).astype(np.int64)
                      for c in range(ncon)])                               # [ncon, K]
        excess = W - limits[:, None]
        over_parts = np.flatnonzero((excess > 0).any(axis=0))
        if over_parts.size == 0:
            return RebalanceResult(part, moved, rounds - 1, [])
        is_over = np.zeros(k, dtype=bool)
        is_over[over_parts] = True
        # a vertex helps when it weighs something in a constraint its part is over in
        helps = ((weights > 0) & (excess.T[part] > 0)).any(axis=1) & is_over[part]
        ids, own, best, bcnt = _connectivity(indptr, indices, part, helps, k, block_edges)
        if ids.size == 0:
            break
        room = (limits[:, None] - W) / np.maximum(limits[:, None], 1)      # relative room [ncon, K]
        spare = int(np.argmax(room.min(axis=0)))
        target = np.where(best >= 0, best, spare)
        gain = np.where(best >= 0, bcnt, 0) - own
        order = np.lexsort((ids, -gain))
        ids, target, own = ids[order], target[order], own[order]
        src = part[ids]
        moved_round = 0
        for p in over_parts[np.argsort(-(excess / np.maximum(limits[:, None], 1)).max(axis=0)[over_parts],
                                       kind="stable")]:      # the part most over first
            # first to the part each vertex has most edges to, then whatever is left to any part
            # with room (most room first), least-connected vertices first
            mine = src == p
            for q in range(k):
                if q != p:
                    moved_round += _move(ids[mine & (target == q)], p, q, part, weights, W, limits, shed_to)
            left = mine & (part[ids] == p)
            rest = ids[left][np.lexsort((ids[left], own[left]))]
            room_q = ((limits[:, None] - W) / np.maximum(limits[:, None], 1)).min(axis=0)
            for q in np.argsort(-room_q, kind="stable"):
                if q != p and rest.size:
                    moved_round += _move(rest, p, int(q), part, weights, W, limits, shed_to)
                    rest = rest[part[rest] == p]
        if (W > limits[:, None]).any():   # still over: parts with room are over elsewhere; exchange
            for p in over_parts:
                rel = (W[:, p] - limits) / np.maximum(limits, 1)
                if rel.max() <= 0:
                    continue
                c = int(np.argmax(rel))
                room_c = (limits[c] - W[c]) / max(int(limits[c]), 1)
                for q in np.argsort(-room_c, kind="stable"):
                    if q != p and room_c[q] > 0 and W[c, p] > limits[c]:
                        moved_round += _swap(p, int(q), c, part, weights, W, limits, shed_to)
        moved += moved_round
        if moved_round == 0:
            break
    W = np.stack([np.bincount(part, weights=weights[:, c], minlength=k) for c in range(ncon)])
    over = [names[c] for c in range(ncon) if (W[c] > limits[c]).any()]
    return RebalanceResult(part, moved, rounds, over)
