// Neighbour sampling kernels (DistGNN-MB SYNC_MBC): one synchronous, OpenMP-parallel
// sampler over a partition's local in-edge CSR, plus the degree-biased choice used by AEP.
// (Blocks are transposed by spmm.csr_transpose.)
//
// Randomness is counter based: the stream used for destination vertex v of block l is
// a splitmix64 sequence seeded by hash(seed, epoch, step, l, v). No state is carried
// between calls and nothing depends on the thread count or on scheduling.
//
// Frontier relabelling (deterministic with any thread count): the new frontier S_l is
// the destination list S_{l+1} (prefix) followed by the sources not yet in it, in order
// of first appearance when the sampled edges are read in block CSR order (destination
// by destination, within a destination in CSR row order).
#include "common.h"

#include <pybind11/stl.h>

#include <algorithm>
#include <limits>
#include <mutex>

namespace hpcgnn {
namespace {

// Fold one more integer into a key.
inline uint64_t combine(uint64_t key, uint64_t x) { return mix64(key ^ mix64(x + kGolden)); }

// splitmix64 stream with unbiased bounded draws (Lemire's method with rejection).
struct Stream {
    uint64_t state;
    explicit Stream(uint64_t key) : state(key) {}
    uint64_t next() {
        state += kGolden;
        return mix64(state);
    }
    // Uniform in [0, n), n >= 1.
    uint64_t below(uint64_t n) {
        uint64_t x = next();
        __uint128_t m = static_cast<__uint128_t>(x) * n;
        uint64_t low = static_cast<uint64_t>(m);
        if (low < n) {
            const uint64_t threshold = (0 - n) % n;
            while (low < threshold) {
                x = next();
                m = static_cast<__uint128_t>(x) * n;
                low = static_cast<uint64_t>(m);
            }
        }
        return static_cast<uint64_t>(m >> 64);
    }
};

// Loops shorter than this run on the calling thread (a parallel region costs more).
constexpr int64_t kParallelMin = 8192;

constexpr int64_t kEmpty = std::numeric_limits<int64_t>::min();

inline int64_t load_relaxed(const int64_t* p) { return __atomic_load_n(p, __ATOMIC_RELAXED); }

// Atomically raise *p to v if v is larger.
inline void atomic_max(int64_t* p, int64_t v) {
    int64_t cur = load_relaxed(p);
    while (v > cur && !__atomic_compare_exchange_n(p, &cur, v, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
    }
}

// In-place inclusive scan of a[1..n] so that a[i] = sum of the original a[1..i] (a[0] kept).
// Parallel two-pass over fixed chunks; the result does not depend on the thread count.
void prefix_sum(std::vector<int64_t>& a) {
    const int64_t n = static_cast<int64_t>(a.size()) - 1;
    if (n <= 0) return;
    if (n < (1 << 16)) {
        for (int64_t i = 1; i <= n; ++i) a[i] += a[i - 1];
        return;
    }
    const int nt = omp_get_max_threads();
    std::vector<int64_t> part(nt + 1, 0);
#pragma omp parallel num_threads(nt)
    {
        const int t = omp_get_thread_num(), T = omp_get_num_threads();
        const int64_t lo = 1 + n * t / T, hi = 1 + n * (t + 1) / T;
        int64_t s = 0;
        for (int64_t i = lo; i < hi; ++i) s += a[i];
        part[t + 1] = s;
#pragma omp barrier
#pragma omp single
        for (int i = 1; i <= T; ++i) part[i] += part[i - 1];
        int64_t run = part[t] + a[0];
        for (int64_t i = lo; i < hi; ++i) {
            run += a[i];
            a[i] = run;
        }
    }
}

// Draw k distinct positions of [0, deg) uniformly (Floyd's algorithm), sorted ascending.
// Membership is a linear scan for small k and a small open-addressing set otherwise.
void sample_positions(Stream& rng, int64_t deg, int64_t k, int64_t* out, std::vector<int64_t>& set) {
    if (k <= 64) {
        int64_t n = 0;
        for (int64_t j = deg - k; j < deg; ++j) {
            const int64_t t = static_cast<int64_t>(rng.below(static_cast<uint64_t>(j + 1)));
            bool seen = false;
            for (int64_t q = 0; q < n; ++q) {
                if (out[q] == t) {
                    seen = true;
                    break;
                }
            }
            out[n++] = seen ? j : t;
        }
    } else {
        uint64_t cap = 1;
        while (cap < static_cast<uint64_t>(2 * k)) cap <<= 1;
        set.assign(cap, -1);
        const uint64_t mask = cap - 1;
        auto insert = [&](int64_t x) -> bool {  // true if newly inserted
            uint64_t h = mix64(static_cast<uint64_t>(x)) & mask;
            while (set[h] != -1) {
                if (set[h] == x) return false;
                h = (h + 1) & mask;
            }
            set[h] = x;
            return true;
        };
        int64_t n = 0;
        for (int64_t j = deg - k; j < deg; ++j) {
            const int64_t t = static_cast<int64_t>(rng.below(static_cast<uint64_t>(j + 1)));
            if (insert(t)) {
                out[n++] = t;
            } else {
                insert(j);
                out[n++] = j;
            }
        }
    }
    std::sort(out, out + k);
}

struct LayerOut {
    std::vector<int64_t> indptr;    // [n_dst+1]
    std::vector<int64_t> indices;   // [nnz] positions in the new frontier
    std::vector<int64_t> frontier;  // new frontier (dst prefix + new sources)
};

// IX: the dtype of the CSR's source ids (int64, or int32 when every local id fits: half the
// bytes of the rank's largest array); everything the sampler returns is int64.
template <typename IX>
class Sampler {
  public:
    Sampler(carray<int64_t> indptr, carray<IX> indices, int64_t num_solid, int64_t num_local)
        : indptr_obj_(indptr), indices_obj_(indices), num_solid_(num_solid), num_local_(num_local) {
        require(indptr.ndim() == 1 && indptr.shape(0) == num_solid + 1,
                "sampler: indptr must have num_solid + 1 entries");
        require(indices.ndim() == 1, "sampler: indices must be 1-D");
        require(num_local >= num_solid && num_solid >= 0, "sampler: need 0 <= num_solid <= num_local");
        indptr_ = indptr.data();
        indices_ = indices.data();
        nnz_ = indices.shape(0);
        require(indptr_[0] == 0 && indptr_[num_solid] == nnz_,
                "sampler: indptr must start at 0 and end at len(indices)");
        bool bad_ptr = false, bad_idx = false;
        {
            py::gil_scoped_release release;
            const int64_t* ip = indptr_;
            const IX* ix = indices_;
            const int64_t nnz = nnz_;
#pragma omp parallel for schedule(static) reduction(|| : bad_ptr) if (num_solid > kParallelMin)
            for (int64_t v = 0; v < num_solid; ++v) bad_ptr = bad_ptr || ip[v + 1] < ip[v];
#pragma omp parallel for schedule(static) reduction(|| : bad_idx) if (nnz > kParallelMin)
            for (int64_t e = 0; e < nnz; ++e) bad_idx = bad_idx || ix[e] < 0 || ix[e] >= num_local;
        }
        require(!bad_ptr, "sampler: indptr must be non-decreasing");
        require(!bad_idx, "sampler: indices must lie in [0, num_local)");
        pos_.assign(static_cast<size_t>(num_local), kEmpty);
    }

    // Blocks from the seeds outwards: element i is block L-1-i. fanouts in block order
    // (input side first); -1 = all neighbours.
    py::list sample(carray<int64_t> seeds, std::vector<int64_t> fanouts, uint64_t key) {
        require(seeds.ndim() == 1, "sampler: seeds must be 1-D");
        const int64_t* sp = seeds.data();
        const int64_t ns = seeds.shape(0);
        std::vector<LayerOut> outs;
        {
            py::gil_scoped_release release;
            std::lock_guard<std::mutex> guard(mu_);
            outs = run(sp, ns, fanouts, key);
        }
        py::list result;
        for (auto& o : outs) {
            result.append(py::make_tuple(from_vector(std::move(o.indptr)), from_vector(std::move(o.indices)),
                                         from_vector(std::move(o.frontier))));
        }
        return result;
    }

    int64_t num_solid() const { return num_solid_; }
    int64_t num_local() const { return num_local_; }

  private:
    std::vector<LayerOut> run(const int64_t* seeds, int64_t ns, const std::vector<int64_t>& fanouts,
                              uint64_t key) {
        for (int64_t i = 0; i < ns; ++i) {
            if (seeds[i] < 0 || seeds[i] >= num_local_)
                throw std::invalid_argument("sampler: seed " + std::to_string(seeds[i]) +
                                            " is outside [0, num_local=" + std::to_string(num_local_) + ")");
        }
        std::vector<int64_t> cur(seeds, seeds + ns);
        int64_t* pos = pos_.data();
        // Mark the seeds with their positions; a repeated seed is an error.
        bool dup = false;
#pragma omp parallel for schedule(static) reduction(|| : dup) if (ns > kParallelMin)
        for (int64_t i = 0; i < ns; ++i) {
            int64_t expected = kEmpty;
            if (!__atomic_compare_exchange_n(&pos[cur[i]], &expected, i, false, __ATOMIC_RELAXED,
                                             __ATOMIC_RELAXED))
                dup = true;
        }
        if (dup) {
            reset(cur);
            throw std::invalid_argument("sampler: seeds contain a repeated vertex");
        }
        const int64_t L = static_cast<int64_t>(fanouts.size());
        std::vector<LayerOut> outs;
        outs.reserve(L);
        try {
            for (int64_t l = L - 1; l >= 0; --l) {
                outs.push_back(layer(cur, fanouts[l], combine(key, static_cast<uint64_t>(l))));
                cur = outs.back().frontier;
            }
        } catch (...) {
            std::fill(pos_.begin(), pos_.end(), kEmpty);  // e.g. bad_alloc mid-layer
            throw;
        }
        reset(cur);  // the input-most frontier contains every vertex marked so far
        return outs;
    }

    void reset(const std::vector<int64_t>& verts) {
        int64_t* pos = pos_.data();
        const int64_t n = static_cast<int64_t>(verts.size());
#pragma omp parallel for schedule(static) if (n > kParallelMin)
        for (int64_t i = 0; i < n; ++i) pos[verts[i]] = kEmpty;
    }

    // One block: destinations = dst (already marked in pos_ with their positions).
    LayerOut layer(const std::vector<int64_t>& dst, int64_t fanout, uint64_t layer_key) {
        const int64_t n_dst = static_cast<int64_t>(dst.size());
        LayerOut o;
        o.indptr.assign(n_dst + 1, 0);
        const int64_t* ip = indptr_;
        const IX* ix = indices_;
        const int64_t nsolid = num_solid_;
#pragma omp parallel for schedule(static) if (n_dst > kParallelMin)
        for (int64_t i = 0; i < n_dst; ++i) {
            const int64_t v = dst[i];
            const int64_t deg = v < nsolid ? ip[v + 1] - ip[v] : 0;  // halo vertices have no row
            o.indptr[i + 1] = (fanout < 0 || fanout >= deg) ? deg : fanout;
        }
        prefix_sum(o.indptr);
        const int64_t nnz = o.indptr[n_dst];
        std::vector<int64_t> src(nnz);
        int64_t* sp = src.data();
#pragma omp parallel if (n_dst > 256)
        {
            std::vector<int64_t> set;
#pragma omp for schedule(dynamic, 64)
            for (int64_t i = 0; i < n_dst; ++i) {
                const int64_t k = o.indptr[i + 1] - o.indptr[i];
                if (k == 0) continue;
                const int64_t v = dst[i];
                const int64_t begin = ip[v], deg = ip[v + 1] - begin;
                int64_t* out = sp + o.indptr[i];
                if (k == deg) {
                    for (int64_t q = 0; q < k; ++q) out[q] = ix[begin + q];
                } else {
                    Stream rng(combine(layer_key, static_cast<uint64_t>(v)));
                    sample_positions(rng, deg, k, out, set);
                    for (int64_t q = 0; q < k; ++q) out[q] = ix[begin + out[q]];
                }
            }
        }
        relabel(dst, sp, nnz, o);
        return o;
    }

    // New frontier and block indices for the sampled sources sp[0..nnz) (see the file
    // comment for the order). pos_ holds the positions of dst on entry and of the whole
    // new frontier on exit.
    void relabel(const std::vector<int64_t>& dst, const int64_t* sp, int64_t nnz, LayerOut& o) {
        const int64_t n_dst = static_cast<int64_t>(dst.size());
        int64_t* pos = pos_.data();
        o.indices.resize(nnz);
        o.frontier.assign(dst.begin(), dst.end());
        if (nnz <= kParallelMin || omp_get_max_threads() == 1) {
            // One pass, one scratch access per edge.
            for (int64_t e = 0; e < nnz; ++e) {
                const int64_t v = sp[e];
                int64_t p = pos[v];
                if (p == kEmpty) {
                    p = static_cast<int64_t>(o.frontier.size());
                    pos[v] = p;
                    o.frontier.push_back(v);
                }
                o.indices[e] = p;
            }
            return;
        }
        // Parallel: pos[v] >= 0 means v already has a position. Otherwise pos[v] becomes
        // -(1 + e) for the first edge e with source v (atomic max of the encoding; kEmpty
        // is below every encoding). Then flag first edges, scan the flags per chunk and
        // give the flagged sources consecutive positions.
#pragma omp parallel for schedule(static)
        for (int64_t e = 0; e < nnz; ++e) {
            int64_t* p = &pos[sp[e]];
            if (load_relaxed(p) < 0) atomic_max(p, -(1 + e));
        }
        const int nchunk = std::max(1, std::min<int>(omp_get_max_threads() * 4, static_cast<int>(nnz / 4096) + 1));
        std::vector<int64_t> chunk_new(nchunk + 1, 0);
        std::vector<uint8_t> first(nnz);
#pragma omp parallel for schedule(static)
        for (int c = 0; c < nchunk; ++c) {
            const int64_t lo = nnz * c / nchunk, hi = nnz * (c + 1) / nchunk;
            int64_t cnt = 0;
            for (int64_t e = lo; e < hi; ++e) {
                const bool f = pos[sp[e]] == -(1 + e);
                first[e] = f;
                cnt += f;
            }
            chunk_new[c + 1] = cnt;
        }
        for (int c = 0; c < nchunk; ++c) chunk_new[c + 1] += chunk_new[c];
        o.frontier.resize(n_dst + chunk_new[nchunk]);
#pragma omp parallel for schedule(static)
        for (int c = 0; c < nchunk; ++c) {
            const int64_t lo = nnz * c / nchunk, hi = nnz * (c + 1) / nchunk;
            int64_t r = n_dst + chunk_new[c];
            for (int64_t e = lo; e < hi; ++e) {
                if (first[e]) {
                    o.frontier[r] = sp[e];
                    pos[sp[e]] = r++;
                }
            }
        }
#pragma omp parallel for schedule(static)
        for (int64_t e = 0; e < nnz; ++e) o.indices[e] = pos[sp[e]];
    }

    py::object indptr_obj_, indices_obj_;  // keep the CSR buffers alive
    const int64_t* indptr_ = nullptr;
    const IX* indices_ = nullptr;
    int64_t nnz_ = 0;
    int64_t num_solid_, num_local_;
    std::vector<int64_t> pos_;  // scratch: frontier position per local vertex, kEmpty between calls
    std::mutex mu_;
};

// Degree-biased Bernoulli choice (DistGNN-MB AEP cap): for candidate i draw
// r = hash(key, candidates[i]) mod 2^hil and accept it when r < degrees[i]; return the
// positions of the first max_count accepted candidates, in candidate order.
carray<int64_t> degree_biased_choice(carray<int64_t> candidates, carray<int64_t> degrees, int64_t max_count,
                                     uint64_t key, int64_t hil) {
    const int64_t n = candidates.shape(0);
    require(degrees.shape(0) == n, "degree_biased_choice: candidates and degrees differ in length");
    require(hil >= 0 && hil < 63, "degree_biased_choice: hil must be in [0, 63)");
    const int64_t* c = candidates.data();
    const int64_t* d = degrees.data();
    std::vector<uint8_t> keep(n);
    const uint64_t mask = (uint64_t{1} << hil) - 1;
    {
        py::gil_scoped_release release;
#pragma omp parallel for schedule(static) if (n > kParallelMin)
        for (int64_t i = 0; i < n; ++i) {
            const int64_t r = static_cast<int64_t>(combine(key, static_cast<uint64_t>(c[i])) & mask);
            keep[i] = r < d[i];
        }
    }
    std::vector<int64_t> out;
    out.reserve(std::min(n, std::max<int64_t>(max_count, 0)));
    for (int64_t i = 0; i < n && static_cast<int64_t>(out.size()) < max_count; ++i)
        if (keep[i]) out.push_back(i);
    return from_vector(std::move(out));
}

uint64_t mix_key(const std::vector<int64_t>& parts) {
    uint64_t k = 0x6a09e667f3bcc909ULL;
    for (int64_t p : parts) k = combine(k, static_cast<uint64_t>(p));
    return k;
}

}  // namespace
}  // namespace hpcgnn

PYBIND11_MODULE(_native_sampler, m) {
    using namespace hpcgnn;
    m.doc() = "Neighbour sampling and degree-biased choice (OpenMP).";
    py::class_<Sampler<int64_t>>(m, "Sampler")
        .def(py::init<carray<int64_t>, carray<int64_t>, int64_t, int64_t>(), py::arg("indptr"),
             py::arg("indices"), py::arg("num_solid"), py::arg("num_local"))
        .def("sample", &Sampler<int64_t>::sample, py::arg("seeds"), py::arg("fanouts"), py::arg("key"),
             "List of (indptr, indices, frontier) per block, seeds' block first.")
        .def_property_readonly("num_solid", &Sampler<int64_t>::num_solid)
        .def_property_readonly("num_local", &Sampler<int64_t>::num_local);
    py::class_<Sampler<int32_t>>(m, "Sampler32", "Sampler over int32 source ids (same draws, int64 results).")
        .def(py::init<carray<int64_t>, carray<int32_t>, int64_t, int64_t>(), py::arg("indptr"),
             py::arg("indices"), py::arg("num_solid"), py::arg("num_local"))
        .def("sample", &Sampler<int32_t>::sample, py::arg("seeds"), py::arg("fanouts"), py::arg("key"),
             "List of (indptr, indices, frontier) per block, seeds' block first.")
        .def_property_readonly("num_solid", &Sampler<int32_t>::num_solid)
        .def_property_readonly("num_local", &Sampler<int32_t>::num_local);
    m.def("degree_biased_choice", &degree_biased_choice, py::arg("candidates"), py::arg("degrees"),
          py::arg("max_count"), py::arg("key"), py::arg("hil"));
    m.def("mix_key", &mix_key, py::arg("parts"), "64-bit key from a list of integers (splitmix64 chain).");
    add_thread_control(m);
}
