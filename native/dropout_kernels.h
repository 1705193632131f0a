// The dropout kernel of native/dropout.cpp, included once per instruction set (see
// spmm_kernels.h and isa.h for the scheme). No include guard on purpose.

namespace HPCGNN_ISA_NS {

// 32-bit integer hash with low bias (Wellons' "lowbias32"); vectorises with AVX2.
inline uint32_t hash32(uint32_t x) {
    x ^= x >> 16;
    x *= 0x7feb352dU;
    x ^= x >> 15;
    x *= 0x846ca68bU;
    x ^= x >> 16;
    return x;
}

// One block of elements under one 32-bit key. Relu: max(x[i], 0) (NaN kept) in place of x[i].
template <typename T, bool Relu>
inline void apply_block(const T* xb, T* ob, int64_t m, uint32_t key, uint32_t thr, T scale) {
#pragma omp parallel for simd schedule(static) if (m > kParallelMin)
    for (int64_t i = 0; i < m; ++i) {
        // Multiply unconditionally (x * 0 for a dropped element, NaN for NaN as in torch): a
        // conditional multiply is a branch per element (-ftrapping-math), 10x slower.
        const uint32_t r = hash32(key + static_cast<uint32_t>(i));
        const T v = Relu ? (xb[i] < T(0) ? T(0) : xb[i]) : xb[i];
        ob[i] = v * (r >= thr ? scale : T(0));
    }
}

template <typename T>
void apply(const T* x, T* out, int64_t n, double p, uint64_t seed, bool relu) {
    const uint32_t thr = drop_threshold(p);
    const T scale = static_cast<T>(1.0 / (1.0 - p));
    for (int64_t b = 0; b < n; b += kBlock) {
        const uint32_t key = static_cast<uint32_t>(mix64(seed + static_cast<uint64_t>(b / kBlock + 1) * kGolden));
        const int64_t e = std::min(n, b + kBlock);
        if (relu) {
            apply_block<T, true>(x + b, out + b, e - b, key, thr, scale);
        } else {
            apply_block<T, false>(x + b, out + b, e - b, key, thr, scale);
        }
    }
}

// Backward of ReLU followed by dropout, from the forward's output: g_in[i] = g[i] * scale
// where out[i] > 0 (kept and positive), else 0.
template <typename T>
void relu_dropout_backward(const T* g, const T* out, T* gi, int64_t n, T scale) {
    // Branch-free: the product's bits ANDed with an all-ones/all-zeros mask of out > 0. A
    // conditional (even with the product hoisted) compiles to a branch per element, taken at
    // random at dropout 0.5: 5-8x slower than the forward pass. Same values: g * scale where
    // the output is positive, +0 elsewhere whatever g holds there.
    using U = std::conditional_t<sizeof(T) == 4, uint32_t, uint64_t>;
#pragma omp parallel for simd schedule(static) if (n > kParallelMin)
    for (int64_t i = 0; i < n; ++i) {
        const T p = g[i] * scale;
        U bits;
        std::memcpy(&bits, &p, sizeof(T));
        bits &= U(0) - static_cast<U>(out[i] > T(0));
        std::memcpy(gi + i, &bits, sizeof(T));
    }
}

}  // namespace HPCGNN_ISA_NS
