// Dropout with a counter-based mask: element i of a call with key `seed` is kept iff
// hash32(key + i) >= p * 2^32, key = 32 bits of splitmix64(seed, i / 2^30) (one integer hash
// per element, 8 lanes wide with AVX2). The mask is
// a pure function of (seed, i): backward regenerates it instead of storing it, and the
// result is identical for any thread count. torch's CPU dropout draws its Bernoulli mask
// element by element on one thread (1.9 s for 100M float32 elements on the dev machine;
// this kernel 0.07 s on one thread, memory bound).
#include "common.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace hpcgnn {
namespace {

constexpr int64_t kParallelMin = 1 << 15;

// 32-bit integer hash with low bias (Wellons' "lowbias32"); vectorises with AVX2.
inline uint32_t hash32(uint32_t x) {
    x ^= x >> 16;
    x *= 0x7feb352dU;
    x ^= x >> 15;
    x *= 0x846ca68bU;
    x ^= x >> 16;
    return x;
}

// Threshold t with P(u32 draw < t) = p for p in [0, 1) (p resolved to 2^-32).
uint32_t drop_threshold(double p) {
    const double t = std::ldexp(p, 32);
    return t >= 4294967295.0 ? ~uint32_t(0) : static_cast<uint32_t>(t);
}

constexpr int64_t kBlock = int64_t(1) << 30;  // elements per 32-bit key

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

template <typename T>
bool try_apply(const py::object& x_o, const py::object& out_o, double p, uint64_t seed) {
    using arr = py::array_t<T, py::array::c_style>;
    if (!py::isinstance<arr>(x_o)) return false;
    auto x = py::reinterpret_borrow<arr>(x_o);
    require(py::isinstance<arr>(out_o), "out: expected a C-contiguous array of x's dtype");
    auto out = py::reinterpret_borrow<arr>(out_o);
    require(out.size() == x.size(), "out: expected as many elements as x");
    require(out.writeable(), "out: output array is read-only");
    const T* xp = x.data();
    T* op = out.mutable_data();
    const int64_t n = x.size();
    py::gil_scoped_release nogil;
    apply<T>(xp, op, n, p, seed);
    return true;
}

void dropout(const py::object& x, const py::object& out, double p, uint64_t seed) {
    require(p >= 0.0 && p < 1.0, "dropout: p must be in [0, 1)");
    if (try_apply<float>(x, out, p, seed) || try_apply<double>(x, out, p, seed)) return;
    throw std::invalid_argument("x: expected a C-contiguous float32 or float64 numpy array");
}

}  // namespace
}  // namespace hpcgnn

PYBIND11_MODULE(_native_dropout, m) {
    using namespace hpcgnn;
    m.doc() = "Dropout with a counter-based (seed, element) mask (OpenMP).";
    add_thread_control(m);
    m.def("dropout", &dropout, py::arg("x"), py::arg("out"), py::arg("p"), py::arg("seed"),
          "out[i] = x[i] / (1 - p) if element i is kept under `seed`, else 0 (P(drop) = p). x and out: "
          "C-contiguous float32 or float64 of the same size (out may be x). The same seed gives the same "
          "mask, so applying it to the output gradient is the backward pass.");
}
