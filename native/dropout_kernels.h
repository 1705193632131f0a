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

template <typename T>
void apply(const T* x, T* out, int64_t n, double p, uint64_t seed) {
    const uint32_t thr = drop_threshold(p);
    const T scale = static_cast<T>(1.0 / (1.0 - p));
    for (int64_t b = 0; b < n; b += kBlock) {
        const uint32_t key = static_cast<uint32_t>(mix64(seed + static_cast<uint64_t>(b / kBlock + 1) * kGolden));
        const int64_t e = std::min(n, b + kBlock);
        const T* xb = x + b;
        T* ob = out + b;
#pragma omp parallel for simd schedule(static) if (e - b > kParallelMin)
        for (int64_t i = 0; i < e - b; ++i) {
            // Multiply unconditionally (x * 0 for a dropped element, NaN for NaN as in torch): a
            // conditional multiply is a branch per element (-ftrapping-math), 10x slower.
            const uint32_t r = hash32(key + static_cast<uint32_t>(i));
            ob[i] = xb[i] * (r >= thr ? scale : T(0));
        }
    }
}

}  // namespace HPCGNN_ISA_NS
