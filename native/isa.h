// Run-time choice of the instruction set for the vectorised kernels.
//
// native/ is compiled for a portable baseline by default (-march=x86-64-v2 on x86-64: SSE4.2,
// POPCNT; see setup.py), so a module built on a login node also runs on older compute nodes.
// A family with kernels that gain from wider vectors (spmm, dropout) compiles them twice, from a
// kernels header included once in namespace `base` (the build's -march) and once in namespace
// `avx2` under `#pragma GCC target("avx2,fma")`, and calls them through
// HPCGNN_ISA_CALL, which takes the avx2 copy when the CPU running the module has AVX2 and FMA.
// HPCGNN_NATIVE_ISA=baseline in the environment forces the baseline copy (to compare the two;
// read once, when a module first dispatches). Other architectures (aarch64) have the base
// copy only. setup.py passes the -march it used as HPCGNN_BUILD_ARCH.
#pragma once

#include <cstdlib>
#include <cstring>
#include <string>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)  // clang: no #pragma GCC target
#define HPCGNN_X86_64 1
#include <immintrin.h>
#else
#define HPCGNN_X86_64 0
#endif

#ifndef HPCGNN_BUILD_ARCH
#define HPCGNN_BUILD_ARCH "default"
#endif

namespace hpcgnn {

// True if this CPU can run the avx2 kernel copies (AVX2 and FMA; the OS saves AVX state).
inline bool cpu_has_avx2() {
#if HPCGNN_X86_64
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
    return false;
#endif
}

// The copy HPCGNN_ISA_CALL runs, decided once per module.
inline bool use_avx2() {
    static const bool avx2 = [] {
        const char* forced = std::getenv("HPCGNN_NATIVE_ISA");
        if (forced != nullptr && std::strcmp(forced, "baseline") == 0) return false;
        return cpu_has_avx2();
    }();
    return avx2;
}

// "avx2" or "baseline": the kernel copy this module runs.
inline std::string active_isa() { return use_avx2() ? "avx2" : "baseline"; }

}  // namespace hpcgnn

#if HPCGNN_X86_64
#define HPCGNN_ISA_CALL(fn, ...) (::hpcgnn::use_avx2() ? avx2::fn(__VA_ARGS__) : base::fn(__VA_ARGS__))
#else
#define HPCGNN_ISA_CALL(fn, ...) base::fn(__VA_ARGS__)
#endif

// m.isa() / m.build_arch() for a module's Python side.
#define HPCGNN_ADD_ISA_INFO(m)                                                                           \
    do {                                                                                                 \
        (m).def("isa", &::hpcgnn::active_isa,                                                            \
                "'avx2' if the vectorised kernels run their AVX2+FMA copy (CPU support, "                \
                "HPCGNN_NATIVE_ISA not 'baseline'), else 'baseline'.");                                  \
        (m).attr("build_arch") = HPCGNN_BUILD_ARCH;                                                      \
    } while (0)
