// Dropout with a counter-based mask: element i of a call with key `seed` is kept iff
// hash32(key + i) >= p * 2^32, key = 32 bits of splitmix64(seed, i / 2^30) (one integer hash
// per element, 8 lanes wide in the AVX2 copy, isa.h). The mask is
// a pure function of (seed, i): backward regenerates it instead of storing it, and the
// result is identical for any thread count. torch's CPU dropout draws its Bernoulli mask
// element by element on one thread (1.9 s for 100M float32 elements on the dev machine;
// this kernel 0.07 s on one thread, memory bound).
#include "common.h"
#include "isa.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace hpcgnn {
namespace {

constexpr int64_t kParallelMin = 1 << 15;

// Threshold t with P(u32 draw < t) = p for p in [0, 1) (p resolved to 2^-32).
uint32_t drop_threshold(double p) {
    const double t = std::ldexp(p, 32);
    return t >= 4294967295.0 ? ~uint32_t(0) : static_cast<uint32_t>(t);
}

constexpr int64_t kBlock = int64_t(1) << 30;  // elements per 32-bit key

// ---- the kernel, compiled per instruction set (dropout_kernels.h, isa.h) --------------------

#define HPCGNN_ISA_NS base
#include "dropout_kernels.h"
#undef HPCGNN_ISA_NS
#if HPCGNN_X86_64
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#define HPCGNN_ISA_NS avx2
#include "dropout_kernels.h"
#undef HPCGNN_ISA_NS
#pragma GCC pop_options
#endif

template <typename T>
bool try_apply(const py::object& x_o, const py::object& out_o, double p, uint64_t seed, bool relu) {
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
    HPCGNN_ISA_CALL(apply<T>, xp, op, n, p, seed, relu);
    return true;
}

void dropout(const py::object& x, const py::object& out, double p, uint64_t seed, bool relu) {
    require(p >= 0.0 && p < 1.0, "dropout: p must be in [0, 1)");
    if (try_apply<float>(x, out, p, seed, relu) || try_apply<double>(x, out, p, seed, relu)) return;
    throw std::invalid_argument("x: expected a C-contiguous float32 or float64 numpy array");
}

template <typename T>
bool try_backward(const py::object& g_o, const py::object& out_o, const py::object& gi_o, double p) {
    using arr = py::array_t<T, py::array::c_style>;
    if (!py::isinstance<arr>(g_o)) return false;
    auto g = py::reinterpret_borrow<arr>(g_o);
    require(py::isinstance<arr>(out_o) && py::isinstance<arr>(gi_o),
            "out, grad_in: expected C-contiguous arrays of grad's dtype");
    auto out = py::reinterpret_borrow<arr>(out_o);
    auto gi = py::reinterpret_borrow<arr>(gi_o);
    require(out.size() == g.size() && gi.size() == g.size(), "out, grad_in: expected as many elements as grad");
    require(gi.writeable(), "grad_in: output array is read-only");
    const T* gp = g.data();
    const T* op = out.data();
    T* ip = gi.mutable_data();
    const int64_t n = g.size();
    const T scale = static_cast<T>(1.0 / (1.0 - p));
    py::gil_scoped_release nogil;
    HPCGNN_ISA_CALL(relu_dropout_backward<T>, gp, op, ip, n, scale);
    return true;
}

void relu_dropout_backward(const py::object& g, const py::object& out, const py::object& gi, double p) {
    require(p >= 0.0 && p < 1.0, "relu_dropout_backward: p must be in [0, 1)");
    if (try_backward<float>(g, out, gi, p) || try_backward<double>(g, out, gi, p)) return;
    throw std::invalid_argument("grad: expected a C-contiguous float32 or float64 numpy array");
}

}  // namespace
}  // namespace hpcgnn

PYBIND11_MODULE(_native_dropout, m) {
    using namespace hpcgnn;
    m.doc() = "Dropout with a counter-based (seed, element) mask (OpenMP).";
    add_thread_control(m);
    HPCGNN_ADD_ISA_INFO(m);
    m.def("dropout", &dropout, py::arg("x"), py::arg("out"), py::arg("p"), py::arg("seed"),
          py::arg("relu") = false,
          "out[i] = x[i] / (1 - p) if element i is kept under `seed`, else 0 (P(drop) = p); with relu, "
          "max(x[i], 0) in place of x[i] (one pass). x and out: C-contiguous float32 or float64 of the "
          "same size (out may be x). The same seed gives the same mask, so applying it to the output "
          "gradient is the backward pass (without relu).");
    m.def("relu_dropout_backward", &relu_dropout_backward, py::arg("grad"), py::arg("out"),
          py::arg("grad_in"), py::arg("p"),
          "grad_in[i] = grad[i] / (1 - p) where out[i] > 0, else 0: the backward of dropout(relu=True) "
          "from its output `out`. C-contiguous float32 or float64 arrays of one size.");
}
