// partition kernels: cut one partition out of a renumbered graph (see docs/formats.md).
//
// The graph is the symmetric in-edge CSR of the graph file (original IDs); its
// `indices` may be int64 or int32 (the partition command reads them as int32 when the
// graph fits, to halve their memory). Partition p owns the new (global) IDs
// [part_offsets[p], part_offsets[p+1]); `rows` lists the original IDs of those vertices
// in new-ID order and `orig_to_new` maps every original ID to its new ID. Outputs are
// int64 whatever the input's index type.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "common.h"

namespace {

using hpcgnn::carray;
using hpcgnn::require;

// Owner partition of a new ID: the last p with offsets[p] <= id.
inline int64_t owner_of(const int64_t* offsets, int64_t k, int64_t id) {
    return static_cast<int64_t>(std::upper_bound(offsets, offsets + k + 1, id) - offsets) - 1;
}

// One partition's data (all IDs are new/global IDs):
//   indptr  [n+1], indices [E_p]  in-edge CSR of the solid vertices, sources sorted per row
//   halo_ids                      sorted unique sources owned by another partition
//   send_indptr [K+1], send_ids   per partition q: sorted solid vertices with an in-neighbour on q
//                                 (by symmetry exactly the halo vertices of q that p owns)
//   cut_entries                   number of in-edges whose source is owned elsewhere
template <typename Idx>
py::tuple extract_part(const carray<int64_t>& indptr, const carray<Idx>& indices,
                       const carray<int64_t>& rows, const carray<int64_t>& orig_to_new,
                       const carray<int64_t>& part_offsets, int64_t part_id) {
    const int64_t num_nodes = indptr.size() - 1;
    const int64_t k = part_offsets.size() - 1;
    require(num_nodes >= 0 && orig_to_new.size() == num_nodes,
            "extract_part: orig_to_new must have one entry per vertex");
    require(k >= 1 && part_id >= 0 && part_id < k, "extract_part: part_id out of range");
    const int64_t* ip = indptr.data();
    const Idx* ix = indices.data();
    const int64_t* rw = rows.data();
    const int64_t* o2n = orig_to_new.data();
    const int64_t* off = part_offsets.data();
    const int64_t begin = off[part_id], end = off[part_id + 1];
    const int64_t n = rows.size();
    require(end - begin == n, "extract_part: rows length differs from the partition's ID range");
    require(ip[num_nodes] == indices.size(), "extract_part: indptr[-1] differs from len(indices)");
    for (int64_t i = 0; i < n; ++i) {
        require(rw[i] >= 0 && rw[i] < num_nodes && o2n[rw[i]] == begin + i,
                "extract_part: rows and orig_to_new disagree");
    }

    carray<int64_t> out_indptr = hpcgnn::new_array<int64_t>(n + 1);
    int64_t* op = out_indptr.mutable_data();
    op[0] = 0;
    for (int64_t i = 0; i < n; ++i) op[i + 1] = op[i] + (ip[rw[i] + 1] - ip[rw[i]]);
    const int64_t e_p = op[n];
    carray<int64_t> out_indices = hpcgnn::new_array<int64_t>(e_p);
    int64_t* oi = out_indices.mutable_data();

    std::vector<int64_t> cut_count(n + 1, 0), owner_count(n + 1, 0);
    std::vector<uint8_t> mark(num_nodes, 0);
    std::vector<int64_t> pairs_q, pairs_v, halo;
    carray<int64_t> send_indptr = hpcgnn::new_array<int64_t>(k + 1);
    int64_t* si = send_indptr.mutable_data();
    {
        py::gil_scoped_release nogil;
        // Pass 1: relabel and sort each row; count sources owned elsewhere and their distinct
        // owners (a sorted row meets the partitions' ID ranges in increasing order).
#pragma omp parallel for schedule(dynamic, 1024)
        for (int64_t i = 0; i < n; ++i) {
            const int64_t s = ip[rw[i]], len = ip[rw[i] + 1] - s;
            int64_t* dst = oi + op[i];
            for (int64_t j = 0; j < len; ++j) dst[j] = o2n[ix[s + j]];
            std::sort(dst, dst + len);
            int64_t outside = 0, owners = 0, hi = -1;  // hi: end of the current owner's range
            for (int64_t j = 0; j < len; ++j) {
                const int64_t u = dst[j];
                if (u >= begin && u < end) continue;
                ++outside;
                if (u >= hi) {
                    hi = off[owner_of(off, k, u) + 1];
                    ++owners;
                }
            }
            cut_count[i + 1] = outside;
            owner_count[i + 1] = owners;
        }
        for (int64_t i = 0; i < n; ++i) owner_count[i + 1] += owner_count[i];
        const int64_t n_pairs = owner_count[n];
        pairs_q.resize(n_pairs);
        pairs_v.resize(n_pairs);
        // Pass 2: mark halo sources; list (owner q, solid vertex) pairs in row order.
#pragma omp parallel for schedule(dynamic, 1024)
        for (int64_t i = 0; i < n; ++i) {
            int64_t pos = owner_count[i], hi = -1;
            for (int64_t j = op[i]; j < op[i + 1]; ++j) {
                const int64_t u = oi[j];
                if (u >= begin && u < end) continue;
                __atomic_store_n(&mark[u], uint8_t(1), __ATOMIC_RELAXED);
                if (u >= hi) {
                    const int64_t q = owner_of(off, k, u);
                    hi = off[q + 1];
                    pairs_q[pos] = q;
                    pairs_v[pos] = begin + i;
                    ++pos;
                }
            }
        }
        // Halo: marked IDs in increasing order (chunked parallel scan of the marker).
        const int nt = omp_get_max_threads();
        std::vector<int64_t> chunk_count(nt + 1, 0);
#pragma omp parallel num_threads(nt)
        {
            const int t = omp_get_thread_num(), tn = omp_get_num_threads();
            const int64_t lo = num_nodes * t / tn, up = num_nodes * (t + 1) / tn;
            int64_t c = 0;
            for (int64_t v = lo; v < up; ++v) c += mark[v];
            chunk_count[t + 1] = c;
#pragma omp barrier
#pragma omp single
            {
                for (int u = 0; u < tn; ++u) chunk_count[u + 1] += chunk_count[u];
                halo.resize(chunk_count[tn]);
            }
            int64_t pos = chunk_count[t];
            for (int64_t v = lo; v < up; ++v)
                if (mark[v]) halo[pos++] = v;
        }
        // Send lists: stable counting sort of the pairs by destination partition.
        std::fill(si, si + k + 1, 0);
        for (int64_t t = 0; t < n_pairs; ++t) si[pairs_q[t] + 1] += 1;
        for (int64_t q = 0; q < k; ++q) si[q + 1] += si[q];
    }
    const int64_t n_cut = [&] {
        int64_t c = 0;
        for (int64_t i = 1; i <= n; ++i) c += cut_count[i];
        return c;
    }();
    carray<int64_t> send_ids = hpcgnn::new_array<int64_t>(static_cast<int64_t>(pairs_q.size()));
    {
        int64_t* sv = send_ids.mutable_data();
        std::vector<int64_t> fill(si, si + k);
        for (size_t t = 0; t < pairs_q.size(); ++t) sv[fill[pairs_q[t]]++] = pairs_v[t];
    }
    return py::make_tuple(out_indptr, out_indices, hpcgnn::from_vector(std::move(halo)), send_indptr,
                          send_ids, n_cut);
}

}  // namespace

PYBIND11_MODULE(_native_partition, m) {
    hpcgnn::add_thread_control(m);
    const char* doc =
        "Cut partition part_id out of a renumbered symmetric in-edge CSR (indices int64 or int32).\n\n"
        "Returns (indptr, indices, halo_ids, send_indptr, send_ids, cut_entries), all int64; every ID\n"
        "is a new (global) ID, see native/partition.cpp.";
    m.def("extract_part", &extract_part<int64_t>, py::arg("indptr"), py::arg("indices"), py::arg("rows"),
          py::arg("orig_to_new"), py::arg("part_offsets"), py::arg("part_id"), doc);
    m.def("extract_part", &extract_part<int32_t>, py::arg("indptr"), py::arg("indices"), py::arg("rows"),
          py::arg("orig_to_new"), py::arg("part_offsets"), py::arg("part_id"), doc);
}
