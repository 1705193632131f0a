// Graph construction kernels: symmetric in-edge CSR from raw edge lists.
//
// symmetric_csr(src, dst, n)     one shot, from two int64 arrays
// EdgeAccumulator(n, reserve)    streaming: add(src, dst) chunk by chunk, then finish()
//
// Both return (indptr int64 [n+1], indices int64 [E], self_loops_removed,
// duplicates_removed): every edge u-v is stored in both directions, rows are
// sorted, self-loops and duplicates are dropped. The counts are directed
// edges after symmetrisation (a self-loop counts 2), as in the numpy reference
// of hpcgnn.data.clean. The result does not depend on the thread count.
//
// Memory: the CSR is built in one malloc'd buffer of 2 x (non-loop edges)
// int64 that is compacted in place and shrunk; the accumulator keeps its raw
// edges as uint32 pairs while n < 2^32 (8 bytes per edge) and frees them
// before the rows are sorted. Peak for m edges: 8m (raw) + 16m (buffer) + 16n.
#include "common.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>

namespace {

using hpcgnn::carray;

// A numpy array that owns (and frees) a malloc'd buffer.
py::array_t<int64_t> wrap_malloc(int64_t* data, int64_t n) {
    if (data == nullptr) data = static_cast<int64_t*>(std::malloc(sizeof(int64_t)));
    py::capsule owner(data, [](void* p) { std::free(p); });
    return py::array_t<int64_t>({static_cast<py::ssize_t>(n)}, {sizeof(int64_t)}, data, owner);
}

// Position of the first ID outside [0, n), or -1. Parallel, deterministic.
template <typename T>
int64_t first_out_of_range(const T* a, int64_t m, int64_t n) {
    int64_t first = std::numeric_limits<int64_t>::max();
#pragma omp parallel for schedule(static) reduction(min : first)
    for (int64_t i = 0; i < m; ++i) {
        const int64_t v = static_cast<int64_t>(a[i]);
        if ((v < 0 || v >= n) && i < first) first = i;
    }
    return first == std::numeric_limits<int64_t>::max() ? -1 : first;
}

void check_ids(const int64_t* src, const int64_t* dst, int64_t m, int64_t n) {
    const char* names[2] = {"source", "destination"};
    const int64_t* arrays[2] = {src, dst};
    for (int k = 0; k < 2; ++k) {
        const int64_t at = first_out_of_range(arrays[k], m, n);
        if (at >= 0)
            throw std::invalid_argument(std::string(names[k]) + " vertex ID " +
                                        std::to_string(arrays[k][at]) + " (edge " + std::to_string(at) +
                                        ") is out of range, expected [0, " + std::to_string(n) + ")");
    }
}

struct Csr {
    std::vector<int64_t> indptr;
    int64_t* indices = nullptr;  // malloc'd, indptr.back() entries
    int64_t loops = 0;           // undirected self-loops seen
    int64_t kept = 0;            // undirected non-loop edges seen
};

// Build the symmetric CSR of edges (src[i], dst[i]), i < m. IDs must already be
// valid. ``release_input`` is called once the edges have been scattered, so a
// caller can free them before the (memory-neutral) sort phase.
template <typename T>
Csr build_csr(const T* src, const T* dst, int64_t m, int64_t n, const std::function<void()>& release_input) {
    Csr out;
    out.indptr.assign(static_cast<size_t>(n) + 1, 0);
    int64_t* deg = out.indptr.data() + 1;
    int64_t loops = 0;
#pragma omp parallel for schedule(static) reduction(+ : loops)
    for (int64_t i = 0; i < m; ++i) {
        const int64_t s = static_cast<int64_t>(src[i]), d = static_cast<int64_t>(dst[i]);
        if (s == d) {
            ++loops;
            continue;
        }
        __atomic_fetch_add(&deg[s], 1, __ATOMIC_RELAXED);
        __atomic_fetch_add(&deg[d], 1, __ATOMIC_RELAXED);
    }
    out.loops = loops;
    out.kept = m - loops;
    for (int64_t v = 0; v < n; ++v) out.indptr[v + 1] += out.indptr[v];
    const int64_t total = out.indptr[n];

    const size_t bytes = sizeof(int64_t) * static_cast<size_t>(std::max<int64_t>(total, 1));
    int64_t* idx = static_cast<int64_t*>(std::malloc(bytes));
    if (idx == nullptr) throw std::bad_alloc();
    std::vector<int64_t> cursor(out.indptr.begin(), out.indptr.end() - 1);
    int64_t* cur = cursor.data();
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < m; ++i) {
        const int64_t s = static_cast<int64_t>(src[i]), d = static_cast<int64_t>(dst[i]);
        if (s == d) continue;
        idx[__atomic_fetch_add(&cur[d], 1, __ATOMIC_RELAXED)] = s;
        idx[__atomic_fetch_add(&cur[s], 1, __ATOMIC_RELAXED)] = d;
    }
    std::vector<int64_t>().swap(cursor);
    release_input();

