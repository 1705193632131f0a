// The compute kernels of native/spmm.cpp (SpMM, multi-head SpMM, SDDMM), included by spmm.cpp
// once per instruction set: in namespace `base` compiled for the build's -march (the
// x86-64-v2 baseline by default) and, on x86-64, again in namespace `avx2` under
// `#pragma GCC target("avx2,fma")`. spmm.cpp picks one at run time (isa.h). No include
// guard on purpose; the includer defines HPCGNN_ISA_NS and has included every header used here
// (and defines Csr, prefetch_distance, worth_threads, kRowsPerTask).

namespace HPCGNN_ISA_NS {

inline void prefetch_bytes(const void* p, int64_t bytes) {
    const char* c = static_cast<const char*>(p);
    for (int64_t l = 0; l < bytes; l += 64) __builtin_prefetch(c + l, 0, 3);
}

// ---- SpMM: out[v, :] = row_scale[v] * sum_j w[j] * col_scale[u_j] * X[u_j, :] -----------------

// Prefetches the source row of edge j (X[indices[j]], row_bytes long) and, INDEXED, its weight
// w[widx[j]] (read out of order). ROW_LINES > 0: the rows are exactly that many 64-byte lines
// (D == CH), prefetched by an unrolled sequence (about 10 % faster than the runtime-length loop
// for 512-byte rows).
template <int64_t ROW_LINES, bool INDEXED, typename S, typename T>
[[gnu::always_inline]] inline void prefetch_edge(const S* X, const int64_t* indices, int64_t D, int64_t row_bytes,
                                                 const T* w, const int64_t* widx, int64_t j) {
    if constexpr (ROW_LINES > 0) {
        const char* r = reinterpret_cast<const char*>(X + indices[j] * D);
#pragma GCC unroll 16
        for (int64_t l = 0; l < ROW_LINES; ++l) __builtin_prefetch(r + 64 * l, 0, 3);
    } else {
        prefetch_bytes(X + indices[j] * D, row_bytes);
    }
    if (INDEXED) __builtin_prefetch(w + widx[j], 0, 3);
}

// acc[0:len) += sum over row edges [b, e) of w_j * cs[u_j] * X[u_j, c:c+len) (u_j = indices[j]);
// prefetches whole source rows prefetch_distance edges ahead during the first chunk (c == 0)
// (prefetch_edge: ROW_LINES > 0 for rows of exactly that many lines).
template <typename T, int64_t CH, bool FULL, bool WEIGHTED, bool INDEXED, bool COLSCALE, int64_t ROW_LINES = 0>
inline void gather_chunk(T* acc, const int64_t* indices, int64_t b, int64_t e, int64_t nnz, const T* X,
                         int64_t D, int64_t c, int64_t len, const T* w, const int64_t* widx, const T* cs) {
    const int64_t row_bytes = D * static_cast<int64_t>(sizeof(T)), pf = prefetch_distance(row_bytes);
    for (int64_t j = b; j < e; ++j) {
        if (c == 0 && j + pf < nnz) prefetch_edge<ROW_LINES, INDEXED>(X, indices, D, row_bytes, w, widx, j + pf);
        const T* x = X + indices[j] * D + c;
        T wj = WEIGHTED ? w[INDEXED ? widx[j] : j] : T(1);
        if (COLSCALE) wj *= cs[indices[j]];
        if (FULL) {
#pragma omp simd
            for (int64_t k = 0; k < CH; ++k) acc[k] += wj * x[k];
        } else {
#pragma omp simd
            for (int64_t k = 0; k < len; ++k) acc[k] += wj * x[k];
        }
    }
}

// A stored value as the accumulator type: float/double as they are; bfloat16 (uint16_t bit
// patterns, the high half of a float32) widened exactly.
template <typename T, typename S>
inline T widen(S v) {
    if constexpr (std::is_same_v<S, uint16_t>)
        return __builtin_bit_cast(float, static_cast<uint32_t>(v) << 16);
    else
        return v;
}

// gather_chunk for a partial chunk of len = NV * 8 + tail columns (tail < 8) with NV fixed at
// compile time: the accumulators stay in registers across the row's edges, as in the
// full-chunk case (a runtime-length loop keeps them in memory: a load and a store per element
// and edge, which made widths below CH slower than CH itself). The tail columns (TAIL:
// tail > 0) are accumulated as the 8 columns that end the chunk, [len - 8, len), when
// len >= 8: a fixed-width vector that reads nothing outside the row; its lanes below
// 8 - tail repeat columns already summed and are dropped. (A runtime-length tail loop put
// every accumulator in memory again: a 47-wide gather took twice as long as a 48-wide one.)
// Same sums, same order, same roundings as a plain loop. X stored as S (widen).
template <typename T, typename S, int64_t NV, bool TAIL, bool WEIGHTED, bool INDEXED, bool COLSCALE>
inline void gather_part_edges(T* acc, const int64_t* indices, int64_t b, int64_t e, int64_t nnz, const S* X,
                              int64_t D, int64_t c, int64_t tail, const T* w, const int64_t* widx, const T* cs) {
    constexpr int64_t W = NV * 8;
    const int64_t row_bytes = D * static_cast<int64_t>(sizeof(S)), pf = prefetch_distance(row_bytes);
    const int64_t toff = W + tail - 8;  // first of the 8 columns ending the chunk (NV > 0)
    alignas(64) T a[W > 0 ? W : 1];
    alignas(64) T t[8];
#pragma omp simd
    for (int64_t k = 0; k < W; ++k) a[k] = T(0);
#pragma omp simd
    for (int64_t k = 0; k < 8; ++k) t[k] = T(0);
    for (int64_t j = b; j < e; ++j) {
        if (c == 0 && j + pf < nnz) prefetch_edge<0, INDEXED>(X, indices, D, row_bytes, w, widx, j + pf);
        const S* x = X + indices[j] * D + c;
        T wj = WEIGHTED ? w[INDEXED ? widx[j] : j] : T(1);
        if (COLSCALE) wj *= cs[indices[j]];
#pragma omp simd
        for (int64_t k = 0; k < W; ++k) a[k] += wj * widen<T>(x[k]);
        if constexpr (TAIL && NV > 0) {
#pragma omp simd
            for (int64_t k = 0; k < 8; ++k) t[k] += wj * widen<T>(x[toff + k]);
        } else if constexpr (TAIL) {
            for (int64_t k = 0; k < tail; ++k) t[k] += wj * widen<T>(x[k]);
        }
    }
    for (int64_t k = 0; k < W; ++k) acc[k] = a[k];
    if constexpr (TAIL)
        for (int64_t k = 0; k < tail; ++k) acc[W + k] = t[NV > 0 ? 8 - tail + k : k];
}

// Dispatch of a float chunk of len <= 128 columns (stored as S) to gather_part_edges<NV = len / 8>.
template <typename S, bool WEIGHTED, bool INDEXED, bool COLSCALE, int64_t NV = 0>
inline void gather_part_float(float* acc, const int64_t* indices, int64_t b, int64_t e, int64_t nnz, const S* X,
                              int64_t D, int64_t c, int64_t len, const float* w, const int64_t* widx,
                              const float* cs) {
    if constexpr (NV <= 16) {
        if (len / 8 == NV) {
            const int64_t tail = len - NV * 8;  // 0 when NV == 16 (len <= 128)
            if constexpr (NV < 16) {
                if (tail > 0)
                    return gather_part_edges<float, S, NV, true, WEIGHTED, INDEXED, COLSCALE>(
                        acc, indices, b, e, nnz, X, D, c, tail, w, widx, cs);
            }
            gather_part_edges<float, S, NV, false, WEIGHTED, INDEXED, COLSCALE>(acc, indices, b, e, nnz, X, D, c,
                                                                                 tail, w, widx, cs);
        } else {
            gather_part_float<S, WEIGHTED, INDEXED, COLSCALE, NV + 1>(acc, indices, b, e, nnz, X, D, c, len, w, widx,
                                                                      cs);
        }
    }
}

// Output rows of a large SpMM are written with streaming (non-temporal) stores: they are not
// read again soon, and a normal store first reads the line it overwrites. Used when the
// output exceeds kStreamBytes and every row starts on a 32-byte boundary (AVX builds only).
constexpr int64_t kStreamBytes = int64_t(64) << 20;

template <typename T>
bool can_stream(const T* out, int64_t rows, int64_t D) {
#if HPCGNN_KERNELS_AVX
    const int64_t row_bytes = D * static_cast<int64_t>(sizeof(T));
    return rows * row_bytes >= kStreamBytes && row_bytes % 32 == 0 && reinterpret_cast<uintptr_t>(out) % 32 == 0;
#else
    (void)out, (void)rows, (void)D;
    return false;
#endif
}

// o[0:len) = acc[0:len) * s; streaming stores when `stream` (then len % (32 / sizeof(T)) == 0
// and o is 32-byte aligned, see can_stream). Same values either way.
template <typename T>
inline void store_scaled(T* o, const T* acc, int64_t len, T s, bool stream) {
#if HPCGNN_KERNELS_AVX
    if (stream) {
        if constexpr (std::is_same_v<T, float>) {
            const __m256 sv = _mm256_set1_ps(s);
            for (int64_t k = 0; k < len; k += 8) _mm256_stream_ps(o + k, _mm256_mul_ps(_mm256_loadu_ps(acc + k), sv));
        } else {
            const __m256d sv = _mm256_set1_pd(s);
            for (int64_t k = 0; k < len; k += 4) _mm256_stream_pd(o + k, _mm256_mul_pd(_mm256_loadu_pd(acc + k), sv));
        }
        return;
    }
#endif
    (void)stream;
#pragma omp simd
    for (int64_t k = 0; k < len; ++k) o[k] = acc[k] * s;
}

inline void store_fence(bool stream) {
#if HPCGNN_KERNELS_AVX
    if (stream) _mm_sfence();  // make this thread's streaming stores visible before the join
#endif
    (void)stream;
}

#if HPCGNN_KERNELS_AVX
// 8 consecutive stored values from x as a 32-byte vector of T: float/double loaded as they are;
// bfloat16 bit patterns (S = uint16_t, T = float) widened exactly (shifted into the high half).
template <typename T, typename S>
inline auto load_vector(const S* x) {
    typedef T vec __attribute__((vector_size(32)));
    if constexpr (std::is_same_v<S, uint16_t>) {
        typedef uint16_t half_bits __attribute__((vector_size(16), aligned(2)));
        typedef uint32_t bits __attribute__((vector_size(32)));
        return reinterpret_cast<vec>(__builtin_convertvector(*reinterpret_cast<const half_bits*>(x), bits) << 16);
    } else {
        typedef T vec_unaligned __attribute__((vector_size(32), aligned(sizeof(T))));
        return vec(*reinterpret_cast<const vec_unaligned*>(x));
    }
}

// o[0:CH) = s * sum over row edges [b, e) of w_j * cs[u_j] * X[u_j, c:c+CH) for a full chunk
// of CH = 512 / sizeof(T) columns (streaming stores when `stream`), with the 16 accumulators as
// 32-byte vectors (GCC vector extension), which stay in registers across the edges.
// gather_chunk's local array makes GCC load and store every vector once per edge: 10-25 %
// slower (docs/benchmarks.md). X stored as S (load_vector). Same sums, same order as
// gather_chunk. Prefetches as gather_chunk (ROW_LINES > 0: rows of that many lines).
template <typename T, typename S, bool WEIGHTED, bool INDEXED, bool COLSCALE, int64_t ROW_LINES>
inline void gather_chunk_in_registers(T* o, const int64_t* indices, int64_t b, int64_t e, int64_t nnz, const S* X,
                                      int64_t D, int64_t c, const T* w, const int64_t* widx, const T* cs, T s,
                                      bool stream) {
    typedef T vec __attribute__((vector_size(32)));
    typedef T vec_unaligned __attribute__((vector_size(32), aligned(sizeof(T))));
    constexpr int64_t L = 32 / sizeof(T), NV = 512 / 32;
    const int64_t row_bytes = D * static_cast<int64_t>(sizeof(S)), pf = prefetch_distance(row_bytes);
    vec a[NV];
#pragma GCC unroll 16
    for (int64_t i = 0; i < NV; ++i) a[i] = vec{};
    for (int64_t j = b; j < e; ++j) {
        if (c == 0 && j + pf < nnz) prefetch_edge<ROW_LINES, INDEXED>(X, indices, D, row_bytes, w, widx, j + pf);
        const S* x = X + indices[j] * D + c;
        T wj = WEIGHTED ? w[INDEXED ? widx[j] : j] : T(1);
        if (COLSCALE) wj *= cs[indices[j]];
#pragma GCC unroll 16
        for (int64_t i = 0; i < NV; ++i) {
            const vec xi = load_vector<T, S>(x + i * L);
            if constexpr (WEIGHTED || COLSCALE)
                a[i] += wj * xi;
            else
                a[i] += xi;
        }
    }
#pragma GCC unroll 16
    for (int64_t i = 0; i < NV; ++i) {
        const vec r = a[i] * s;
        if (!stream)
            *reinterpret_cast<vec_unaligned*>(o + i * L) = r;
        else if constexpr (std::is_same_v<T, float>)
            _mm256_stream_ps(o + i * L, reinterpret_cast<__m256>(r));
        else
            _mm256_stream_pd(o + i * L, reinterpret_cast<__m256d>(r));
    }
}
#endif

// o[0:D) = s * (row edges [b, e) of the SpMM): one pass over the edges per CH-column chunk;
// CH = 512 bytes of accumulators (a 128-wide float32 row in one pass: the accumulators live in
// registers, and each edge's index is read once). S = the stored type of X: T, or uint16_t
// (bfloat16 bits) with T = float. Always inlined: a call per row cost about 5 % on 128-wide rows.
template <typename T, typename S, bool WEIGHTED, bool INDEXED, bool COLSCALE>
[[gnu::always_inline]] inline void spmm_row(T* o, const int64_t* indices, int64_t b, int64_t e, int64_t nnz,
                                            const S* X, int64_t D, T s, const T* w, const int64_t* widx, const T* cs,
                                            bool stream) {
    constexpr int64_t CH = 512 / sizeof(T);
    for (int64_t c = 0; c < D; c += CH) {
        const int64_t len = std::min(CH, D - c);
#if HPCGNN_KERNELS_AVX
        if (len == CH) {  // (rows of exactly one chunk are done by spmm_rows itself)
            gather_chunk_in_registers<T, S, WEIGHTED, INDEXED, COLSCALE, 0>(o + c, indices, b, e, nnz, X, D, c, w,
                                                                            widx, cs, s, stream);
            continue;
        }
#endif
        alignas(64) T acc[CH];
#pragma omp simd
        for (int64_t k = 0; k < CH; ++k) acc[k] = T(0);
        if constexpr (!std::is_same_v<S, T>)  // bfloat16 rows: chunks of up to 128 floats
            gather_part_float<S, WEIGHTED, INDEXED, COLSCALE>(acc, indices, b, e, nnz, X, D, c, len, w, widx, cs);
        else if (D == CH)  // one chunk per row: rows of CH * sizeof(T) / 64 lines
            gather_chunk<T, CH, true, WEIGHTED, INDEXED, COLSCALE, CH * sizeof(T) / 64>(acc, indices, b, e, nnz, X, D,
                                                                                        c, len, w, widx, cs);
        else if (len == CH)
            gather_chunk<T, CH, true, WEIGHTED, INDEXED, COLSCALE>(acc, indices, b, e, nnz, X, D, c, len, w, widx, cs);
        else if constexpr (std::is_same_v<T, float>)
            gather_part_float<T, WEIGHTED, INDEXED, COLSCALE>(acc, indices, b, e, nnz, X, D, c, len, w, widx, cs);
        else
            gather_chunk<T, CH, false, WEIGHTED, INDEXED, COLSCALE>(acc, indices, b, e, nnz, X, D, c, len, w, widx,
                                                                    cs);
        store_scaled(o + c, acc, len, s, stream);
    }
}

// True if some idx[0:n) is outside [0, limit) (negative values compare as huge unsigned ones).
inline bool any_index_outside(const int64_t* idx, int64_t n, int64_t limit) {
    uint64_t mx = 0;
#pragma omp simd reduction(max : mx)
    for (int64_t j = 0; j < n; ++j) mx = std::max(mx, static_cast<uint64_t>(idx[j]));
    return n > 0 && mx >= static_cast<uint64_t>(limit);
}

// The SpMM's rows (spmm_row), to the threads in tasks of kRowsPerTask rows. A task first
// checks its edges' source indices against [0, n_src) and computes nothing if one is outside.
// The indices are then in L1 for its gathers: faster than the separate pass over all indices
// this replaced (which took about 4 % of a 128-wide SpMM), and up to 20 % faster than no
// check at all when memory is slow. Rows of exactly one chunk (D == CH) take
// gather_chunk_in_registers directly, with c == 0 known at compile time (through spmm_row the
// per-row code was 5 % slower). Returns true if an index was outside; `out` is then partly
// written.
template <typename T, typename S, bool WEIGHTED, bool INDEXED, bool COLSCALE>
bool spmm_rows(const Csr& g, const T* w, const int64_t* widx, const S* X, int64_t n_src, int64_t D,
               const T* row_scale, const T* cs, T* out) {
    const int64_t* indptr = g.indptr;
    const bool stream = can_stream(out, g.rows, D);
    const int64_t tasks = (g.rows + kRowsPerTask - 1) / kRowsPerTask;
    bool bad = false;
#pragma omp parallel if (worth_threads(g.rows, g.nnz, D)) reduction(|| : bad)
    {
#pragma omp for schedule(dynamic, 1) nowait
        for (int64_t t = 0; t < tasks; ++t) {
            const int64_t v0 = t * kRowsPerTask, v1 = std::min(g.rows, v0 + kRowsPerTask);
            if (any_index_outside(g.indices + indptr[v0], indptr[v1] - indptr[v0], n_src)) {
                bad = true;
                continue;
            }
#if HPCGNN_KERNELS_AVX
            constexpr int64_t CH = 512 / sizeof(T);
            if (D == CH) {  // rows of one chunk, CH * sizeof(S) / 64 lines
                for (int64_t v = v0; v < v1; ++v)
                    gather_chunk_in_registers<T, S, WEIGHTED, INDEXED, COLSCALE, CH * sizeof(S) / 64>(
                        out + v * D, g.indices, indptr[v], indptr[v + 1], g.nnz, X, D, 0, w, widx, cs,
                        row_scale ? row_scale[v] : T(1), stream);
                continue;
            }
#endif
            for (int64_t v = v0; v < v1; ++v)
                spmm_row<T, S, WEIGHTED, INDEXED, COLSCALE>(out + v * D, g.indices, indptr[v], indptr[v + 1], g.nnz, X,
                                                            D, row_scale ? row_scale[v] : T(1), w, widx, cs, stream);
        }
        store_fence(stream);
    }
    return bad;
}

// X stored as S: T itself, or uint16_t bfloat16 bit patterns with T = float (widened exactly;
// half the bytes gathered per edge, same sums in the same order as the float32 rows).
template <typename T, typename S, bool COLSCALE>
bool spmm_dispatch(const Csr& g, const T* w, const int64_t* widx, const S* X, int64_t n_src, int64_t D,
                   const T* row_scale, const T* cs, T* out) {
    if (!w) return spmm_rows<T, S, false, false, COLSCALE>(g, w, widx, X, n_src, D, row_scale, cs, out);
    if (!widx) return spmm_rows<T, S, true, false, COLSCALE>(g, w, widx, X, n_src, D, row_scale, cs, out);
    return spmm_rows<T, S, true, true, COLSCALE>(g, w, widx, X, n_src, D, row_scale, cs, out);
}

// out = the SpMM over X's n_src rows; true (and out partly written) if a source index is
// outside [0, n_src) (see spmm_rows).
template <typename T, typename S>
bool spmm_run(const Csr& g, const T* w, const int64_t* widx, const S* X, int64_t n_src, int64_t D,
              const T* row_scale, const T* col_scale, T* out) {
    if (col_scale) return spmm_dispatch<T, S, true>(g, w, widx, X, n_src, D, row_scale, col_scale, out);
    return spmm_dispatch<T, S, false>(g, w, widx, X, n_src, D, row_scale, col_scale, out);
}

// ---- multi-head SpMM: out[v, h, :] = sum_j alpha[j, h] * Z[indices[j], h, :] -------------------
//                      (+ self_w[v, h] * Z[v, h, :] for v < n_self)

// One output chunk of destination row v, accumulated in a local array (registers for the
// compile-time modes). Chunk layouts of the flattened [H*D] row:
//   kHeadFull  CH columns of one head (D >= CH)        kHeadPart  fewer than CH columns of one head
//   kGroupFull CH/DD whole heads, D == DD (compile-time) kGroupPart gc whole heads, runtime D
enum HeadsMode { kHeadFull, kHeadPart, kGroupFull, kGroupPart };

template <typename T, int64_t CH, HeadsMode MODE, int64_t DD>
inline void heads_accumulate(T* acc, const T* a, const T* z, int64_t gc, int64_t D, int64_t len) {
    if constexpr (MODE == kHeadFull) {
        const T a0 = a[0];
#pragma omp simd
        for (int64_t k = 0; k < CH; ++k) acc[k] += a0 * z[k];
    } else if constexpr (MODE == kHeadPart) {
        const T a0 = a[0];
#pragma omp simd
        for (int64_t k = 0; k < len; ++k) acc[k] += a0 * z[k];
    } else if constexpr (MODE == kGroupFull) {
        for (int64_t g = 0; g < CH / DD; ++g) {
            const T ag = a[g];
#pragma omp simd
            for (int64_t k = 0; k < DD; ++k) acc[g * DD + k] += ag * z[g * DD + k];
        }
    } else {
        for (int64_t g = 0; g < gc; ++g) {
            const T ag = a[g];
#pragma omp simd
            for (int64_t k = 0; k < D; ++k) acc[g * D + k] += ag * z[g * D + k];
        }
    }
}

// o[0:len) = sum_j alpha[j, h0:h0+gc] * Z[u_j, off:off+len) (+ self term), see HeadsMode.
template <typename T, int64_t CH, HeadsMode MODE, int64_t DD>
inline void heads_chunk(T* o, const int64_t* indices, int64_t b, int64_t e, int64_t nnz, bool first, int64_t pf,
                        const T* alpha, const int64_t* aidx, int64_t H, int64_t h0, int64_t gc, const T* Z,
                        int64_t HD, int64_t off, int64_t D, int64_t len, const T* self_a, const T* self_z) {
    const int64_t row_bytes = HD * static_cast<int64_t>(sizeof(T));
    T acc[CH];
#pragma omp simd
    for (int64_t k = 0; k < CH; ++k) acc[k] = T(0);
    for (int64_t j = b; j < e; ++j) {
        if (first && j + pf < nnz) {
            prefetch_bytes(Z + indices[j + pf] * HD, row_bytes);
            if (aidx) prefetch_bytes(alpha + aidx[j + pf] * H, H * static_cast<int64_t>(sizeof(T)));
        }
        heads_accumulate<T, CH, MODE, DD>(acc, alpha + (aidx ? aidx[j] : j) * H + h0, Z + indices[j] * HD + off,
                                          gc, D, len);
    }
    if (self_a) heads_accumulate<T, CH, MODE, DD>(acc, self_a, self_z, gc, D, len);
#pragma omp simd
    for (int64_t k = 0; k < len; ++k) o[k] = acc[k];
}

// Heads narrower than a chunk (D < CH, CH % D == 0) are grouped CH / D per chunk, so a row
// takes H*D/CH passes over its edges; wider heads take chunks of CH columns each.
template <typename T, int64_t DD>
void spmm_heads_rows(const Csr& g, const T* alpha, const int64_t* aidx, const T* Z, int64_t H, int64_t D,
                     const T* self_w, int64_t n_self, T* out) {
    constexpr int64_t CH = 256 / sizeof(T);
    const int64_t* indptr = g.indptr;
    const int64_t* indices = g.indices;
    const int64_t nnz = g.nnz, HD = H * D;
    const int64_t pf = prefetch_distance(HD * static_cast<int64_t>(sizeof(T)));
    const bool grouped = D < CH && CH % D == 0;
    const int64_t G = grouped ? CH / D : 1;
#pragma omp parallel for schedule(dynamic, kRowsPerTask) if (worth_threads(g.rows, g.nnz, HD))
    for (int64_t v = 0; v < g.rows; ++v) {
        const int64_t b = indptr[v], e = indptr[v + 1];
        const bool self = v < n_self;
        T* orow = out + v * HD;
        const T* zself = Z + v * HD;
        if (grouped) {
            for (int64_t h0 = 0; h0 < H; h0 += G) {
                const int64_t gc = std::min(G, H - h0), off = h0 * D;
                const T* sa = self ? self_w + v * H + h0 : nullptr;
                if (DD > 0 && gc == G)
                    heads_chunk<T, CH, kGroupFull, (DD > 0 ? DD : 1)>(orow + off, indices, b, e, nnz, h0 == 0, pf,
                                                                      alpha, aidx, H, h0, gc, Z, HD, off, D,
                                                                      gc * D, sa, zself + off);
                else
                    heads_chunk<T, CH, kGroupPart, 0>(orow + off, indices, b, e, nnz, h0 == 0, pf, alpha, aidx, H,
                                                      h0, gc, Z, HD, off, D, gc * D, sa, zself + off);
            }
        } else {
            for (int64_t h = 0; h < H; ++h) {
                const T* sa = self ? self_w + v * H + h : nullptr;
                for (int64_t c = 0; c < D; c += CH) {
                    const int64_t off = h * D + c, len = std::min(CH, D - c);
                    const bool first = h == 0 && c == 0;
                    if (len == CH)
                        heads_chunk<T, CH, kHeadFull, 0>(orow + off, indices, b, e, nnz, first, pf, alpha, aidx, H, h,
                                                         1, Z, HD, off, D, len, sa, zself + off);
                    else
                        heads_chunk<T, CH, kHeadPart, 0>(orow + off, indices, b, e, nnz, first, pf, alpha, aidx, H, h,
                                                         1, Z, HD, off, D, len, sa, zself + off);
                }
            }
        }
    }
}

template <typename T>
void spmm_heads_run(const Csr& g, const T* a, const int64_t* aidx, const T* z, int64_t H, int64_t D,
                    const T* self_w, int64_t n_self, T* o) {
    constexpr bool F = sizeof(T) == 4;  // chunk = 64 floats or 32 doubles; DD must be < chunk
    if (D == 4) spmm_heads_rows<T, 4>(g, a, aidx, z, H, D, self_w, n_self, o);
    else if (D == 8) spmm_heads_rows<T, 8>(g, a, aidx, z, H, D, self_w, n_self, o);
    else if (D == 16) spmm_heads_rows<T, 16>(g, a, aidx, z, H, D, self_w, n_self, o);
    else if (F && D == 32) spmm_heads_rows<T, F ? 32 : 0>(g, a, aidx, z, H, D, self_w, n_self, o);
    else spmm_heads_rows<T, 0>(g, a, aidx, z, H, D, self_w, n_self, o);
}

// ---- SDDMM: out[j, h] = <A[v, h, :], B[indices[j], h, :]> for edge j of row v -------------------
//             (self_out[v, h] = <A[v, h, :], B[v, h, :]> for v < n_self)

template <typename T, int64_t DD>
inline void head_dots(const T* a, const T* b, int64_t H, int64_t D, T* out) {
    for (int64_t h = 0; h < H; ++h) {
        T s = T(0);
        if constexpr (DD > 0) {
#pragma omp simd reduction(+ : s)
            for (int64_t k = 0; k < DD; ++k) s += a[h * DD + k] * b[h * DD + k];
        } else {
#pragma omp simd reduction(+ : s)
            for (int64_t k = 0; k < D; ++k) s += a[h * D + k] * b[h * D + k];
        }
        out[h] = s;
    }
}

template <typename T, int64_t DD>
void sddmm_rows(const Csr& g, const T* A, const T* B, int64_t H, int64_t D, T* out, T* self_out, int64_t n_self) {
    const int64_t* indptr = g.indptr;
    const int64_t* indices = g.indices;
    const int64_t nnz = g.nnz, HD = H * D, row_bytes = HD * static_cast<int64_t>(sizeof(T));
    const int64_t pf = prefetch_distance(row_bytes);
#pragma omp parallel for schedule(dynamic, kRowsPerTask) if (worth_threads(g.rows, g.nnz, HD))
    for (int64_t v = 0; v < g.rows; ++v) {
        const T* a_row = A + v * HD;
        for (int64_t j = indptr[v]; j < indptr[v + 1]; ++j) {
            if (j + pf < nnz) prefetch_bytes(B + indices[j + pf] * HD, row_bytes);
            head_dots<T, DD>(a_row, B + indices[j] * HD, H, D, out + j * H);
        }
        if (v < n_self) head_dots<T, DD>(a_row, B + v * HD, H, D, self_out + v * H);
    }
}

template <typename T>
void sddmm_run(const Csr& g, const T* a, const T* b, int64_t H, int64_t D, T* o, T* so, int64_t n_self) {
    if (D == 8) sddmm_rows<T, 8>(g, a, b, H, D, o, so, n_self);
    else if (D == 16) sddmm_rows<T, 16>(g, a, b, H, D, o, so, n_self);
    else if (D == 32) sddmm_rows<T, 32>(g, a, b, H, D, o, so, n_self);
    else if (D == 64) sddmm_rows<T, 64>(g, a, b, H, D, o, so, n_self);
    else sddmm_rows<T, 0>(g, a, b, H, D, o, so, n_self);
}

}  // namespace HPCGNN_ISA_NS
