// Aggregation kernels for the GNN layers (SpMM, SDDMM, edge softmax) over a CSR of
// destinations: row v of (indptr, indices) lists the source rows u of the edges u -> v,
// edge id = position in `indices`.
//
// Conventions (all kernels):
// * Gather form, row-parallel over destinations (OpenMP, dynamic schedule): every output
//   row is written by one thread, with a fixed summation order (CSR order). Results are
//   bitwise identical for any thread count and there are no atomics. Backward passes run
//   the same kernels over the transposed CSR (see csr_transpose) and read per-edge values
//   through an optional `*_index` array (the transpose's edge ids), so nothing is permuted.
// * Arrays come in as numpy buffers and are used in place: float32 or float64 values
//   (all value arrays of one call share the dtype), int64 indices, C-contiguous. Outputs
//   are preallocated by the caller and overwritten. Nothing is converted or copied: a
//   wrong dtype, layout or shape raises ValueError.
// * Source indices are range-checked inside the loops (ValueError after the kernel).
//
// spmm_sum_bf16 is spmm_sum without edge weights over bfloat16 rows (int16 bit patterns, widened
// exactly): float32 sums and output, half the bytes gathered per edge.
//
// Speed: spmm_sum accumulates up to 512-byte chunks of a row (one pass for 128 float32
// columns), the multi-head kernels 256-byte chunks; the whole source row of the edge about
// kPrefetchBytes ahead (across row boundaries) is software-prefetched: random row gathers are
// latency bound, and hardware prefetchers do not follow indirect accesses. Large spmm_sum
// outputs are written with streaming stores. Measured on the 2-core dev machine (1M x 128
// float32, 10M random edges): 8-16 edges ahead are equally good; without prefetching the
// kernel is 5x slower; one 512-byte pass instead of two 256-byte passes saved 15-20 %,
// streaming stores about 5 %, transparent huge pages for X (fewer TLB misses) 5-15 %.
// 4-/8-way row blocking (rows advancing through their edges in lockstep) did not help.
#include "common.h"
#include "isa.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

