// sampler kernels (to be filled in by the sampler work; see native/common.h for conventions).
#include "common.h"

PYBIND11_MODULE(_native_sampler, m) {
    hpcgnn::add_thread_control(m);
}
