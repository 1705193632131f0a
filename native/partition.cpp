// partition kernels (to be filled in by the partition work; see native/common.h for conventions).
#include "common.h"

PYBIND11_MODULE(_native_partition, m) {
    hpcgnn::add_thread_control(m);
}