namespace hpcgnn {
namespace {

constexpr int64_t kPrefetchBytes = 5120;  // source-row bytes in flight ahead of the gather

// Prefetch distance in edges for rows of `row_bytes` bytes (10 edges for 512-byte rows).
inline int64_t prefetch_distance(int64_t row_bytes) {
    return std::clamp<int64_t>(kPrefetchBytes / std::max<int64_t>(row_bytes, 1), 4, 64);
}
constexpr int64_t kRowsPerTask = 64;  // dynamic-schedule chunk (destination rows)
// Below this many element operations a kernel runs on the calling thread: waking a team
// costs more than it saves, and a lot more on an oversubscribed node.
constexpr int64_t kParallelWork = 1 << 16;

inline bool worth_threads(int64_t rows, int64_t nnz, int64_t width) { return (rows + nnz) * width > kParallelWork; }

// ---- argument checking ---------------------------------------------------------------

template <typename T>
using cbuf = py::array_t<T, py::array::c_style>;

template <typename T>
const char* dtype_name() {
    if constexpr (std::is_same_v<T, float>) return "float32";
    if constexpr (std::is_same_v<T, double>) return "float64";
    if constexpr (std::is_same_v<T, int16_t>) return "int16 (bfloat16 bits)";
    return "int64";
}

template <typename T>
cbuf<T> get(const py::object& o, const char* name, int ndim) {
    if (!py::isinstance<cbuf<T>>(o))
        throw std::invalid_argument(std::string(name) + ": expected a C-contiguous " + dtype_name<T>() +
                                    " numpy array");
    auto a = py::reinterpret_borrow<cbuf<T>>(o);
    if (a.ndim() != ndim)
        throw std::invalid_argument(std::string(name) + ": expected " + std::to_string(ndim) + " dimensions, got " +
                                    std::to_string(a.ndim()));
    return a;
}

template <typename T>
const T* opt_in(const py::object& o, const char* name, int ndim, cbuf<T>& keep) {
    if (o.is_none()) return nullptr;
    keep = get<T>(o, name, ndim);
    return keep.data();
}

template <typename T>
T* out_ptr_checked(cbuf<T>& a, const char* name) {
    if (!a.writeable()) throw std::invalid_argument(std::string(name) + ": output array is read-only");
    return a.mutable_data();
}

void require_dim(int64_t got, int64_t want, const std::string& what) {
    if (got != want)
        throw std::invalid_argument(what + ": got " + std::to_string(got) + ", expected " + std::to_string(want));
}

// A checked CSR: indptr [n+1] starting at 0, ending at nnz, non-decreasing (checked
// in O(n) here; the kernels then trust it).
struct Csr {
    cbuf<int64_t> indptr_a, indices_a;
    const int64_t* indptr;
    const int64_t* indices;
    int64_t rows, nnz;
};

Csr get_rows(const py::object& indptr, int64_t nnz) {
    Csr c;
    c.indptr_a = get<int64_t>(indptr, "indptr", 1);
    c.indptr = c.indptr_a.data();
    c.indices = nullptr;
    c.rows = c.indptr_a.shape(0) - 1;
    c.nnz = nnz;
    require(c.rows >= 0, "indptr: must have at least one entry");
    require(c.indptr[0] == 0 && c.indptr[c.rows] == c.nnz, "indptr: must start at 0 and end at nnz");
    bool bad = false;
    for (int64_t v = 0; v < c.rows; ++v) bad |= c.indptr[v + 1] < c.indptr[v];
    require(!bad, "indptr: must be non-decreasing");
    return c;
}

Csr get_csr(const py::object& indptr, const py::object& indices) {
    auto idx = get<int64_t>(indices, "indices", 1);
    Csr c = get_rows(indptr, idx.shape(0));
    c.indices_a = idx;
    c.indices = idx.data();
    return c;
}

inline bool out_of_range(int64_t u, int64_t n) { return static_cast<uint64_t>(u) >= static_cast<uint64_t>(n); }

// True if some index is outside [0, n) (one parallel pass, so the kernels' inner loops
// need no check).
bool any_out_of_range(const int64_t* idx, int64_t nnz, int64_t n) {
    uint64_t mx = 0;  // negative indices become huge unsigned values
#pragma omp parallel for simd reduction(max : mx) if (nnz > kParallelWork)
    for (int64_t j = 0; j < nnz; ++j) mx = std::max(mx, static_cast<uint64_t>(idx[j]));
    return nnz > 0 && mx >= static_cast<uint64_t>(n);
}

// An index array used to read per-edge values (edge ids of a transposed CSR).
const int64_t* opt_index(const py::object& o, const char* name, int64_t nnz, int64_t limit, cbuf<int64_t>& keep) {
    if (o.is_none()) return nullptr;
    keep = get<int64_t>(o, name, 1);
    require_dim(keep.shape(0), nnz, std::string(name) + " length");
    const int64_t* p = keep.data();
    require(!any_out_of_range(p, nnz, limit), std::string(name) + ": an edge id is outside [0, " + std::to_string(limit) + ")");
    return p;
}

// ---- the kernels, compiled per instruction set (spmm_kernels.h, isa.h) ------------------------

// HPCGNN_KERNELS_AVX: AVX intrinsics (streaming stores) in this copy. (The preprocessor does not
// see `#pragma GCC target`: __AVX__ only says what the build's -march has.)
#define HPCGNN_ISA_NS base
#if defined(__AVX__)
#define HPCGNN_KERNELS_AVX 1
#else
#define HPCGNN_KERNELS_AVX 0
#endif
#include "spmm_kernels.h"
#undef HPCGNN_ISA_NS
#undef HPCGNN_KERNELS_AVX
#if HPCGNN_X86_64
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#define HPCGNN_ISA_NS avx2
#define HPCGNN_KERNELS_AVX 1
#include "spmm_kernels.h"
#undef HPCGNN_ISA_NS
#undef HPCGNN_KERNELS_AVX
#pragma GCC pop_options
#endif

// ---- SpMM: out[v, :] = row_scale[v] * sum_j w[j] * col_scale[u_j] * X[u_j, :] -----------------

// X's numpy dtype A: T, or int16 holding bfloat16 bit patterns (read as uint16_t, T = float).
template <typename T, typename A = T>
void spmm_sum_t(const Csr& g, const py::object& X_o, const py::object& out_o, const py::object& w_o,
                const py::object& widx_o, const py::object& scale_o, const py::object& cs_o) {
    using S = std::conditional_t<std::is_same_v<A, int16_t>, uint16_t, A>;
    auto X = get<A>(X_o, "X", 2);
    auto out = get<T>(out_o, "out", 2);
    const int64_t n_src = X.shape(0), D = X.shape(1);
    require_dim(out.shape(0), g.rows, "out rows (= len(indptr) - 1)");
    require_dim(out.shape(1), D, "out columns (= X columns)");
    cbuf<T> w_a, s_a, cs_a;
    cbuf<int64_t> wi_a;
    const T* w = opt_in<T>(w_o, "edge_weight", 1, w_a);
    const int64_t* widx = nullptr;
    if (w) {
        widx = opt_index(widx_o, "weight_index", g.nnz, w_a.shape(0), wi_a);
        if (!widx) require_dim(w_a.shape(0), g.nnz, "edge_weight length (= nnz)");
    } else {
        require(widx_o.is_none(), "weight_index: given without edge_weight");
    }
    const T* scale = opt_in<T>(scale_o, "row_scale", 1, s_a);
    if (scale) require_dim(s_a.shape(0), g.rows, "row_scale length (= rows)");
    const T* col_scale = opt_in<T>(cs_o, "col_scale", 1, cs_a);
    if (col_scale) require_dim(cs_a.shape(0), n_src, "col_scale length (= X rows)");
    T* o = out_ptr_checked(out, "out");
    const S* x = reinterpret_cast<const S*>(X.data());
    bool bad;
    {
        py::gil_scoped_release nogil;
        bad = HPCGNN_ISA_CALL(spmm_run, g, w, widx, x, n_src, D, scale, col_scale, o);  // T, S deduced
    }
    require(!bad, "spmm_sum: a source index is outside [0, X.shape[0])");
}

void spmm_sum(const py::object& indptr, const py::object& indices, const py::object& X, const py::object& out,
              const py::object& edge_weight, const py::object& weight_index, const py::object& row_scale,
              const py::object& col_scale) {
    Csr g = get_csr(indptr, indices);
    if (py::isinstance<cbuf<float>>(X))
        return spmm_sum_t<float>(g, X, out, edge_weight, weight_index, row_scale, col_scale);
    if (py::isinstance<cbuf<double>>(X))
        return spmm_sum_t<double>(g, X, out, edge_weight, weight_index, row_scale, col_scale);
    throw std::invalid_argument("X: expected a C-contiguous float32 or float64 numpy array");
}

// spmm_sum without edge weights over bfloat16 rows (X int16 bit patterns, out float32).
void spmm_sum_bf16(const py::object& indptr, const py::object& indices, const py::object& X, const py::object& out,
                   const py::object& row_scale, const py::object& col_scale) {
    const py::object none = py::none();
    spmm_sum_t<float, int16_t>(get_csr(indptr, indices), X, out, none, none, row_scale, col_scale);
}

// ---- multi-head SpMM: out[v, h, :] = sum_j alpha[j, h] * Z[indices[j], h, :] -------------------
//                      (+ self_w[v, h] * Z[v, h, :] for v < n_self)

template <typename T>
void spmm_heads_t(const Csr& g, const py::object& alpha_o, const py::object& Z_o, const py::object& out_o,
                  const py::object& aidx_o, const py::object& self_o) {
    auto Z = get<T>(Z_o, "Z", 3);
    auto alpha = get<T>(alpha_o, "alpha", 2);
    auto out = get<T>(out_o, "out", 3);
    const int64_t n_src = Z.shape(0), H = Z.shape(1), D = Z.shape(2);
    require_dim(alpha.shape(1), H, "alpha heads (= Z.shape[1])");
    require_dim(out.shape(0), g.rows, "out rows (= len(indptr) - 1)");
    require_dim(out.shape(1), H, "out heads (= Z.shape[1])");
    require_dim(out.shape(2), D, "out width (= Z.shape[2])");
    cbuf<int64_t> ai_a;
    const int64_t* aidx = opt_index(aidx_o, "alpha_index", g.nnz, alpha.shape(0), ai_a);
    if (!aidx) require_dim(alpha.shape(0), g.nnz, "alpha rows (= nnz)");
    cbuf<T> sw_a;
    const T* self_w = opt_in<T>(self_o, "self_weight", 2, sw_a);
    int64_t n_self = 0;
    if (self_w) {
        n_self = sw_a.shape(0);
        require_dim(sw_a.shape(1), H, "self_weight heads (= Z.shape[1])");
        require(n_self <= g.rows && n_self <= n_src, "self_weight: more rows than out or Z");
    }
    T* o = out_ptr_checked(out, "out");
    const T* a = alpha.data();
    const T* z = Z.data();
    bool bad;
    {
        py::gil_scoped_release nogil;
        bad = any_out_of_range(g.indices, g.nnz, n_src);
        if (!bad) {
            HPCGNN_ISA_CALL(spmm_heads_run<T>, g, a, aidx, z, H, D, self_w, n_self, o);
        }
    }
    require(!bad, "spmm_heads: a source index is outside [0, Z.shape[0])");
}

void spmm_heads(const py::object& indptr, const py::object& indices, const py::object& alpha, const py::object& Z,
                const py::object& out, const py::object& alpha_index, const py::object& self_weight) {
    Csr g = get_csr(indptr, indices);
    if (py::isinstance<cbuf<float>>(Z)) return spmm_heads_t<float>(g, alpha, Z, out, alpha_index, self_weight);
    if (py::isinstance<cbuf<double>>(Z)) return spmm_heads_t<double>(g, alpha, Z, out, alpha_index, self_weight);
    throw std::invalid_argument("Z: expected a C-contiguous float32 or float64 numpy array");
}

// ---- SDDMM: out[j, h] = <A[v, h, :], B[indices[j], h, :]> for edge j of row v -------------------
//             (self_out[v, h] = <A[v, h, :], B[v, h, :]> for v < len(self_out))

template <typename T>
void sddmm_heads_t(const Csr& g, const py::object& A_o, const py::object& B_o, const py::object& out_o,
                   const py::object& self_o) {
    auto A = get<T>(A_o, "A", 3);
    auto B = get<T>(B_o, "B", 3);
    auto out = get<T>(out_o, "out", 2);
    const int64_t H = A.shape(1), D = A.shape(2);
    require_dim(A.shape(0), g.rows, "A rows (= len(indptr) - 1)");
    require_dim(B.shape(1), H, "B heads (= A.shape[1])");
    require_dim(B.shape(2), D, "B width (= A.shape[2])");
    require_dim(out.shape(0), g.nnz, "out rows (= nnz)");
    require_dim(out.shape(1), H, "out heads (= A.shape[1])");
    T* so = nullptr;
    int64_t n_self = 0;
    cbuf<T> so_a;
    if (!self_o.is_none()) {
        so_a = get<T>(self_o, "self_out", 2);
        n_self = so_a.shape(0);
        require_dim(so_a.shape(1), H, "self_out heads (= A.shape[1])");
        require(n_self <= g.rows && n_self <= B.shape(0), "self_out: more rows than A or B");
        so = out_ptr_checked(so_a, "self_out");
    }
    T* o = out_ptr_checked(out, "out");
    const T* a = A.data();
    const T* b = B.data();
    const int64_t n_src = B.shape(0);
    bool bad;
    {
        py::gil_scoped_release nogil;
        bad = any_out_of_range(g.indices, g.nnz, n_src);
        if (!bad) {
            HPCGNN_ISA_CALL(sddmm_run<T>, g, a, b, H, D, o, so, n_self);
        }
    }
    require(!bad, "sddmm_heads: a source index is outside [0, B.shape[0])");
}

void sddmm_heads(const py::object& indptr, const py::object& indices, const py::object& A, const py::object& B,
                 const py::object& out, const py::object& self_out) {
    Csr g = get_csr(indptr, indices);
    if (py::isinstance<cbuf<float>>(A)) return sddmm_heads_t<float>(g, A, B, out, self_out);
    if (py::isinstance<cbuf<double>>(A)) return sddmm_heads_t<double>(g, A, B, out, self_out);
    throw std::invalid_argument("A: expected a C-contiguous float32 or float64 numpy array");
}

// ---- segment sum: out[r, h] = sum_{j in row r} vals[index[j], h] ------------------------------

template <typename T>
void segment_sum_t(const Csr& g, const py::object& vals_o, const py::object& out_o, const py::object& vidx_o) {
    auto vals = get<T>(vals_o, "values", 2);
    auto out = get<T>(out_o, "out", 2);
    const int64_t H = vals.shape(1);
    require_dim(out.shape(0), g.rows, "out rows (= len(indptr) - 1)");
    require_dim(out.shape(1), H, "out columns (= values.shape[1])");
    cbuf<int64_t> vi_a;
    const int64_t* vidx = opt_index(vidx_o, "value_index", g.nnz, vals.shape(0), vi_a);
    if (!vidx) require_dim(vals.shape(0), g.nnz, "values rows (= nnz)");
    T* o = out_ptr_checked(out, "out");
    const T* x = vals.data();
    const int64_t* indptr = g.indptr;
    py::gil_scoped_release nogil;
#pragma omp parallel for schedule(dynamic, 256) if (worth_threads(g.rows, g.nnz, H))
    for (int64_t r = 0; r < g.rows; ++r) {
        T* orow = o + r * H;
        for (int64_t h = 0; h < H; ++h) orow[h] = T(0);
        for (int64_t j = indptr[r]; j < indptr[r + 1]; ++j) {
            if (vidx && j + 16 < g.nnz) __builtin_prefetch(x + vidx[j + 16] * H, 0, 3);
            const T* xr = x + (vidx ? vidx[j] : j) * H;
            for (int64_t h = 0; h < H; ++h) orow[h] += xr[h];
        }
    }
}

void segment_sum(const py::object& indptr, const py::object& values, const py::object& out,
                 const py::object& value_index) {
    // nnz = number of edges read = len(value_index) if given, else len(values)
    require(py::isinstance<py::array>(values), "values: expected a numpy array");
    const int64_t nnz = value_index.is_none() ? py::reinterpret_borrow<py::array>(values).shape(0)
                                              : get<int64_t>(value_index, "value_index", 1).shape(0);
    Csr g = get_rows(indptr, nnz);
    if (py::isinstance<cbuf<float>>(values)) return segment_sum_t<float>(g, values, out, value_index);
    if (py::isinstance<cbuf<double>>(values)) return segment_sum_t<double>(g, values, out, value_index);
    throw std::invalid_argument("values: expected a C-contiguous float32 or float64 numpy array");
}

// ---- GAT edge logits: out[j, h] = LeakyReLU(el[indices[j], h] + er[v, h]) ----------------------

template <typename T>
void gat_edge_logits_t(const Csr& g, const py::object& el_o, const py::object& er_o, double slope,
                       const py::object& out_o) {
    auto el = get<T>(el_o, "el", 2);
    auto er = get<T>(er_o, "er", 2);
    auto out = get<T>(out_o, "out", 2);
    const int64_t H = el.shape(1), n_src = el.shape(0);
    require_dim(er.shape(0), g.rows, "er rows (= len(indptr) - 1)");
    require_dim(er.shape(1), H, "er heads (= el.shape[1])");
    require_dim(out.shape(0), g.nnz, "out rows (= nnz)");
    require_dim(out.shape(1), H, "out heads (= el.shape[1])");
    T* o = out_ptr_checked(out, "out");
    const T* l = el.data();
    const T* r = er.data();
    const T sl = static_cast<T>(slope);
    const int64_t* indptr = g.indptr;
    const int64_t* indices = g.indices;
    bool bad = false;
    {
        py::gil_scoped_release nogil;
        bad = any_out_of_range(indices, g.nnz, n_src);
#pragma omp parallel for schedule(dynamic, 256) if (!bad && worth_threads(g.rows, g.nnz, H))
        for (int64_t v = 0; v < g.rows; ++v) {
            for (int64_t j = indptr[v]; j < indptr[v + 1]; ++j) {
                if (j + 16 < g.nnz) __builtin_prefetch(l + indices[j + 16] * H, 0, 3);
                const int64_t u = indices[j];
                for (int64_t h = 0; h < H; ++h) {
                    const T x = l[u * H + h] + r[v * H + h];
                    o[j * H + h] = x > T(0) ? x : sl * x;
                }
            }
        }
    }
    require(!bad, "gat_edge_logits: a source index is outside [0, el.shape[0])");
}

void gat_edge_logits(const py::object& indptr, const py::object& indices, const py::object& el,
                     const py::object& er, double slope, const py::object& out) {
    Csr g = get_csr(indptr, indices);
    if (py::isinstance<cbuf<float>>(el)) return gat_edge_logits_t<float>(g, el, er, slope, out);
    if (py::isinstance<cbuf<double>>(el)) return gat_edge_logits_t<double>(g, el, er, slope, out);
    throw std::invalid_argument("el: expected a C-contiguous float32 or float64 numpy array");
}

// ---- edge softmax over the in-edges of each destination (and an optional self edge) ---------

template <typename T>
void edge_softmax_t(const Csr& g, const py::object& logits_o, const py::object& out_o, const py::object& sl_o,
                    const py::object& so_o) {
    auto logits = get<T>(logits_o, "logits", 2);
    auto out = get<T>(out_o, "out", 2);
    const int64_t H = logits.shape(1);
    require_dim(logits.shape(0), g.nnz, "logits rows (= nnz)");
    require_dim(out.shape(0), g.nnz, "out rows (= nnz)");
    require_dim(out.shape(1), H, "out heads");
    cbuf<T> sl_a, so_a;
    const T* sl = opt_in<T>(sl_o, "self_logits", 2, sl_a);
    T* so = nullptr;
    require(sl_o.is_none() == so_o.is_none(), "edge_softmax: self_logits and self_out go together");
    if (sl) {
        so_a = get<T>(so_o, "self_out", 2);
        require_dim(sl_a.shape(0), g.rows, "self_logits rows (= len(indptr) - 1)");
        require_dim(sl_a.shape(1), H, "self_logits heads");
        require_dim(so_a.shape(0), g.rows, "self_out rows (= len(indptr) - 1)");
        require_dim(so_a.shape(1), H, "self_out heads");
        so = out_ptr_checked(so_a, "self_out");
    }
    T* o = out_ptr_checked(out, "out");
    const T* x = logits.data();
    const int64_t* indptr = g.indptr;
    py::gil_scoped_release nogil;
#pragma omp parallel for schedule(dynamic, 256) if (worth_threads(g.rows, g.nnz, H))
    for (int64_t v = 0; v < g.rows; ++v) {
        const int64_t b = indptr[v], e = indptr[v + 1];
        for (int64_t h = 0; h < H; ++h) {
            T m = sl ? sl[v * H + h] : -std::numeric_limits<T>::infinity();
            for (int64_t j = b; j < e; ++j) m = std::max(m, x[j * H + h]);
            if (!(m > -std::numeric_limits<T>::infinity())) m = T(0);  // empty row or all -inf
            T sum = T(0);
            for (int64_t j = b; j < e; ++j) {
                const T p = std::exp(x[j * H + h] - m);
                o[j * H + h] = p;
                sum += p;
            }
            T ps = T(0);
            if (sl) {
                ps = std::exp(sl[v * H + h] - m);
                sum += ps;
            }
            const T inv = sum > T(0) ? T(1) / sum : T(0);
            for (int64_t j = b; j < e; ++j) o[j * H + h] *= inv;
            if (so) so[v * H + h] = ps * inv;
        }
    }
}

void edge_softmax(const py::object& indptr, const py::object& logits, const py::object& out,
                  const py::object& self_logits, const py::object& self_out) {
    require(py::isinstance<py::array>(logits), "logits: expected a numpy array");
    Csr g = get_rows(indptr, py::reinterpret_borrow<py::array>(logits).shape(0));
    if (py::isinstance<cbuf<float>>(logits)) return edge_softmax_t<float>(g, logits, out, self_logits, self_out);
    if (py::isinstance<cbuf<double>>(logits)) return edge_softmax_t<double>(g, logits, out, self_logits, self_out);
    throw std::invalid_argument("logits: expected a C-contiguous float32 or float64 numpy array");
}


// grad_logits[j, h] = alpha[j, h] * (g[j, h] - sum_{j' in row} alpha[j', h] g[j', h] - self terms)
template <typename T>
void edge_softmax_backward_t(const Csr& g, const py::object& alpha_o, const py::object& grad_o,
                             const py::object& out_o, const py::object& sa_o, const py::object& sg_o,
                             const py::object& so_o) {
    auto alpha = get<T>(alpha_o, "alpha", 2);
    auto grad = get<T>(grad_o, "grad_alpha", 2);
    auto out = get<T>(out_o, "out", 2);
    const int64_t H = alpha.shape(1);
    require_dim(alpha.shape(0), g.nnz, "alpha rows (= nnz)");
    for (auto* a : {&grad, &out}) {
        require_dim(a->shape(0), g.nnz, "grad_alpha/out rows (= nnz)");
        require_dim(a->shape(1), H, "grad_alpha/out heads (= alpha.shape[1])");
    }
    const bool self = !sa_o.is_none();
    require(sg_o.is_none() != self && so_o.is_none() != self,
            "edge_softmax_backward: self_alpha, self_grad and self_out go together");
    cbuf<T> sa_a, sg_a, so_a;
    const T* sa = nullptr;
    const T* sg = nullptr;
    T* so = nullptr;
    if (self) {
        sa_a = get<T>(sa_o, "self_alpha", 2);
        sg_a = get<T>(sg_o, "self_grad", 2);
        so_a = get<T>(so_o, "self_out", 2);
        for (auto* a : {&sa_a, &sg_a, &so_a}) {
            require_dim(a->shape(0), g.rows, "self_* rows (= len(indptr) - 1)");
            require_dim(a->shape(1), H, "self_* heads (= alpha.shape[1])");
        }
        sa = sa_a.data();
        sg = sg_a.data();
        so = out_ptr_checked(so_a, "self_out");
    }
    T* o = out_ptr_checked(out, "out");
    const T* al = alpha.data();
    const T* gr = grad.data();
    const int64_t* indptr = g.indptr;
    py::gil_scoped_release nogil;
#pragma omp parallel for schedule(dynamic, 256) if (worth_threads(g.rows, g.nnz, H))
    for (int64_t v = 0; v < g.rows; ++v) {
        const int64_t b = indptr[v], e = indptr[v + 1];
        for (int64_t h = 0; h < H; ++h) {
            T dot = self ? sa[v * H + h] * sg[v * H + h] : T(0);
            for (int64_t j = b; j < e; ++j) dot += al[j * H + h] * gr[j * H + h];
            for (int64_t j = b; j < e; ++j) o[j * H + h] = al[j * H + h] * (gr[j * H + h] - dot);
            if (self) so[v * H + h] = sa[v * H + h] * (sg[v * H + h] - dot);
        }
    }
}

void edge_softmax_backward(const py::object& indptr, const py::object& alpha, const py::object& grad_alpha,
                           const py::object& out, const py::object& self_alpha, const py::object& self_grad,
                           const py::object& self_out) {
    require(py::isinstance<py::array>(alpha), "alpha: expected a numpy array");
    Csr g = get_rows(indptr, py::reinterpret_borrow<py::array>(alpha).shape(0));
    if (py::isinstance<cbuf<float>>(alpha))
        return edge_softmax_backward_t<float>(g, alpha, grad_alpha, out, self_alpha, self_grad, self_out);
    if (py::isinstance<cbuf<double>>(alpha))
        return edge_softmax_backward_t<double>(g, alpha, grad_alpha, out, self_alpha, self_grad, self_out);
    throw std::invalid_argument("alpha: expected a C-contiguous float32 or float64 numpy array");
}

// ---- CSR transpose (stable counting sort by source) ---------------------------------------
// Rows of the result are sources; within a row, edges in increasing edge id. Threads
// count their own contiguous edge range into private histograms when these fit in
// about 2 * nnz entries, so the parallel result equals the serial one.
py::tuple csr_transpose(const py::object& indptr_o, const py::object& indices_o, int64_t num_src) {
    Csr g = get_csr(indptr_o, indices_o);
    require(num_src >= 0, "csr_transpose: num_src must be >= 0");
    std::vector<int64_t> t_indptr(num_src + 1, 0), t_indices(g.nnz), t_eid(g.nnz);
    const int64_t* indptr = g.indptr;
    const int64_t* indices = g.indices;
    const int64_t nnz = g.nnz, rows = g.rows;
    bool bad = false;
    {
        py::gil_scoped_release nogil;
        bad = any_out_of_range(indices, nnz, num_src);
        if (!bad) {
            int T = std::max(1, omp_get_max_threads());
            if (static_cast<double>(T) * (num_src + 1) > 2.0 * nnz + 1e6 || nnz < 100000) T = 1;
            // Row ranges balanced by edges: thread t owns rows [rb[t], rb[t+1]).
            std::vector<int64_t> rb(T + 1, rows);
            rb[0] = 0;
            for (int t = 1; t < T; ++t)
                rb[t] = std::upper_bound(indptr, indptr + rows + 1, nnz * t / T) - indptr - 1;
            for (int t = 1; t <= T; ++t) rb[t] = std::max(rb[t], rb[t - 1]);
            rb[T] = rows;
            std::vector<int64_t> cnt(static_cast<size_t>(T) * (num_src + 1), 0);
#pragma omp parallel num_threads(T)
            {
                const int t = omp_get_thread_num();
                int64_t* c = cnt.data() + static_cast<size_t>(t) * (num_src + 1);
                for (int64_t j = indptr[rb[t]]; j < indptr[rb[t + 1]]; ++j) ++c[indices[j]];
            }
            // offsets: t_indptr[u] + counts of the same source in earlier threads
            int64_t run = 0;
            for (int64_t u = 0; u < num_src; ++u) {
                t_indptr[u] = run;
                for (int t = 0; t < T; ++t) {
                    int64_t& c = cnt[static_cast<size_t>(t) * (num_src + 1) + u];
                    const int64_t k = c;
                    c = run;
                    run += k;
                }
            }
            t_indptr[num_src] = run;
#pragma omp parallel num_threads(T)
            {
                const int t = omp_get_thread_num();
                int64_t* pos = cnt.data() + static_cast<size_t>(t) * (num_src + 1);
                for (int64_t v = rb[t]; v < rb[t + 1]; ++v)
                    for (int64_t j = indptr[v]; j < indptr[v + 1]; ++j) {
                        const int64_t p = pos[indices[j]]++;
                        t_indices[p] = v;
                        t_eid[p] = j;
                    }
            }
        }
    }
    require(!bad, "csr_transpose: an index is outside [0, num_src)");
    return py::make_tuple(from_vector(std::move(t_indptr)), from_vector(std::move(t_indices)),
                          from_vector(std::move(t_eid)));
}

}  // namespace
}  // namespace hpcgnn