    // Sort and dedupe every row; row lengths shrink in place.
    std::vector<int64_t> newlen(static_cast<size_t>(n));
    const int64_t* ip = out.indptr.data();
#pragma omp parallel for schedule(dynamic, 512)
    for (int64_t v = 0; v < n; ++v) {
        int64_t* b = idx + ip[v];
        int64_t* e = idx + ip[v + 1];
        std::sort(b, e);
        newlen[v] = std::unique(b, e) - b;
    }
    // Compact left (sequential: a row's new start never passes its old start).
    int64_t pos = 0;
    for (int64_t v = 0; v < n; ++v) {
        const int64_t from = out.indptr[v], len = newlen[v];
        if (pos != from && len) std::memmove(idx + pos, idx + from, sizeof(int64_t) * static_cast<size_t>(len));
        out.indptr[v] = pos;
        pos += len;
    }
    out.indptr[n] = pos;
    if (pos < total) {
        void* shrunk = std::realloc(idx, sizeof(int64_t) * static_cast<size_t>(std::max<int64_t>(pos, 1)));
        if (shrunk != nullptr) idx = static_cast<int64_t*>(shrunk);
    }
    out.indices = idx;
    return out;
}

py::tuple to_python(Csr&& csr) {
    const int64_t nnz = csr.indptr.back();
    const int64_t dups = 2 * csr.kept - nnz;
    auto indptr = hpcgnn::from_vector(std::move(csr.indptr));
    auto indices = wrap_malloc(csr.indices, nnz);
    return py::make_tuple(indptr, indices, 2 * csr.loops, dups);
}

py::tuple symmetric_csr(const carray<int64_t>& src, const carray<int64_t>& dst, int64_t num_nodes) {
    hpcgnn::require(num_nodes >= 0, "num_nodes must be >= 0");
    hpcgnn::require(src.ndim() == 1 && dst.ndim() == 1, "src and dst must be 1-D");
    hpcgnn::require(src.shape(0) == dst.shape(0), "src and dst must have the same length");
    const int64_t m = src.shape(0);
    const int64_t* s = src.data();
    const int64_t* d = dst.data();
    Csr csr;
    {
        py::gil_scoped_release nogil;
        check_ids(s, d, m, num_nodes);
        csr = build_csr<int64_t>(s, d, m, num_nodes, [] {});
    }
    return to_python(std::move(csr));
}

// Streaming edge collection: chunks are validated and appended (self-loops
// are counted and dropped at once); finish() builds the CSR and frees the raw
// edges. IDs are stored as uint32 while num_nodes <= 2^32.
class EdgeAccumulator {
public:
    EdgeAccumulator(int64_t num_nodes, int64_t reserve) : n_(num_nodes), narrow_(num_nodes <= (int64_t(1) << 32)) {
        hpcgnn::require(num_nodes >= 0, "num_nodes must be >= 0");
        hpcgnn::require(reserve >= 0, "reserve must be >= 0");
        if (narrow_) {
            s32_.reserve(static_cast<size_t>(reserve));
            d32_.reserve(static_cast<size_t>(reserve));
        } else {
            s64_.reserve(static_cast<size_t>(reserve));
            d64_.reserve(static_cast<size_t>(reserve));
        }
    }

