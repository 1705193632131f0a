// Shared helpers for the hpcgnn native kernels.
//
// Arrays cross from Python as numpy buffers (pybind11 array_t, C-contiguous,
// forcecast off where the dtype is part of the contract) and are used in place:
// no copies on the way in. Outputs are allocated here and handed to numpy.
#pragma once
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace py = pybind11;

namespace hpcgnn {

template <typename T>
using carray = py::array_t<T, py::array::c_style>;  // no forcecast: dtype must match

// Pointer to the data of a contiguous 1-D (or n-D) input array.
template <typename T>
inline const T* in_ptr(const carray<T>& a) { return a.data(); }

template <typename T>
inline T* out_ptr(carray<T>& a) { return a.mutable_data(); }

// New 1-D numpy array of n elements.
template <typename T>
inline carray<T> new_array(int64_t n) { return carray<T>(static_cast<py::ssize_t>(n)); }

// Move a std::vector into a numpy array without copying its contents twice.
template <typename T>
inline carray<T> from_vector(std::vector<T>&& v) {
    auto* heap = new std::vector<T>(std::move(v));
    py::capsule owner(heap, [](void* p) { delete static_cast<std::vector<T>*>(p); });
    return carray<T>({static_cast<py::ssize_t>(heap->size())}, {sizeof(T)}, heap->data(), owner);
}

inline void require(bool ok, const std::string& what) {
    if (!ok) throw std::invalid_argument(what);
}

// splitmix64: the golden-ratio increment and the finaliser, a good 64-bit integer hash.
// Shared by the sampler's random streams, the cache's hash table and dropout's keys.
constexpr uint64_t kGolden = 0x9e3779b97f4a7c15ULL;

inline uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

}  // namespace hpcgnn

// Each kernel family is its own extension module: native/<family>.cpp defines
// PYBIND11_MODULE(_native_<family>, m) and calls hpcgnn::add_thread_control(m).
#include <omp.h>

namespace hpcgnn {
inline void add_thread_control(py::module_& m) {
    // OpenMP's nthreads-var is a per-thread ICV: both calls act on the calling thread only.
    m.def("set_threads", [](int n) { omp_set_num_threads(n); }, py::arg("n"),
          "Set the OpenMP thread count of this module's kernels started from the calling thread.");
    m.def("max_threads", []() { return omp_get_max_threads(); });
    m.def("team_size", []() {
        int n = 1;
#pragma omp parallel
        {
#pragma omp single
            n = omp_get_num_threads();
        }
        return n;
    }, "Threads of a parallel region started from the calling thread (what a kernel gets).");
}
}  // namespace hpcgnn