PYBIND11_MODULE(_native_spmm, m) {
    using namespace hpcgnn;
    m.doc() = "Aggregation kernels over a CSR of destinations: SpMM, SDDMM, edge softmax (OpenMP).";
    add_thread_control(m);
    HPCGNN_ADD_ISA_INFO(m);
    const auto none = py::none();
    m.def("spmm_sum", &spmm_sum, py::arg("indptr"), py::arg("indices"), py::arg("X"), py::arg("out"),
          py::arg("edge_weight") = none, py::arg("weight_index") = none, py::arg("row_scale") = none,
          py::arg("col_scale") = none,
          "out[v] = row_scale[v] * sum_j w[j] col_scale[u_j] X[u_j] over row v's edges j, u_j = indices[j] "
          "(absent factors = 1; w read at weight_index[j] when given). X [num_src, D], out [rows, D], "
          "overwritten; row_scale [rows], col_scale [num_src]. A source index outside [0, num_src) raises "
          "ValueError (out is then partly written).");
    m.def("spmm_sum_bf16", &spmm_sum_bf16, py::arg("indptr"), py::arg("indices"), py::arg("X"), py::arg("out"),
          py::arg("row_scale") = none, py::arg("col_scale") = none,
          "spmm_sum without edge weights over bfloat16 rows: X int16 [num_src, D] holding bfloat16 bit "
          "patterns (a torch bfloat16 tensor viewed as int16), widened exactly to float32; sums, row_scale "
          "[rows], col_scale [num_src] and out [rows, D] float32, same order as spmm_sum.");
    m.def("spmm_heads", &spmm_heads, py::arg("indptr"), py::arg("indices"), py::arg("alpha"), py::arg("Z"),
          py::arg("out"), py::arg("alpha_index") = none, py::arg("self_weight") = none,
          "out[v, h] = sum_j alpha[j, h] Z[indices[j], h] (alpha row alpha_index[j] when given), plus "
          "self_weight[v, h] Z[v, h] for v < len(self_weight). alpha [nnz, H], Z [num_src, H, D], "
          "out [rows, H, D], self_weight [n_self, H].");
    m.def("sddmm_heads", &sddmm_heads, py::arg("indptr"), py::arg("indices"), py::arg("A"), py::arg("B"),
          py::arg("out"), py::arg("self_out") = none,
          "out[j, h] = <A[v, h], B[indices[j], h]> for edge j of row v, and self_out[v, h] = "
          "<A[v, h], B[v, h]> for v < len(self_out). A [rows, H, D], B [num_src, H, D], out [nnz, H].");
    m.def("segment_sum", &segment_sum, py::arg("indptr"), py::arg("values"), py::arg("out"),
          py::arg("value_index") = none,
          "out[r] = sum_j values[value_index[j] or j] over row r's positions j. values [*, H], out [rows, H].");
    m.def("gat_edge_logits", &gat_edge_logits, py::arg("indptr"), py::arg("indices"), py::arg("el"),
          py::arg("er"), py::arg("negative_slope"), py::arg("out"),
          "out[j, h] = LeakyReLU(el[indices[j], h] + er[v, h]). el [num_src, H], er [rows, H], out [nnz, H].");
    m.def("edge_softmax", &edge_softmax, py::arg("indptr"), py::arg("logits"), py::arg("out"),
          py::arg("self_logits") = none, py::arg("self_out") = none,
          "Softmax of logits [nnz, H] over each row's edges (plus one self edge per row with logit "
          "self_logits[v] when given, its weight written to self_out). Empty rows produce nothing.");
    m.def("edge_softmax_backward", &edge_softmax_backward, py::arg("indptr"), py::arg("alpha"),
          py::arg("grad_alpha"), py::arg("out"), py::arg("self_alpha") = none, py::arg("self_grad") = none,
          py::arg("self_out") = none, "Gradient of edge_softmax with respect to the logits.");
    m.def("csr_transpose", &csr_transpose, py::arg("indptr"), py::arg("indices"), py::arg("num_src"),
          "(t_indptr [num_src+1], t_indices [nnz] row of each edge, t_eid [nnz] edge id); edges of a "
          "transposed row in increasing edge id.");
}
