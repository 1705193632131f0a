// spmm kernels (to be filled in by the spmm work; see native/common.h for conventions).
#include "common.h"

PYBIND11_MODULE(_native_spmm, m) {
    hpcgnn::add_thread_control(m);
}
