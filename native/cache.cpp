// cache kernels (to be filled in by the cache work; see native/common.h for conventions).
#include "common.h"

PYBIND11_MODULE(_native_cache, m) {
    hpcgnn::add_thread_control(m);
}