    void add(const carray<int64_t>& src, const carray<int64_t>& dst) {
        hpcgnn::require(!finished_, "EdgeAccumulator.add after finish()");
        hpcgnn::require(src.ndim() == 1 && dst.ndim() == 1, "src and dst must be 1-D");
        hpcgnn::require(src.shape(0) == dst.shape(0), "src and dst must have the same length");
        const int64_t m = src.shape(0);
        const int64_t* s = src.data();
        const int64_t* d = dst.data();
        py::gil_scoped_release nogil;
        check_ids(s, d, m, n_);
        if (narrow_)
            append(s, d, m, s32_, d32_);
        else
            append(s, d, m, s64_, d64_);
        added_ += m;
    }

    py::tuple finish() {
        hpcgnn::require(!finished_, "EdgeAccumulator.finish() called twice");
        finished_ = true;
        Csr csr;
        {
            py::gil_scoped_release nogil;
            if (narrow_) {
                csr = build_csr<uint32_t>(s32_.data(), d32_.data(), static_cast<int64_t>(s32_.size()), n_, [this] {
                    std::vector<uint32_t>().swap(s32_);
                    std::vector<uint32_t>().swap(d32_);
                });
            } else {
                csr = build_csr<int64_t>(s64_.data(), d64_.data(), static_cast<int64_t>(s64_.size()), n_, [this] {
                    std::vector<int64_t>().swap(s64_);
                    std::vector<int64_t>().swap(d64_);
                });
            }
        }
        csr.loops += loops_;
        return to_python(std::move(csr));
    }

    int64_t num_added() const { return added_; }
    int64_t num_nodes() const { return n_; }

private:
    template <typename T>
    void append(const int64_t* s, const int64_t* d, int64_t m, std::vector<T>& vs, std::vector<T>& vd) {
        const size_t base = vs.size();
        vs.resize(base + static_cast<size_t>(m));
        vd.resize(base + static_cast<size_t>(m));
        size_t k = base;
        for (int64_t i = 0; i < m; ++i) {
            if (s[i] == d[i]) {
                ++loops_;
                continue;
            }
            vs[k] = static_cast<T>(s[i]);
            vd[k] = static_cast<T>(d[i]);
            ++k;
        }
        vs.resize(k);
        vd.resize(k);
    }

    int64_t n_;
    bool narrow_;
    bool finished_ = false;
    int64_t added_ = 0;
    int64_t loops_ = 0;
    std::vector<uint32_t> s32_, d32_;
    std::vector<int64_t> s64_, d64_;
};

}  // namespace

PYBIND11_MODULE(_native_graph, m) {
    m.doc() = "Graph construction kernels (symmetric CSR with self-loop and duplicate removal).";
    hpcgnn::add_thread_control(m);
    m.def("symmetric_csr", &symmetric_csr, py::arg("src"), py::arg("dst"), py::arg("num_nodes"),
          "(indptr, indices, self_loops_removed, duplicates_removed) of the symmetrised edges src[i]-dst[i]; "
          "int64 inputs; raises ValueError naming the first ID outside [0, num_nodes).");
    py::class_<EdgeAccumulator>(m, "EdgeAccumulator",
                                "Collect edges chunk by chunk, then finish() into a symmetric CSR.")
        .def(py::init<int64_t, int64_t>(), py::arg("num_nodes"), py::arg("reserve") = 0)
        .def("add", &EdgeAccumulator::add, py::arg("src"), py::arg("dst"),
             "Append edges src[i]-dst[i] (int64); raises ValueError on an ID outside [0, num_nodes).")
        .def("finish", &EdgeAccumulator::finish,
             "(indptr, indices, self_loops_removed, duplicates_removed); frees the collected edges.")
        .def_property_readonly("num_added", &EdgeAccumulator::num_added)
        .def_property_readonly("num_nodes", &EdgeAccumulator::num_nodes);
}
